"""Declarative name maps between Hugging Face and Megatron parameters, one per architecture.

A ``TensorMap`` says which HF tensors make one Megatron parameter and how (its ``kind``); the
``kind`` picks a pair of pure functions from ``conversion.fused`` (TP shard / TP gather). Megatron
names are the canonical (Transformer Engine style, dist-checkpoint) names with the layer index as
``{layer}``; the local layer spec's ``input_layernorm`` / ``pre_mlp_layernorm`` are aliases of the
TE names (``canonical_megatron_name``), as in megatron-core's own ``sharded_state_dict_keys_map``.

    maps = architecture_maps(hf_config)                  # [TensorMap, ...] for the whole model
    shard = to_megatron_shard(entry, hf_tensors, dims, tp=2, rank=1)
    fill_megatron_shard(param, entry, hf_tensors, dims, tp=2, rank=1)   # the same, into a live tensor
    hf_tensors = to_hf(entry, shards, dims)

Mixture-of-experts layers (Qwen3-MoE) are more entries of the same kind: an expert's weights map with
``{expert}`` standing for its global index (``mlp.experts.{expert}.gate_proj`` etc. in HF, Megatron's
``mlp.experts.local_experts.{expert}.linear_fc1``), the router is replicated, and the sparse layer's
``pre_mlp_layernorm`` is a norm of its own (TE cannot fuse it into the experts), so it keeps its name.
Which layers are sparse is the config's (``training.moe.moe_layer_pattern``). Qwen2-MoE's shared expert
is three more entries of the same kinds: its gate / up / down projections map like a dense MLP's
(``mlp.shared_expert.*`` ↔ ``mlp.shared_experts.linear_fc1`` / ``linear_fc2``, TP-split like any gated
MLP, replicated over EP), and its sigmoid gate's [1, hidden] weight (``mlp.shared_expert_gate``) is
replicated as megatron-core's ``mlp.shared_experts.gate_weight``.

Export works per rank: ``hf_pieces`` cuts this rank's part of each HF tensor out of its shard
(views where the layout allows), and the HF tensor is the concatenation of every rank's piece
along ``TP_AXIS[kind]`` (``hf_from_pieces``; vocabulary padding dropped).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from megatron_mugrpo.conversion import fused
from megatron_mugrpo.conversion.errors import ConversionError
from torch import Tensor

from megatron_mugrpo.training import model as model_provider
from megatron_mugrpo.training import moe as moe_provider

LAYER = "{layer}"
EXPERT = "{expert}"


@dataclass(frozen=True)
class TensorMap:
    """One Megatron parameter and the HF tensors it is made from."""

    megatron: str
    """Canonical Megatron name; ``{layer}`` stands for the global layer index."""
    hf: tuple[str, ...]
    """HF names in the order the ``kind`` functions take them (e.g. q, k, v)."""
    kind: str
    """'replicated', 'column' (TP rows), 'row' (TP columns), 'qkv', 'gated_fc1' or 'vocab'."""

    @property
    def per_layer(self) -> bool:
        return LAYER in self.megatron

    @property
    def per_expert(self) -> bool:
        return EXPERT in self.megatron

    def at(self, layer: int | None, expert: int | None = None) -> TensorMap:
        """This entry with ``{layer}`` (and ``{expert}``) filled in (unchanged for non-layer entries)."""
        if layer is None or not self.per_layer:
            return self

        def fill(name: str) -> str:
            name = name.replace(LAYER, str(layer))
            return name if expert is None else name.replace(EXPERT, str(expert))

        return TensorMap(fill(self.megatron), tuple(fill(n) for n in self.hf), self.kind)


@dataclass(frozen=True)
class ModelDims:
    """The dimensions the fused-tensor functions need."""

    num_heads: int
    num_groups: int
    head_dim: int
    vocab_size: int
    """True (unpadded) vocabulary size, as in HF and the rollout engine."""

    @classmethod
    def from_hf(cls, hf_config: dict[str, Any]) -> ModelDims:
        return cls(
            num_heads=hf_config["num_attention_heads"],
            num_groups=model_provider.num_kv_heads(hf_config),
            head_dim=model_provider.head_dim(hf_config),
            vocab_size=hf_config["vocab_size"],
        )


_HF_LAYER = "model.layers.{layer}."
_MG_LAYER = "decoder.layers.{layer}."
_ATTN_QKV = (_HF_LAYER + "self_attn.q_proj", _HF_LAYER + "self_attn.k_proj", _HF_LAYER + "self_attn.v_proj")

_ATTENTION = (
    TensorMap(
        _MG_LAYER + "self_attention.linear_qkv.layer_norm_weight", (_HF_LAYER + "input_layernorm.weight",), "replicated"
    ),
    TensorMap(_MG_LAYER + "self_attention.linear_qkv.weight", tuple(p + ".weight" for p in _ATTN_QKV), "qkv"),
    TensorMap(_MG_LAYER + "self_attention.linear_proj.weight", (_HF_LAYER + "self_attn.o_proj.weight",), "row"),
)
_DENSE_MLP = (
    TensorMap(
        _MG_LAYER + "mlp.linear_fc1.layer_norm_weight", (_HF_LAYER + "post_attention_layernorm.weight",), "replicated"
    ),
    TensorMap(
        _MG_LAYER + "mlp.linear_fc1.weight",
        (_HF_LAYER + "mlp.gate_proj.weight", _HF_LAYER + "mlp.up_proj.weight"),
        "gated_fc1",
    ),
    TensorMap(_MG_LAYER + "mlp.linear_fc2.weight", (_HF_LAYER + "mlp.down_proj.weight",), "row"),
)
_DECODER_LAYER = _ATTENTION + _DENSE_MLP
_QKV_BIAS = (TensorMap(_MG_LAYER + "self_attention.linear_qkv.bias", tuple(p + ".bias" for p in _ATTN_QKV), "qkv"),)
_QK_NORM = (
    TensorMap(_MG_LAYER + "self_attention.q_layernorm.weight", (_HF_LAYER + "self_attn.q_norm.weight",), "replicated"),
    TensorMap(_MG_LAYER + "self_attention.k_layernorm.weight", (_HF_LAYER + "self_attn.k_norm.weight",), "replicated"),
)
_MG_EXPERT = _MG_LAYER + "mlp.experts.local_experts.{expert}."
_HF_EXPERT = _HF_LAYER + "mlp.experts.{expert}."
_SPARSE_MLP = (
    TensorMap(_MG_LAYER + "pre_mlp_layernorm.weight", (_HF_LAYER + "post_attention_layernorm.weight",), "replicated"),
    TensorMap(_MG_LAYER + "mlp.router.weight", (_HF_LAYER + "mlp.gate.weight",), "replicated"),
    TensorMap(
        _MG_EXPERT + "linear_fc1.weight", (_HF_EXPERT + "gate_proj.weight", _HF_EXPERT + "up_proj.weight"), "gated_fc1"
    ),
    TensorMap(_MG_EXPERT + "linear_fc2.weight", (_HF_EXPERT + "down_proj.weight",), "row"),
)
_MG_SHARED = _MG_LAYER + "mlp.shared_experts."
_HF_SHARED = _HF_LAYER + "mlp.shared_expert."
_SHARED_EXPERT = (
    TensorMap(
        _MG_SHARED + "linear_fc1.weight", (_HF_SHARED + "gate_proj.weight", _HF_SHARED + "up_proj.weight"), "gated_fc1"
    ),
    TensorMap(_MG_SHARED + "linear_fc2.weight", (_HF_SHARED + "down_proj.weight",), "row"),
    TensorMap(_MG_SHARED + "gate_weight", (_HF_LAYER + "mlp.shared_expert_gate.weight",), "replicated"),
)
_EMBEDDING = TensorMap("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab")
_FINAL_NORM = TensorMap("decoder.final_layernorm.weight", ("model.norm.weight",), "replicated")
_OUTPUT = TensorMap("output_layer.weight", ("lm_head.weight",), "vocab")
_TIED_OUTPUT = TensorMap("output_layer.weight", ("model.embed_tokens.weight",), "vocab")

ARCHITECTURES: dict[str, tuple[TensorMap, ...]] = {
    "qwen2": _DECODER_LAYER + _QKV_BIAS,
    "llama": _DECODER_LAYER,
    "qwen3": _DECODER_LAYER + _QK_NORM,
    "qwen3_moe": _DECODER_LAYER + _QK_NORM,  # its dense layers (mlp_only_layers)
    "qwen2_moe": _DECODER_LAYER + _QKV_BIAS,
}
"""Per-layer maps by HF ``model_type``; the embedding, final norm and LM head are shared by all."""
SPARSE_ARCHITECTURES: dict[str, tuple[TensorMap, ...]] = {
    "qwen3_moe": _ATTENTION + _QK_NORM + _SPARSE_MLP,
    "qwen2_moe": _ATTENTION + _QKV_BIAS + _SPARSE_MLP + _SHARED_EXPERT,
}
"""Per-layer maps of the mixture-of-experts layers, by HF ``model_type``."""
_EXPERT_INDEX = re.compile(r"\.local_experts\.(\d+)\.")
_GROUPED_EXPERT = re.compile(r"^mlp\.experts\.(linear_fc[12])\.weight(\d+)$")
"""Transformer Engine's grouped GEMM (``TEGroupedMLP``) keeps a layer's local experts in one module, expert
e's weight as ``linear_fc1.weight{e}``: the same tensor, in the same layout, as ``SequentialMLP``'s
``local_experts.{e}.linear_fc1.weight`` (megatron-core's own sharded state dicts of the two are
interchangeable), so it is an alias of that name."""

# Tensors some HF checkpoints carry that hold no weights (old RoPE caches).
IGNORED_HF_SUFFIXES = ("rotary_emb.inv_freq",)

# Local-spec parameter names -> canonical (TE) names: TE fuses the pre-norms into the next linear.
_LOCAL_ALIASES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}


_SPARSE_LOCAL_ALIASES = {k: v for k, v in _LOCAL_ALIASES.items() if not k.startswith("pre_mlp_layernorm.")}
"""A sparse layer's pre-MLP norm is its own module in TE too: only the attention norm is aliased."""


