"""Live TP/PP-sharded Megatron models <-> Hugging Face tensors.

``load_hf_into_model`` fills this rank's shard of a model straight from safetensors (each rank reads
only the tensors its pipeline stage holds, each element copied once: from the file's pages into the
parameter). ``export_hf`` streams gathered, unpadded HF tensors from a live sharded model; it feeds
both ``save_hf_dir`` and a rollout engine's ``load_weights``.

Both run on every rank of the model-parallel group and take its ``ParallelGroups``:

    groups = initialize_parallel(tp, pp, seed)
    load_hf_into_model([model], "/models/Qwen3-1.7B-Base", groups)
    for name, tensor in export_hf([model], hf_config, groups):   # every rank must drain the generator
        ...

Export copies as little as it can and holds no full-model dict: at TP = 1 every HF tensor is a view
of its parameter except q / k / v (whose rows are interleaved per query group: one copy); at TP > 1
each rank's piece is all-gathered straight into the output tensor. Peak extra memory is one layer's
largest gathered tensor, not the model.

``export_policy`` is the one place where "every rank iterates, some consume" is written: the engine
sync, the async publications and the final model hand it what the consuming ranks do with the stream.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

import torch
import torch.distributed as dist
from megatron_mugrpo.conversion.errors import ConversionError
from megatron_mugrpo.conversion.hf_io import HfCheckpoint
from megatron_mugrpo.conversion.mappings import (
    TP_AXIS,
    ModelDims,
    TensorMap,
    architecture_maps,
    canonical_megatron_name,
    entry_for,
    expected_hf_shapes,
    fill_megatron_shard,
    hf_from_pieces,
    hf_pieces,
    shard_shape,
)
from torch import Tensor

from megatron_mugrpo.training import model as model_provider
from megatron_mugrpo.training.model import unwrap_model
from megatron_mugrpo.training.parallel import ParallelGroups

if TYPE_CHECKING:
    from megatron_mugrpo.training.setup import Policy

T = TypeVar("T")
NamedTensors = Iterator[tuple[str, Tensor]]
"""A stream of ``(hf_name, tensor)`` pairs, as ``export_hf`` yields them."""


def as_chunks(model_chunks: torch.nn.Module | Sequence[torch.nn.Module]) -> list[torch.nn.Module]:
    """A list of bare GPTModel chunks from one module or a list of (possibly DDP-wrapped) modules."""
    if isinstance(model_chunks, torch.nn.Module):
        model_chunks = [model_chunks]
    return [unwrap_model(chunk) for chunk in model_chunks]


def _layer_numbers(model: torch.nn.Module) -> dict[int, int]:
    """Local layer index -> global (0-based) layer index of this pipeline stage's layers."""
    decoder = getattr(model, "decoder", None)
    if decoder is None:
        return {}
    return {i: layer.layer_number - 1 for i, layer in enumerate(decoder.layers)}


def _expert_indices(model: torch.nn.Module) -> dict[int, list[int]]:
    """Local layer index -> global indices of the experts this rank holds, for each sparse layer."""
    decoder = getattr(model, "decoder", None)
    if decoder is None:
        return {}
    return {
        i: [int(e) for e in layer.mlp.local_expert_indices]
        for i, layer in enumerate(decoder.layers)
        if hasattr(layer.mlp, "local_expert_indices")
    }


def live_parameters(
    model: torch.nn.Module, hf_config: dict[str, Any]
) -> Iterator[tuple[TensorMap, torch.nn.Parameter]]:
    """(map entry, parameter) for every parameter of one model chunk, with global layer (and expert) indices.

    Cross-checks the declarative map against Megatron's own TP metadata (``partition_dim``).
    """
    layer_numbers, expert_indices = _layer_numbers(model), _expert_indices(model)
    for local_name, param in model.named_parameters():
        entry = entry_for(canonical_megatron_name(local_name, layer_numbers, expert_indices), hf_config)
        if getattr(param, "tensor_model_parallel", False) and param.partition_dim != TP_AXIS[entry.kind]:
            raise ConversionError(
                f"{entry.megatron}: the map splits it on axis {TP_AXIS[entry.kind]} but Megatron on axis "
                f"{param.partition_dim}; the '{entry.kind}' mapping is wrong for this megatron-core version"
            )
        yield entry, param


