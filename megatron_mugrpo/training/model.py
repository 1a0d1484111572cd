"""Model provider: a Megatron-core ``GPTModel`` built from a Hugging Face ``config.json`` dict.

Supported architectures (``model_type``): ``qwen2`` (Qwen2 / Qwen2.5: QKV bias), ``llama`` (Llama 3.x,
including ``rope_scaling`` of type ``llama3``), ``qwen3`` (q/k RMSNorm, explicit ``head_dim``),
``qwen3_moe`` (Qwen3 attention with mixture-of-experts MLPs, see ``training.moe``) and ``qwen2_moe``
(Qwen2 attention, mixture-of-experts MLPs plus a sigmoid-gated shared expert).
All are pre-norm decoders with RMSNorm, RoPE, grouped-query attention and SwiGLU MLPs (or experts)
without biases, which is what the Megatron config below expresses.

MoE models may also split their experts over ``expert_parallel`` ranks (``groups.ep``); without TE
each rank runs its experts one after another (``SequentialMLP``), with TE as one grouped GEMM.

The model is built for the caller's ``ParallelGroups`` (``training.parallel.initialize_parallel``), the
same groups the trainer and the converter use: its TP / PP / EP / ETP sizes and pipeline stage come
from them, and it communicates on their process groups (megatron-core's ``ProcessGroupCollection``,
``groups.mcore``), never on megatron's global ones.

    groups = initialize_parallel(tp=1, pp=1, seed=0)
    model = build_gpt_model(tiny_hf_config("qwen3", tie_word_embeddings=True), groups, dtype=torch.float32)

The vocabulary is padded to a multiple of 128 × TP as Megatron does. The padded rows exist only in
Megatron: every log-prob computation must mask ids >= ``hf_config["vocab_size"]``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_mugrpo.errors import InputError
from megatron_mugrpo.kernels.fp8 import megatron_fp8_kwargs
from megatron_mugrpo.training import cpu_compat, mcore_compat
from megatron_mugrpo.training.moe import (
    MoeConfig,
    check_moe,
    check_routing_replay,
    install_expert_load_hooks,
    is_moe,
    moe_layer_pattern,
    moe_transformer_fields,
)
from megatron_mugrpo.training.parallel import ParallelGroups
from megatron_mugrpo.training.routing_replay import install_routing_hooks
from megatron_mugrpo.training.sdpa_attention import with_sdpa_attention

SUPPORTED_MODEL_TYPES = ("qwen2", "llama", "qwen3", "qwen3_moe", "qwen2_moe")
_QKV_BIAS_TYPES = ("qwen2", "qwen2_moe")
_QK_NORM_TYPES = ("qwen3", "qwen3_moe")
VOCAB_DIVISIBLE_BY = 128
"""Megatron pads the vocabulary to a multiple of this × TP so every TP shard is GEMM-friendly."""

# Megatron's built-in llama3 RoPE scaling hard-codes these; other values are applied by us.
_MEGATRON_LLAMA3_DEFAULTS = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


class ModelConfigError(InputError, ValueError):
    """The Hugging Face config cannot be expressed as a supported Megatron model; says why and what to do."""


def have_transformer_engine() -> bool:
    """True when Transformer Engine imports (it cannot without a CUDA driver)."""
    try:
        import transformer_engine  # noqa: F401
    except (ImportError, OSError, RuntimeError):
        return False
    return True


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = VOCAB_DIVISIBLE_BY) -> int:
    """Vocabulary size Megatron allocates: ``vocab_size`` rounded up to a multiple of ``divisible_by × tp``."""
    if vocab_size < 1 or tp < 1:
        raise ModelConfigError(f"padded_vocab_size needs vocab_size >= 1 and tp >= 1, got {vocab_size}, {tp}")
    multiple = divisible_by * tp
    return int(math.ceil(vocab_size / multiple) * multiple)


def model_type(hf_config: dict[str, Any]) -> str:
    """The architecture key of ``hf_config`` (one of ``SUPPORTED_MODEL_TYPES``); raises for anything else."""
    name = hf_config.get("model_type")
    if name not in SUPPORTED_MODEL_TYPES:
        raise ModelConfigError(
            f"config.json model_type={name!r} (architectures={hf_config.get('architectures')}) is not "
            f"supported; supported model types are {SUPPORTED_MODEL_TYPES}"
        )
    return name


def head_dim(hf_config: dict[str, Any]) -> int:
    """Per-head dimension: explicit ``head_dim`` (Qwen3, Llama) or hidden_size / num_attention_heads."""
    explicit = hf_config.get("head_dim")
    if explicit:
        return int(explicit)
    return hf_config["hidden_size"] // hf_config["num_attention_heads"]


def num_kv_heads(hf_config: dict[str, Any]) -> int:
    """Number of key/value heads (query groups); defaults to the number of attention heads."""
    return int(hf_config.get("num_key_value_heads") or hf_config["num_attention_heads"])


def rope_parameters(hf_config: dict[str, Any]) -> dict[str, Any]:
    """RoPE settings as one dict with ``rope_theta`` and ``rope_type``, from either config format.

    transformers >= 5 writes ``rope_parameters``; released checkpoints (and transformers 4) write
    ``rope_theta`` plus an optional ``rope_scaling`` dict (whose type key is ``rope_type`` or ``type``).
    """
    params = dict(hf_config.get("rope_parameters") or {})
    scaling = hf_config.get("rope_scaling") or {}
    params.update(scaling)
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    params.setdefault("rope_type", "default")
    params.setdefault("rope_theta", hf_config.get("rope_theta", 10000.0))
    return params


def tie_word_embeddings(hf_config: dict[str, Any]) -> bool:
    """Whether the LM head shares the input embedding (transformers' default for these models is False)."""
    return bool(hf_config.get("tie_word_embeddings", False))


def check_supported(hf_config: dict[str, Any]) -> str:
    """The model_type of ``hf_config``; ModelConfigError for features this provider cannot build."""
    arch = model_type(hf_config)
    if hf_config.get("hidden_act", "silu") != "silu":
        raise ModelConfigError(f"hidden_act={hf_config['hidden_act']!r}: only SwiGLU ('silu') is supported")
    if hf_config.get("use_sliding_window"):
        raise ModelConfigError("use_sliding_window=true is not supported; set it to false in config.json")
    if arch in ("llama", *_QK_NORM_TYPES) and hf_config.get("attention_bias"):
        raise ModelConfigError(f"{arch} with attention_bias=true is not supported")
    if arch == "qwen2_moe" and not hf_config.get("qkv_bias", True):
        raise ModelConfigError(
            "qwen2_moe with qkv_bias=false is not supported (released Qwen2-MoE models have QKV biases); "
            "remove qkv_bias from config.json or set it to true"
        )
    if hf_config.get("mlp_bias"):
        raise ModelConfigError("mlp_bias=true is not supported")
    rope = rope_parameters(hf_config)
    if rope["rope_type"] not in ("default", "llama3"):
        raise ModelConfigError(f"rope type {rope['rope_type']!r} is not supported; supported: 'default' and 'llama3'")
    return arch


def check_divisibility(hf_config: dict[str, Any], tp: int, pp: int) -> None:
    """ModelConfigError unless TP divides heads, KV heads and the MLP width, and PP divides the layers."""
    heads, groups = hf_config["num_attention_heads"], num_kv_heads(hf_config)
    layers = hf_config["num_hidden_layers"]
    if heads % groups:
        raise ModelConfigError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={groups}")
    if heads % tp or groups % tp:
        raise ModelConfigError(
            f"tensor parallel size {tp} must divide num_attention_heads={heads} and "
            f"num_key_value_heads={groups}; choose a TP among the common divisors"
        )
    dense_layers = not is_moe(hf_config) or not all(moe_layer_pattern(hf_config))
    if dense_layers and hf_config["intermediate_size"] % tp:
        raise ModelConfigError(
            f"tensor parallel size {tp} must divide intermediate_size={hf_config['intermediate_size']}"
        )
    if layers % pp:
        raise ModelConfigError(f"pipeline parallel size {pp} must divide num_hidden_layers={layers}")


def transformer_config_from_hf(
    hf_config: dict[str, Any],
    *,
    dtype: torch.dtype,
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
    expert_parallel: int = 1,
    expert_tensor_parallel: int | None = None,
    moe: MoeConfig | None = None,
    fp8: str = "none",
    **overrides: Any,
) -> TransformerConfig:
    """Megatron ``TransformerConfig`` equivalent to a Qwen2 / Llama / Qwen3 / Qwen3-MoE / Qwen2-MoE ``config.json``.

    ``tensor_parallel`` / ``pipeline_parallel`` / ``expert_parallel``: the TP/PP/EP sizes the model is
    split over (the caller's ``groups.tp`` / ``groups.pp`` / ``groups.ep``; 1 outside any parallel
    state); ``expert_tensor_parallel`` (``groups.etp``) splits each expert, None: ``tensor_parallel``.
    ``moe``: router losses and dispatcher of a MoE model (``MoeConfig()`` when None). ``overrides`` are
    extra ``TransformerConfig`` fields (e.g. recompute settings) applied last; under sequence
    parallelism the router-loss coefficients are then corrected for megatron-core 0.16
    (``mcore_compat.sequence_parallel_router_loss_coefficients``).
    """
    arch = check_supported(hf_config)
    tp, pp = tensor_parallel, pipeline_parallel
    check_divisibility(hf_config, tp, pp)
    if expert_parallel != 1 and not is_moe(hf_config):
        raise ModelConfigError(f"expert parallel size {expert_parallel} needs a mixture-of-experts model, not {arch}")
    check_routing_replay(hf_config, moe or MoeConfig())
    on_cpu = not torch.cuda.is_available()
    fields: dict[str, Any] = dict(
        num_layers=hf_config["num_hidden_layers"],
        hidden_size=hf_config["hidden_size"],
        ffn_hidden_size=hf_config["intermediate_size"],
        num_attention_heads=hf_config["num_attention_heads"],
        num_query_groups=num_kv_heads(hf_config),
        kv_channels=head_dim(hf_config),
        normalization="RMSNorm",
        layernorm_epsilon=float(hf_config.get("rms_norm_eps", 1e-6)),
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch in _QKV_BIAS_TYPES,
        qk_layernorm=arch in _QK_NORM_TYPES,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        attention_softmax_in_fp32=True,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        # Fusions below need CUDA kernels (or apex); the unfused paths are exact on every device.
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        use_cpu_initialization=on_cpu,
    )
    if is_moe(hf_config):
        check_moe(
            hf_config,
            tensor_parallel=tp,
            expert_parallel=expert_parallel,
            expert_tensor_parallel=expert_tensor_parallel,
        )
        moe = moe or MoeConfig()
        grouped = moe.grouped_gemm and have_transformer_engine()  # benchmarks/gpu_moe_check.py compares the two
        fields.update(
            moe_transformer_fields(
                hf_config,
                moe,
                expert_parallel=expert_parallel,
                expert_tensor_parallel=expert_tensor_parallel,
                grouped_gemm=grouped,
            )
        )
    elif expert_tensor_parallel not in (None, tp):
        raise ModelConfigError(
            f"expert tensor parallel size {expert_tensor_parallel} needs a mixture-of-experts model, not {arch}"
        )
    fields.update(megatron_fp8_kwargs(fp8))  # checks TE and the GPU; clear error otherwise
    fields.update(overrides)
    fields.update(mcore_compat.sequence_parallel_router_loss_coefficients(fields))  # megatron-core 0.16 weighs 1/TP
    return TransformerConfig(**fields)


def layer_spec(config: TransformerConfig, vp_stage: int | None = None) -> Any:
    """Transformer Engine layer spec when TE imports, Megatron's local spec otherwise.

    Both specs share checkpoint keys: the local spec maps ``input_layernorm.`` to
    ``self_attention.linear_qkv.layer_norm_`` in its sharded state dict, as TE fuses them.
    A MoE model gets a block spec instead (this stage's layers, each dense or sparse).
    """
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    if config.num_moe_experts:
        return moe_block_spec(config, vp_stage)
    if have_transformer_engine():
        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=config.qk_layernorm)
    # The local spec's attention through one SDPA call (training.sdpa_attention), via its core_attention slot.
    return with_sdpa_attention(get_gpt_layer_local_spec(qk_layernorm=config.qk_layernorm, normalization="RMSNorm"))