def layer_maps(hf_config: dict[str, Any], layer: int | None = None) -> tuple[TensorMap, ...]:
    """Per-layer entries (with ``{layer}``, ``{expert}``) of ``hf_config``'s architecture; a MoE model's
    sparse layers get the sparse entries (``layer`` None: the dense layers')."""
    arch = hf_config.get("model_type")
    if arch not in ARCHITECTURES:
        raise ConversionError(
            f"unknown architecture model_type={arch!r} (architectures={hf_config.get('architectures')}); "
            f"the converter supports {tuple(ARCHITECTURES)}"
        )
    sparse = arch in SPARSE_ARCHITECTURES and layer is not None and layer < hf_config["num_hidden_layers"]
    if sparse and moe_provider.moe_layer_pattern(hf_config)[layer]:
        return SPARSE_ARCHITECTURES[arch]
    return ARCHITECTURES[arch]


def _filled(entry: TensorMap, layer: int, hf_config: dict[str, Any]) -> list[TensorMap]:
    """``entry`` at ``layer``, once per expert for an expert's weights."""
    if not entry.per_expert:
        return [entry.at(layer)]
    return [entry.at(layer, expert) for expert in range(moe_provider.num_experts(hf_config))]


def global_maps(hf_config: dict[str, Any]) -> tuple[TensorMap, ...]:
    """Entries outside the decoder layers: embedding, final norm and (untied or tied) output layer."""
    tied = model_provider.tie_word_embeddings(hf_config)
    return (_EMBEDDING, _FINAL_NORM, _TIED_OUTPUT if tied else _OUTPUT)