@torch.no_grad()
def load_hf_into_model(
    model_chunks: torch.nn.Module | Sequence[torch.nn.Module],
    hf_dir: str | Path | HfCheckpoint,
    groups: ParallelGroups,
) -> int:
    """Copy a HF checkpoint into this rank's shard of a live model; returns the number of parameters set.

    Validates the checkpoint first (missing / extra tensors, shapes against config.json) and every
    local shard's shape; raises ConversionError naming the tensor otherwise. Values are cast to the
    parameters' dtype on the way in.
    """
    ckpt = hf_dir if isinstance(hf_dir, HfCheckpoint) else HfCheckpoint(hf_dir)
    ckpt.validate()
    dims = ModelDims.from_hf(ckpt.config)
    count = 0
    for model in as_chunks(model_chunks):
        for entry, param in live_parameters(model, ckpt.config):
            split = tp_split(entry, groups)
            expected = shard_shape(entry, [ckpt.shape(n) for n in entry.hf], dims, tp=split.size)
            if expected != tuple(param.shape):
                raise ConversionError(
                    f"{entry.megatron} (from {list(entry.hf)}): TP shard shape {expected} does not "
                    f"match the model's {tuple(param.shape)}; was the model built from this config.json?"
                )
            hf = [ckpt.mapped(n) for n in entry.hf]
            fill_megatron_shard(param.data, entry, hf, dims, tp=split.size, rank=split.rank)
            count += 1
    return count


class TpSplit(NamedTuple):
    """The ranks one tensor is split over: its size, this rank's index, and their process group."""

    size: int
    rank: int
    group: Any


def tp_split(entry: TensorMap, groups: ParallelGroups) -> TpSplit:
    """An expert's weights are split over the expert-TP group (``groups.etp``), everything else over TP."""
    if ".local_experts." in entry.megatron:
        return TpSplit(groups.etp, groups.etp_rank, groups.etp_group)
    return TpSplit(groups.tp, groups.tp_rank, groups.tp_group)


def _gather_tp(entry: TensorMap, piece: Tensor, split: TpSplit) -> Tensor:
    """Every rank's ``piece`` of ``split`` concatenated along the entry's TP axis, gathered into the output.

    One rank or a replicated tensor: ``piece`` itself. Along rows (axis 0) the ranks' pieces land
    directly in their rows of the result; along columns (row-parallel weights) they are gathered
    into a staging buffer first and interleaved into the result.
    """
    axis, size = TP_AXIS[entry.kind], split.size
    if size == 1 or axis is None:
        return piece
    piece = piece.contiguous()
    if axis == 0:
        out = piece.new_empty((size * piece.shape[0], *piece.shape[1:]))
        dist.all_gather_into_tensor(out, piece, group=split.group)
        return out
    rows, cols = piece.shape
    staging = piece.new_empty((size * rows, cols))
    dist.all_gather_into_tensor(staging, piece, group=split.group)
    out = piece.new_empty((rows, size * cols))
    out.view(rows, size, cols).copy_(staging.view(size, rows, cols).transpose(0, 1))
    return out


def _owner_stages(local_names: set[str], groups: ParallelGroups) -> dict[str, int]:
    """Canonical Megatron name -> the pipeline stage that holds it (one all_gather_object over PP)."""
    if groups.pp == 1:
        return dict.fromkeys(local_names, 0)
    per_stage: list[Any] = [None] * groups.pp
    dist.all_gather_object(per_stage, sorted(local_names), group=groups.pp_group)
    owners: dict[str, int] = {}
    for stage in reversed(range(groups.pp)):  # a tied output copy on the last stage must not shadow stage 0
        owners.update(dict.fromkeys(per_stage[stage], stage))
    return owners


def _expert_owners(local_names: set[str], groups: ParallelGroups) -> dict[str, int]:
    """Canonical name of every expert weight of this pipeline stage -> the EP rank that holds it.

    One all_gather_object over the EP group; names every EP rank holds (attention, router, norms) are
    left out: each rank exports its own copy of those."""
    if groups.ep == 1:
        return {}
    per_rank: list[Any] = [None] * groups.ep
    experts = sorted(n for n in local_names if ".local_experts." in n)
    dist.all_gather_object(per_rank, experts, group=groups.ep_group)
    return {name: ep_rank for ep_rank, names in enumerate(per_rank) for name in names}


def _skip_on_export(entry: TensorMap, hf_config: dict[str, Any]) -> bool:
    """The tied output layer is a copy of the embedding: HF stores it once, as embed_tokens."""
    return entry.megatron == "output_layer.weight" and model_provider.tie_word_embeddings(hf_config)