def moe_block_spec(config: TransformerConfig, vp_stage: int | None = None) -> Any:
    """This pipeline stage's layer specs, sparse where ``config.moe_layer_freq`` says so.

    TE's MoE layer has a real ``pre_mlp_layernorm`` (its experts cannot fuse the norm), whereas the
    local spec still aliases it to ``mlp.linear_fc1.layer_norm_`` in the sharded state dict. The
    alias is dropped from sparse local layers so that checkpoints keep one key with either spec.
    """
    import dataclasses

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    block = get_gpt_decoder_block_spec(
        config, use_transformer_engine=have_transformer_engine(), normalization="RMSNorm", vp_stage=vp_stage
    )
    for i, spec in enumerate(block.layer_specs):
        spec = block.layer_specs[i] = with_sdpa_attention(spec)  # local layers only; TE's are kept
        keys = dict(getattr(spec.submodules, "sharded_state_dict_keys_map", None) or {})
        if _is_sparse_spec(spec) and keys.pop("pre_mlp_layernorm.", None) is not None:
            submodules = dataclasses.replace(spec.submodules, sharded_state_dict_keys_map=keys)
            block.layer_specs[i] = dataclasses.replace(spec, submodules=submodules)
    return block


def _is_sparse_spec(spec: ModuleSpec) -> bool:
    from megatron.core.transformer.moe.moe_layer import MoELayer

    mlp = getattr(spec.submodules, "mlp", None)
    return getattr(mlp, "module", None) is MoELayer