def architecture_maps(hf_config: dict[str, Any]) -> list[TensorMap]:
    """Every entry of the model, layers filled in, in export order (embedding, layers, norm, head)."""
    embedding, final_norm, output = global_maps(hf_config)
    layers = [
        filled
        for i in range(hf_config["num_hidden_layers"])
        for entry in layer_maps(hf_config, i)
        for filled in _filled(entry, i, hf_config)
    ]
    return [embedding, *layers, final_norm, output]


def expected_hf_tensors(hf_config: dict[str, Any]) -> set[str]:
    """HF names a checkpoint of this config must hold (``lm_head.weight`` only when untied)."""
    return {name for entry in architecture_maps(hf_config) for name in entry.hf}


def canonical_megatron_name(
    local_name: str, layer_numbers: dict[int, int], expert_indices: dict[int, list[int]] | None = None
) -> str:
    """Canonical Megatron name of a live parameter: global layer index, TE-style norm names.

    ``layer_numbers`` maps the local layer index of a pipeline stage to its global index.
    ``expert_indices`` maps a sparse layer's local index to the global indices of the experts this
    rank holds (``MoELayer.local_expert_indices``: expert parallelism splits them); a sparse layer's
    ``pre_mlp_layernorm`` keeps its name. Grouped GEMM's ``mlp.experts.linear_fc1.weight{e}`` is named
    as the sequential experts' ``mlp.experts.local_experts.{e}.linear_fc1.weight``.
    """
    if not local_name.startswith("decoder.layers."):
        return local_name
    _, _, index, rest = local_name.split(".", 3)
    experts = (expert_indices or {}).get(int(index))
    if experts is None:
        rest = _LOCAL_ALIASES.get(rest, rest)
    else:
        rest = _SPARSE_LOCAL_ALIASES.get(rest, rest)
        rest = _GROUPED_EXPERT.sub(r"mlp.experts.local_experts.\2.\1.weight", rest)
        rest = _EXPERT_INDEX.sub(lambda m: f".local_experts.{experts[int(m.group(1))]}.", rest)
    return f"decoder.layers.{layer_numbers[int(index)]}.{rest}"