@torch.no_grad()
def export_hf(
    model_chunks: torch.nn.Module | Sequence[torch.nn.Module], hf_config: dict[str, Any], groups: ParallelGroups
) -> Iterator[tuple[str, Tensor]]:
    """Stream ``(hf_name, tensor)`` pairs of the full model from a live TP/PP-sharded model.

    Every rank yields every tensor (full HF shape, unpadded vocabulary, the parameters' dtype and
    device): TP pieces are all-gathered within the owning stage, then broadcast over the PP group.
    All ranks of the model-parallel group must iterate the generator to the end, in step, because
    each tensor involves collectives. With expert parallelism an expert's weights are gathered over
    the expert-TP group (``groups.etp``) by the ranks that hold that expert, then broadcast over the EP
    group from them.

    A yielded tensor may share memory with a live parameter (no copy is made where none is needed):
    read or copy it before the parameters change, and never write to it.
    """
    chunks = as_chunks(model_chunks)
    local = {entry.megatron: (entry, param) for model in chunks for entry, param in live_parameters(model, hf_config)}
    if not local:
        raise ConversionError("export_hf: the model chunks hold no parameters")
    expert_owners = _expert_owners(set(local), groups)  # EP: each rank holds E / EP experts of each layer
    owners = _owner_stages(set(local) | set(expert_owners), groups)
    dims = ModelDims.from_hf(hf_config)
    shapes = expected_hf_shapes(hf_config)
    sample = next(iter(local.values()))[1]
    for entry in architecture_maps(hf_config):
        if _skip_on_export(entry, hf_config):
            continue
        if entry.megatron not in owners:
            raise ConversionError(f"export_hf: no pipeline stage holds {entry.megatron}; model and config disagree")
        owner = owners[entry.megatron]
        if owner == groups.pp_rank and entry.megatron in local:
            param = local[entry.megatron][1].detach()
            split = tp_split(entry, groups)
            pieces = hf_pieces(entry, param, dims, tp=split.size)
            tensors = [hf_from_pieces(entry, [_gather_tp(entry, piece, split)], dims) for piece in pieces]
        else:
            tensors = [torch.empty(shapes[n], dtype=sample.dtype, device=sample.device) for n in entry.hf]
        if owner == groups.pp_rank and entry.megatron in expert_owners:  # from the EP rank holding the expert
            src = dist.get_global_rank(groups.ep_group, expert_owners[entry.megatron])
            for tensor in tensors:
                dist.broadcast(tensor, src=src, group=groups.ep_group)
        if groups.pp > 1:
            src = dist.get_global_rank(groups.pp_group, owner)
            for tensor in tensors:
                dist.broadcast(tensor, src=src, group=groups.pp_group)
        yield from zip(entry.hf, tensors)


def export_policy(
    policy: Policy,
    hf_config: dict[str, Any],
    groups: ParallelGroups,
    *,
    consume: bool,
    use: Callable[[NamedTensors], T],
) -> T | None:
    """Export ``policy`` (collective); ``use(stream)`` where ``consume``, else drain it. Returns what ``use`` did.

    ``export_hf`` is collective over the model-parallel ranks, so every rank must iterate it to the end;
    only some use what it yields (engine hosts load it, rank 0 writes it). Taking ``use`` here means no
    caller can forget the draining side."""
    tensors = export_hf(policy.unwrapped(), hf_config, groups)
    if consume:
        return use(tensors)
    for _ in tensors:  # take part in the export's collectives
        pass
    return None


def load_hf_policy(hf_dir: str | Path, *, groups: ParallelGroups, **build: Any) -> Policy:
    """This rank's policy built from a Hugging Face directory's config.json and holding its weights.

    ``build`` goes to ``training.setup.build_policy`` (``dtype``, ``optim``, ``moe``, ...). One call
    instead of build + ``load_hf_into_model`` + ``weights_loaded``, so no caller forgets that an
    optimizer's fp32 main copies must re-read the loaded weights."""
    from megatron_mugrpo.training.setup import build_policy  # the trainer's heavy modules, on first use only

    ckpt = HfCheckpoint(hf_dir)
    policy = build_policy(ckpt.config, groups=groups, **build)
    load_hf_into_model(policy.unwrapped(), ckpt, groups)
    policy.weights_loaded()
    return policy