def llama3_inv_freq(
    head_dim: int,
    rope_theta: float,
    *,
    factor: float,
    low_freq_factor: float,
    high_freq_factor: float,
    original_max_position_embeddings: int,
) -> torch.Tensor:
    """Llama 3 RoPE inverse frequencies [head_dim / 2] (float32), as in transformers' ``rope_type='llama3'``.

    Long wavelengths (beyond original_max / low_freq_factor) are divided by ``factor``, short ones
    (below original_max / high_freq_factor) kept, and the band in between interpolated smoothly.
    """
    inv_freq = 1.0 / (rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    low_wavelen = original_max_position_embeddings / low_freq_factor
    high_wavelen = original_max_position_embeddings / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _apply_llama3_rope(model: GPTModel, hf_config: dict[str, Any], rope: dict[str, Any]) -> None:
    """Replace Megatron's llama3 inverse frequencies when the config uses non-default band parameters."""
    band = {key: rope.get(key, default) for key, default in _MEGATRON_LLAMA3_DEFAULTS.items()}
    if band == _MEGATRON_LLAMA3_DEFAULTS or not hasattr(model, "rotary_pos_emb"):
        return
    old = model.rotary_pos_emb.inv_freq
    inv_freq = llama3_inv_freq(
        head_dim(hf_config),
        float(rope["rope_theta"]),
        factor=float(rope["factor"]),
        low_freq_factor=float(band["low_freq_factor"]),
        high_freq_factor=float(band["high_freq_factor"]),
        original_max_position_embeddings=int(band["original_max_position_embeddings"]),
    )
    # Called right after construction, before the first forward fills the RoPE cache.
    model.rotary_pos_emb.inv_freq = inv_freq.to(device=old.device, dtype=old.dtype)


def unwrap_model(module: torch.nn.Module) -> torch.nn.Module:
    """The bare ``GPTModel`` inside Megatron's wrappers (DDP, Float16Module: each exposes ``.module``).

    The one unwrap helper of the package: training, checkpointing and conversion all use it.
    """
    while isinstance(getattr(module, "module", None), torch.nn.Module):
        module = module.module
    return module


def build_gpt_model(
    hf_config: dict[str, Any],
    groups: ParallelGroups,
    *,
    dtype: torch.dtype,
    fp8: str = "none",
    vp_stage: int | None = None,
    config_overrides: dict[str, Any] | None = None,
    moe: MoeConfig | None = None,
) -> GPTModel:
    """This rank's TP / PP / EP shard of the ``GPTModel`` described by ``hf_config``.

    ``groups`` (``initialize_parallel``'s) give the sizes, the pipeline stage (the first holds the
    embedding, the last the final norm and output layer) and the process groups the model communicates
    on. The last stage returns logits [B, S, V_pad / tp] per TP rank (``parallel_output=True``); other
    stages hidden states [S, B, H]. A dense model ignores ``groups.ep`` / ``groups.etp``.
    A MoE model counts its routed tokens per expert (``training.moe.moe_step_metrics``).
    """
    if groups.mcore is None:  # GPTModel would fall back to megatron's global groups
        raise ValueError(
            "build_gpt_model needs the process groups of initialize_parallel(); ParallelGroups.local() has none"
        )
    moe_model = is_moe(hf_config)
    if moe_model:
        mcore_compat.define_moe_te_names()  # megatron-core 0.16's MoE router needs them without TE
        cpu_compat.activate_moe()  # gloo all-to-all split sizes (no-op unless the CPU layer is active)
    config = transformer_config_from_hf(
        hf_config,
        dtype=dtype,
        tensor_parallel=groups.tp,
        pipeline_parallel=groups.pp,
        expert_parallel=groups.ep if moe_model else 1,
        expert_tensor_parallel=groups.etp if moe_model else None,
        moe=moe,
        fp8=fp8,
        **(config_overrides or {}),
    )
    rope = rope_parameters(hf_config)
    llama3 = rope["rope_type"] == "llama3"
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(config, vp_stage),
        vocab_size=padded_vocab_size(hf_config["vocab_size"], config.tensor_model_parallel_size),
        max_sequence_length=int(hf_config.get("max_position_embeddings", 4096)),
        pre_process=groups.is_first_stage,
        post_process=groups.is_last_stage,
        parallel_output=True,
        share_embeddings_and_output_weights=tie_word_embeddings(hf_config),
        position_embedding_type="rope",
        rotary_base=float(rope["rope_theta"]),
        rope_scaling=llama3,
        rope_scaling_factor=float(rope.get("factor", 8.0)),
        vp_stage=vp_stage,
        pg_collection=groups.mcore,
    )
    if llama3:
        _apply_llama3_rope(model, hf_config, rope)
    # The local spec's torch norms ignore params_dtype (Megatron-LM relies on its Float16Module
    # wrapper to cast); cast here so every parameter has ``dtype`` with either spec, as with TE.
    model.to(dtype=dtype)
    if config.num_moe_experts:
        install_expert_load_hooks(model)
        install_routing_hooks(model)  # routes of a batch: agreement, and replay under moe.routing_replay
    return model