def entry_for(megatron_name: str, hf_config: dict[str, Any]) -> TensorMap:
    """The filled-in entry for a canonical Megatron name; raises ConversionError for unmapped names."""
    if megatron_name.startswith("decoder.layers."):
        _, _, index, rest = megatron_name.split(".", 3)
        expert = _EXPERT_INDEX.search("." + rest)
        pattern = _EXPERT_INDEX.sub(f".local_experts.{EXPERT}.", "." + rest)[1:]
        for entry in layer_maps(hf_config, int(index)):
            if entry.megatron == _MG_LAYER + pattern:
                return entry.at(int(index), int(expert.group(1)) if expert else None)
    for entry in global_maps(hf_config):
        if entry.megatron == megatron_name:
            return entry
    raise ConversionError(
        f"Megatron parameter {megatron_name!r} has no Hugging Face mapping for model_type="
        f"{hf_config.get('model_type')!r}; the model and config.json disagree"
    )


def _qkv_dims(dims: ModelDims) -> dict[str, int]:
    return {"num_heads": dims.num_heads, "num_groups": dims.num_groups, "head_dim": dims.head_dim}


_FillFn = Callable[[Tensor, list[Tensor], ModelDims, int, int], Tensor]
_PiecesFn = Callable[[Tensor, ModelDims, int], list[Tensor]]


def _fill_copy(axis: int | None) -> _FillFn:
    return lambda out, ts, dims, tp, rank: out.copy_(fused.split_shard(ts[0], axis, tp, rank))


