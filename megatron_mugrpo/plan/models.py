"""Model shapes for planning: a Hugging Face ``config.json`` reduced to the numbers that size memory
and FLOPs, the published configs of the paper's models, and the parameter tensors one trainer rank
holds, in the order megatron-core registers them.

    shape = ModelShape.from_hf(KNOWN_MODELS["Qwen2.5-Math-7B"])
    shape.total_params()                                    # 7,615,616,512
    tensors = rank_tensors(shape, RankLayout(tp=2, pp=1, ep=1, etp=2), pp_rank=0)

The tensor list mirrors ``training.model.build_gpt_model`` with megatron-core's local layer spec
(TP-split QKV / projection / MLP, replicated norms, the vocabulary padded to 128 × TP, experts split
over EP and ETP); ``tests/plan/test_plan_exact.py`` checks it tensor for tensor against models built on CPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from megatron_mugrpo.errors import InputError

VOCAB_DIVISIBLE_BY = 128
"""Megatron pads the vocabulary to a multiple of this × TP (``training.model.VOCAB_DIVISIBLE_BY``)."""


def _qwen2(**fields: Any) -> dict[str, Any]:
    return {"model_type": "qwen2", "vocab_size": 152064, "tie_word_embeddings": False, **fields}


# The published config.json fields of the paper's models (hf.co/<org>/<name>/blob/main/config.json),
# for planning before the checkpoint is on disk. Only the fields ModelShape reads are kept.
KNOWN_MODELS: dict[str, dict[str, Any]] = {
    "Qwen2.5-Math-7B": _qwen2(
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        max_position_embeddings=4096,
    ),
    "DeepSeek-R1-Distill-Qwen-7B": _qwen2(
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        max_position_embeddings=131072,
    ),
    "Qwen2.5-Coder-7B": _qwen2(
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        max_position_embeddings=32768,
    ),
    "Llama-3.2-3B-Instruct": {
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 3072,
        "intermediate_size": 8192,
        "num_hidden_layers": 28,
        "num_attention_heads": 24,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "tie_word_embeddings": True,
        "max_position_embeddings": 131072,
    },
    "Qwen3-1.7B-Base": {
        "model_type": "qwen3",
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "tie_word_embeddings": True,
        "max_position_embeddings": 32768,
    },
    "Qwen3-8B-Base": {
        "model_type": "qwen3",
        "vocab_size": 151936,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "tie_word_embeddings": False,
        "max_position_embeddings": 32768,
    },
    "Qwen3-30B-A3B-Base": {
        "model_type": "qwen3_moe",
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "tie_word_embeddings": False,
        "max_position_embeddings": 32768,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    },
}
KNOWN_MODELS["Qwen3-30B-A3B"] = KNOWN_MODELS["Qwen3-30B-A3B-Base"]

_MOE_TYPES = ("qwen3_moe", "qwen2_moe")
_QKV_BIAS_TYPES = ("qwen2", "qwen2_moe")
_QK_NORM_TYPES = ("qwen3", "qwen3_moe")


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """What sizes a decoder: widths, counts and which layers are sparse."""

    vocab_size: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    """Dense MLP width (intermediate_size)."""
    qkv_bias: bool
    qk_norm: bool
    tied: bool
    """Output layer shares the input embedding."""
    experts: int = 0
    topk: int = 0
    expert_ffn: int = 0
    shared_ffn: int = 0
    """Width of the gated shared expert (Qwen2-MoE); 0: none."""
    sparse: tuple[bool, ...] = ()
    """Per layer: its MLP is a mixture of experts."""

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelShape:
        """The shape of a Hugging Face ``config.json`` dict (Qwen2, Llama, Qwen3, Qwen3-MoE, Qwen2-MoE)."""
        kind = hf.get("model_type")
        heads = int(hf["num_attention_heads"])
        experts = int(hf.get("num_experts") or hf.get("num_local_experts") or 0) if kind in _MOE_TYPES else 0
        step = int(hf.get("decoder_sparse_step", 1) or 1)
        dense = set(hf.get("mlp_only_layers") or [])
        layers = int(hf["num_hidden_layers"])
        return cls(
            vocab_size=int(hf["vocab_size"]),
            hidden=int(hf["hidden_size"]),
            layers=layers,
            heads=heads,
            kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or int(hf["hidden_size"]) // heads),
            ffn=int(hf["intermediate_size"]),
            qkv_bias=kind in _QKV_BIAS_TYPES and bool(hf.get("qkv_bias", True)),
            qk_norm=kind in _QK_NORM_TYPES,
            tied=bool(hf.get("tie_word_embeddings", False)),
            experts=experts,
            topk=int(hf.get("num_experts_per_tok", 0)) if experts else 0,
            expert_ffn=int(hf.get("moe_intermediate_size", 0)) if experts else 0,
            shared_ffn=int(hf.get("shared_expert_intermediate_size") or 0) if kind == "qwen2_moe" else 0,
            sparse=tuple(experts > 0 and i not in dense and (i + 1) % step == 0 for i in range(layers)),
        )

    @property
    def is_moe(self) -> bool:
        return any(self.sparse)

    def total_params(self) -> int:
        """Parameters of the whole model (true vocabulary, each tied matrix once)."""
        return self._params(active=False)

    def active_params(self) -> int:
        """Parameters one token uses: the routed experts count top-k times, not E times."""
        return self._params(active=True)

    def _params(self, *, active: bool) -> int:
        h, layer = self.hidden, self._attention_params()
        total = self.vocab_size * h * (1 if self.tied else 2) + h  # embeddings + final norm
        for sparse in self.sparse or (False,) * self.layers:
            total += layer + h  # attention + its norm, and the MLP's norm
            if sparse:
                count = self.topk if active else self.experts
                total += self.experts * h + count * 3 * self.expert_ffn * h
                total += 3 * self.shared_ffn * h + (h if self.shared_ffn else 0)
            else:
                total += 3 * self.ffn * h
        return total

    def _attention_params(self) -> int:
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        return (
            h
            + (q + 2 * kv) * h
            + q * h
            + ((q + 2 * kv) if self.qkv_bias else 0)
            + (2 * self.head_dim if self.qk_norm else 0)
        )

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """Keys and values of one token across all layers (a rollout engine's KV cache, unsplit)."""
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes


def known_model(name: str) -> dict[str, Any]:
    """The published config.json fields of a model named like its Hugging Face repository."""
    for key, fields in KNOWN_MODELS.items():
        if key.lower() == name.lower():
            return fields
    raise InputError(
        f"{name!r} is neither a local checkpoint directory nor a model the planner knows "
        f"({', '.join(sorted(KNOWN_MODELS))}); set model.hf_dir to a directory holding its config.json"
    )


@dataclass(frozen=True, kw_only=True)
class RankLayout:
    """How the trainer's model is split: tensor, pipeline, expert and expert-tensor parallel sizes."""

    tp: int
    pp: int
    ep: int = 1
    etp: int = 1


@dataclass(frozen=True)
class Tensor:
    """One parameter tensor of a rank: its element count and which gradient buffer it lands in."""

    name: str
    numel: int
    expert: bool = False
    """In the expert-parallel buffer (sharded over the expert-data-parallel ranks): experts at EP > 1."""
    shared_embedding: bool = False
    """A tied embedding split over the first and last pipeline stage (its own bucket in megatron-core)."""


def padded_vocab(vocab_size: int, tp: int) -> int:
    multiple = VOCAB_DIVISIBLE_BY * tp
    return math.ceil(vocab_size / multiple) * multiple


def rank_tensors(shape: ModelShape, layout: RankLayout, pp_rank: int) -> list[Tensor]:
    """The parameters of one rank of pipeline stage ``pp_rank`` in megatron-core's registration order."""
    tp, pp, h = layout.tp, layout.pp, shape.hidden
    first, last = pp_rank == 0, pp_rank == pp - 1
    vocab_rows = padded_vocab(shape.vocab_size, tp) // tp
    split_tied = shape.tied and pp > 1  # a tied embedding gets a second copy on the last stage
    out = []
    if first:
        out.append(Tensor("embedding", vocab_rows * h, shared_embedding=split_tied and not last))
    per_stage = shape.layers // pp
    sparse = shape.sparse or (False,) * shape.layers
    for index in range(pp_rank * per_stage, (pp_rank + 1) * per_stage):
        out += _layer_tensors(shape, layout, index, sparse[index])
    if last:
        out.append(Tensor("final_layernorm", h))
        if not shape.tied or not first:
            out.append(Tensor("output_layer", vocab_rows * h, shared_embedding=split_tied))
    return out


def _layer_tensors(shape: ModelShape, layout: RankLayout, index: int, sparse: bool) -> list[Tensor]:
    tp, h = layout.tp, shape.hidden
    q, kv = shape.heads * shape.head_dim // tp, shape.kv_heads * shape.head_dim // tp
    name = f"layers.{index}."
    out = [
        Tensor(name + "input_layernorm", h),
        Tensor(name + "linear_proj", h * q),
        Tensor(name + "linear_qkv", (q + 2 * kv) * h),
    ]
    if shape.qkv_bias:
        out.append(Tensor(name + "linear_qkv.bias", q + 2 * kv))
    if shape.qk_norm:
        out += [Tensor(name + "q_layernorm", shape.head_dim), Tensor(name + "k_layernorm", shape.head_dim)]
    out.append(Tensor(name + "pre_mlp_layernorm", h))
    if not sparse:
        fc1, fc2 = (
            Tensor(name + "linear_fc1", 2 * shape.ffn // tp * h),
            Tensor(name + "linear_fc2", h * shape.ffn // tp),
        )
        return [*out, fc1, fc2]
    out.append(Tensor(name + "router", shape.experts * h))
    width, expert = shape.expert_ffn // layout.etp, layout.ep > 1
    for e in range(shape.experts // layout.ep):
        out.append(Tensor(f"{name}experts.{e}.linear_fc1", 2 * width * h, expert=expert))
        out.append(Tensor(f"{name}experts.{e}.linear_fc2", h * width, expert=expert))
    if shape.shared_ffn:
        out.append(Tensor(name + "shared_experts.gate_weight", h))
        out.append(Tensor(name + "shared_experts.linear_fc1", 2 * shape.shared_ffn // tp * h))
        out.append(Tensor(name + "shared_experts.linear_fc2", h * shape.shared_ffn // tp))
    return out