_TINY_BASE: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float32",
}
_TINY_ARCH: dict[str, dict[str, Any]] = {
    "qwen2": {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "use_sliding_window": False},
    "llama": {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        # transformers wants original_max_position_embeddings (8192, as released) below this.
        "max_position_embeddings": 16384,
        "attention_bias": False,
        "mlp_bias": False,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    },
    "qwen3": {
        "model_type": "qwen3",
        "architectures": ["Qwen3ForCausalLM"],
        "attention_bias": False,
        "use_sliding_window": False,
        # Deliberately not hidden_size / num_attention_heads (16): exercises kv_channels.
        "head_dim": 24,
    },
    "qwen3_moe": {
        "model_type": "qwen3_moe",
        "architectures": ["Qwen3MoeForCausalLM"],
        "attention_bias": False,
        "use_sliding_window": False,
        "head_dim": 24,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "router_aux_loss_coef": 0.001,
        "output_router_logits": False,
    },
    # Qwen1.5-MoE / Qwen2-57B-A14B: Qwen2 attention (QKV bias), routed experts plus one sigmoid-gated
    # shared expert per sparse layer. Widths differ on purpose (dense 128, expert 32, shared 48) so a
    # tensor mapped to the wrong role fails on its shape; norm_topk_prob False as released.
    "qwen2_moe": {
        "model_type": "qwen2_moe",
        "architectures": ["Qwen2MoeForCausalLM"],
        "qkv_bias": True,
        "use_sliding_window": False,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48,
        "norm_topk_prob": False,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "router_aux_loss_coef": 0.001,
        "output_router_logits": False,
    },
}


def tiny_hf_config(arch: str, **overrides: Any) -> dict[str, Any]:
    """A small Hugging Face ``config.json`` dict for ``arch`` in ('qwen2', 'llama', 'qwen3', 'qwen3_moe', 'qwen2_moe').

    The shapes (hidden 64, 2 layers, 4 heads / 2 KV heads, vocab 256) build and run in well under a
    second on CPU. Keys use the released-checkpoint format (``rope_theta`` / ``rope_scaling``), which
    transformers 4 and 5 both read. ``overrides`` replace or add top-level keys.
    """
    if arch not in _TINY_ARCH:
        raise ModelConfigError(f"tiny_hf_config: unknown arch {arch!r}; choose one of {tuple(_TINY_ARCH)}")
    config = {**_TINY_BASE, **_TINY_ARCH[arch], **overrides}
    config["rope_scaling"] = dict(config["rope_scaling"]) if config.get("rope_scaling") else None
    if config["rope_scaling"] is None:
        config.pop("rope_scaling")
    return config
