"""Live TP/PP-sharded Megatron models <-> Hugging Face tensors.

``load_hf_into_model`` fills this rank's shard of a model straight from safetensors (each rank reads
only the tensors its pipeline stage holds). ``export_hf`` streams gathered, unpadded HF tensors
from a live sharded model; it feeds both ``save_hf_dir`` and a rollout engine's ``load_weights``.

Both run on every rank of the model-parallel group after ``initialize_parallel``:

    load_hf_into_model([model], "/models/Qwen3-1.7B-Base")
    for name, tensor in export_hf([model], hf_config):   # every rank must drain the generator
        ...
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from torch import Tensor

from conversion.errors import ConversionError
from conversion.hf_io import HfCheckpoint
from conversion.mappings import (
    TP_AXIS,
    ModelDims,
    TensorMap,
    architecture_maps,
    canonical_megatron_name,
    entry_for,
    expected_hf_shapes,
    to_hf,
    to_megatron_shard,
)
from megatron_mugrpo.training import model as model_provider


def unwrap_model(module: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside DDP / Float16Module wrappers (each exposes ``.module``)."""
    while hasattr(module, "module") and isinstance(module.module, torch.nn.Module):
        module = module.module
    return module


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


def live_parameters(
    model: torch.nn.Module, hf_config: dict[str, Any]
) -> Iterator[tuple[TensorMap, torch.nn.Parameter]]:
    """(map entry, parameter) for every parameter of one model chunk, with global layer indices.

    Cross-checks the declarative map against Megatron's own TP metadata (``partition_dim``).
    """
    layer_numbers = _layer_numbers(model)
    for local_name, param in model.named_parameters():
        entry = entry_for(canonical_megatron_name(local_name, layer_numbers), hf_config)
        if getattr(param, "tensor_model_parallel", False) and param.partition_dim != TP_AXIS[entry.kind]:
            raise ConversionError(
                f"{entry.megatron}: the map splits it on axis {TP_AXIS[entry.kind]} but Megatron on axis "
                f"{param.partition_dim}; the '{entry.kind}' mapping is wrong for this megatron-core version"
            )
        yield entry, param


def _tp() -> tuple[int, int, Any]:
    return (
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_tensor_model_parallel_group(),
    )


@torch.no_grad()
def load_hf_into_model(
    model_chunks: torch.nn.Module | Sequence[torch.nn.Module], hf_dir: str | Path | HfCheckpoint
) -> int:
    """Copy a HF checkpoint into this rank's shard of a live model; returns the number of parameters set.

    Validates the checkpoint first (missing / extra tensors, shapes against config.json) and every
    local shard's shape; raises ConversionError naming the tensor otherwise. Values are cast to the
    parameters' dtype.
    """
    ckpt = hf_dir if isinstance(hf_dir, HfCheckpoint) else HfCheckpoint(hf_dir)
    ckpt.validate()
    dims = ModelDims.from_hf(ckpt.config)
    tp, tp_rank, _ = _tp()
    count = 0
    for model in as_chunks(model_chunks):
        for entry, param in live_parameters(model, ckpt.config):
            shard = to_megatron_shard(entry, [ckpt.tensor(n) for n in entry.hf], dims, tp=tp, rank=tp_rank)
            if tuple(shard.shape) != tuple(param.shape):
                raise ConversionError(
                    f"{entry.megatron} (from {list(entry.hf)}): TP shard shape {tuple(shard.shape)} does not "
                    f"match the model's {tuple(param.shape)}; was the model built from this config.json?"
                )
            param.copy_(shard)
            count += 1
    return count


def _gather_tp(entry: TensorMap, param: Tensor, tp: int, group: Any) -> list[Tensor]:
    """Every TP rank's shard of ``param`` (in rank order); only this rank's copy when replicated."""
    local = param.detach()
    if tp == 1 or TP_AXIS[entry.kind] is None:
        return [local]
    shards = [torch.empty_like(local) for _ in range(tp)]
    dist.all_gather(shards, local.contiguous(), group=group)
    return shards


def _owner_stages(local_names: set[str]) -> dict[str, int]:
    """Canonical Megatron name -> the pipeline stage that holds it (one all_gather_object over PP)."""
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    if pp == 1:
        return dict.fromkeys(local_names, 0)
    per_stage: list[Any] = [None] * pp
    dist.all_gather_object(per_stage, sorted(local_names), group=parallel_state.get_pipeline_model_parallel_group())
    owners: dict[str, int] = {}
    for stage in reversed(range(pp)):  # a tied output copy on the last stage must not shadow stage 0
        owners.update(dict.fromkeys(per_stage[stage], stage))
    return owners


def _skip_on_export(entry: TensorMap, hf_config: dict[str, Any]) -> bool:
    """The tied output layer is a copy of the embedding: HF stores it once, as embed_tokens."""
    return entry.megatron == "output_layer.weight" and model_provider.tie_word_embeddings(hf_config)


@torch.no_grad()
def export_hf(
    model_chunks: torch.nn.Module | Sequence[torch.nn.Module], hf_config: dict[str, Any]
) -> Iterator[tuple[str, Tensor]]:
    """Stream ``(hf_name, tensor)`` pairs of the full model from a live TP/PP-sharded model.

    Every rank yields every tensor (full HF shape, unpadded vocabulary, the parameters' dtype and
    device): TP shards are all-gathered within the owning stage, then broadcast over the PP group.
    All ranks of the model-parallel group must iterate the generator to the end, in step, because
    each tensor involves collectives. Tensors are fresh buffers (safe to keep or move).
    """
    chunks = as_chunks(model_chunks)
    local = {entry.megatron: (entry, param) for model in chunks for entry, param in live_parameters(model, hf_config)}
    if not local:
        raise ConversionError("export_hf: the model chunks hold no parameters")
    owners = _owner_stages(set(local))
    dims = ModelDims.from_hf(hf_config)
    shapes = expected_hf_shapes(hf_config)
    tp, _, tp_group = _tp()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    sample = next(iter(local.values()))[1]
    for entry in architecture_maps(hf_config):
        if _skip_on_export(entry, hf_config):
            continue
        if entry.megatron not in owners:
            raise ConversionError(f"export_hf: no pipeline stage holds {entry.megatron}; model and config disagree")
        owner = owners[entry.megatron]
        if owner == pp_rank:
            _, param = local[entry.megatron]
            pairs = [
                (n, _detached_copy(t, param)) for n, t in to_hf(entry, _gather_tp(entry, param, tp, tp_group), dims)
            ]
        else:
            pairs = [(n, torch.empty(shapes[n], dtype=sample.dtype, device=sample.device)) for n in entry.hf]
        if pp > 1:
            src = dist.get_global_rank(pp_group, owner)
            for _, tensor in pairs:
                dist.broadcast(tensor, src=src, group=pp_group)
        yield from pairs


def _detached_copy(tensor: Tensor, param: Tensor) -> Tensor:
    """``tensor`` as a contiguous tensor that does not alias ``param`` (callers may keep or modify it)."""
    tensor = tensor.contiguous()
    if tensor.untyped_storage().data_ptr() == param.untyped_storage().data_ptr():
        tensor = tensor.clone()
    return tensor