_FILL: dict[str, _FillFn] = {
    "replicated": _fill_copy(None),
    "column": _fill_copy(0),
    "row": _fill_copy(1),
    "qkv": lambda out, ts, dims, tp, rank: fused.qkv_shard_into(out, *ts, **_qkv_dims(dims), tp=tp, rank=rank),
    "gated_fc1": lambda out, ts, dims, tp, rank: fused.gated_fc1_shard_into(out, *ts, tp=tp, rank=rank),
    "vocab": lambda out, ts, dims, tp, rank: fused.vocab_shard_into(
        out, ts[0], padded_vocab=model_provider.padded_vocab_size(dims.vocab_size, tp), tp=tp, rank=rank
    ),
}
_PIECES: dict[str, _PiecesFn] = {
    "replicated": lambda shard, dims, tp: [shard],
    "column": lambda shard, dims, tp: [shard],
    "row": lambda shard, dims, tp: [shard],
    # A rank holds whole query groups: its shard is the fused QKV of heads / tp heads, groups / tp groups.
    "qkv": lambda shard, dims, tp: list(
        fused.qkv_unfuse(shard, dims.num_heads // tp, dims.num_groups // tp, dims.head_dim)
    ),
    "gated_fc1": lambda shard, dims, tp: list(torch.chunk(shard, 2, dim=0)),  # [gate_r; up_r]: views
    "vocab": lambda shard, dims, tp: [shard],
}
TP_AXIS = {"replicated": None, "column": 0, "row": 1, "qkv": 0, "gated_fc1": 0, "vocab": 0}
"""Axis along which each kind is split over TP ranks (None: every rank holds the full tensor)."""


def shard_shape(entry: TensorMap, hf_shapes: list[tuple[int, ...]], dims: ModelDims, *, tp: int) -> tuple[int, ...]:
    """Shape of one TP rank's tensor for ``entry`` (computed on meta tensors: no data is touched)."""
    meta = [torch.empty(shape, device="meta") for shape in hf_shapes]
    return tuple(to_megatron_shard(entry, meta, dims, tp=tp, rank=0).shape)


def fill_megatron_shard(
    out: Tensor, entry: TensorMap, hf_tensors: list[Tensor], dims: ModelDims, *, tp: int, rank: int
) -> Tensor:
    """Write TP rank ``rank``'s tensor for ``entry`` into ``out`` (its dtype), each element copied once."""
    return _FILL[entry.kind](out, hf_tensors, dims, tp, rank)


def to_megatron_shard(entry: TensorMap, hf_tensors: list[Tensor], dims: ModelDims, *, tp: int, rank: int) -> Tensor:
    """TP rank ``rank``'s tensor for ``entry`` from its HF tensors (in ``entry.hf`` order)."""
    if entry.kind in ("replicated", "column", "row"):
        return fused.split_shard(hf_tensors[0], TP_AXIS[entry.kind], tp, rank)
    first = hf_tensors[0]
    if entry.kind == "qkv":
        return fused.qkv_shard(*hf_tensors, **_qkv_dims(dims), tp=tp, rank=rank)
    if entry.kind == "gated_fc1":
        return fused.gated_fc1_shard(*hf_tensors, tp=tp, rank=rank)
    padded = model_provider.padded_vocab_size(dims.vocab_size, tp)
    return fused.vocab_shard(first, padded_vocab=padded, tp=tp, rank=rank)


def hf_pieces(entry: TensorMap, shard: Tensor, dims: ModelDims, *, tp: int) -> list[Tensor]:
    """This rank's piece of each HF tensor of ``entry`` (in ``entry.hf`` order), cut from its shard.

    Views of ``shard`` except for QKV, whose per-head rows are interleaved (one copy). Concatenating
    every rank's pieces along ``TP_AXIS[entry.kind]`` gives the HF tensors (``hf_from_pieces``).
    """
    return _PIECES[entry.kind](shard, dims, tp)


def hf_from_pieces(entry: TensorMap, pieces: list[Tensor], dims: ModelDims) -> Tensor:
    """One HF tensor from every TP rank's piece (rank order); one piece comes back uncopied."""
    whole = fused.concat_shards(pieces, TP_AXIS[entry.kind])
    return whole[: dims.vocab_size] if entry.kind == "vocab" else whole


def to_hf(entry: TensorMap, shards: list[Tensor], dims: ModelDims) -> list[tuple[str, Tensor]]:
    """HF ``(name, tensor)`` pairs for ``entry`` from every TP rank's shard (in rank order)."""
    per_rank = [hf_pieces(entry, shard, dims, tp=len(shards)) for shard in shards]
    return [(name, hf_from_pieces(entry, [pieces[i] for pieces in per_rank], dims)) for i, name in enumerate(entry.hf)]


def expected_hf_shapes(hf_config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Shape of every HF tensor this config implies (used to reject mismatched checkpoints early)."""
    dims = ModelDims.from_hf(hf_config)
    hidden, ffn = hf_config["hidden_size"], hf_config["intermediate_size"]
    experts = moe_provider.num_experts(hf_config) if moe_provider.is_moe(hf_config) else 0
    expert_ffn = int(hf_config.get("moe_intermediate_size") or 0)
    shared_ffn = moe_provider.shared_expert_width(hf_config)
    q_rows, kv_rows = dims.num_heads * dims.head_dim, dims.num_groups * dims.head_dim
    by_suffix = {
        "embed_tokens.weight": (dims.vocab_size, hidden),
        "lm_head.weight": (dims.vocab_size, hidden),
        "layernorm.weight": (hidden,),
        "model.norm.weight": (hidden,),
        "q_proj.weight": (q_rows, hidden),
        "k_proj.weight": (kv_rows, hidden),
        "v_proj.weight": (kv_rows, hidden),
        "q_proj.bias": (q_rows,),
        "k_proj.bias": (kv_rows,),
        "v_proj.bias": (kv_rows,),
        "o_proj.weight": (hidden, q_rows),
        "q_norm.weight": (dims.head_dim,),
        "k_norm.weight": (dims.head_dim,),
        "gate_proj.weight": (ffn, hidden),
        "up_proj.weight": (ffn, hidden),
        "down_proj.weight": (hidden, ffn),
        "mlp.gate.weight": (experts, hidden),
        "mlp.shared_expert_gate.weight": (1, hidden),
    }
    by_expert_suffix = {
        "gate_proj.weight": (expert_ffn, hidden),
        "up_proj.weight": (expert_ffn, hidden),
        "down_proj.weight": (hidden, expert_ffn),
    }
    by_shared_suffix = {
        "gate_proj.weight": (shared_ffn, hidden),
        "up_proj.weight": (shared_ffn, hidden),
        "down_proj.weight": (hidden, shared_ffn),
    }
    shapes = {}
    for name in expected_hf_tensors(hf_config):
        if ".mlp.experts." in name:
            table = by_expert_suffix
        elif ".mlp.shared_expert." in name:
            table = by_shared_suffix
        else:
            table = by_suffix
        suffix = next(s for s in table if name.endswith(s))
        shapes[name] = table[suffix]
    return shapes
