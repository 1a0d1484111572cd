"""Mixture-of-experts models: Qwen3-MoE / Qwen2-MoE config → Megatron MoE fields, expert-load and aux-loss metrics.

A Hugging Face ``config.json`` with ``model_type: qwen3_moe`` describes a decoder whose MLPs are
sparse: every token goes to the top ``num_experts_per_tok`` of ``num_experts`` SwiGLU experts of width
``moe_intermediate_size``. Layers listed in ``mlp_only_layers`` (or not on the ``decoder_sparse_step``
grid) keep a dense MLP of width ``intermediate_size``. There is no shared expert.

``model_type: qwen2_moe`` (Qwen1.5-MoE, Qwen2-57B-A14B) routes the same way and adds, in every sparse
layer, one shared SwiGLU expert of width ``shared_expert_intermediate_size`` that every token goes
through, scaled by a per-token sigmoid gate: ``sigmoid(x · w_gate) · shared_expert(x)`` with
``w_gate`` [1, hidden] (transformers' ``Qwen2MoeSparseMoeBlock``). megatron-core's ``SharedExpertMLP``
with ``moe_shared_expert_gate=True`` computes exactly that function on the same input (the sparse
layer's pre-MLP-normed hidden states): ``sigmoid(linear(x, gate_weight [1, hidden])) · MLP(x)``, added
to the routed experts' output (``SHARED_EXPERT_GATE`` names the source lines; checked numerically by
tests/training/test_qwen2_moe.py). Its attention is Qwen2's (QKV bias, ``qkv_bias``).

Routing follows the model: softmax scores; with ``norm_topk_prob`` the top-k probabilities are
renormalised, which Megatron expresses as softmax *after* the top-k (``moe_router_pre_softmax=False``);
without it, softmax over all experts *before* the top-k. The load-balancing auxiliary loss and the
router z-loss are off unless ``moe.*`` sets their coefficients: for RL fine-tuning the policy loss is
the objective, and the routing of a pretrained model is already balanced.

    fields = moe_transformer_fields(hf_config, MoeConfig(aux_loss_coeff=1e-3), expert_parallel=2)
    metrics = moe_step_metrics(model_chunks, groups, num_micro_batches=4)   # after the schedule

Metrics (``train/``): ``moe_load_min`` / ``moe_load_max``, the smallest and largest share of routed
token slots any expert of any MoE layer received during the update (1/E when perfectly balanced;
padding tokens are routed too and are counted; the shared expert is not routed and is not counted),
the same per MoE layer as ``moe_load_{min,max}_layer_NN`` (global 0-based layer index),
and, when their coefficients are on, ``moe_aux_loss`` / ``moe_z_loss`` from megatron-core's aux-loss
tracker (mean over MoE layers and micro-batches, unscaled by the coefficient).

``moe.routing_replay: rollout`` (R3) replays the rollout engine's routes in the trainer
(``training.routing_replay``, which also measures ``train/routing_agreement``); a shared expert has
no route to replay.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron_mugrpo.errors import InputError, require
from megatron_mugrpo.metric_names import (
    MOE_AUX_LOSS,
    MOE_LOAD_MAX,
    MOE_LOAD_MIN,
    MOE_Z_LOSS,
    ROUTING_AGREEMENT,
    moe_layer_load_key,
)
from megatron_mugrpo.training.routing_replay import reset_routing_agreement, routing_agreement

MOE_MODEL_TYPES = ("qwen3_moe", "qwen2_moe")
SHARED_EXPERT_MODEL_TYPES = ("qwen2_moe",)
"""MoE architectures with one sigmoid-gated shared expert per sparse layer (``shared_expert_intermediate_size``)."""
SHARED_EXPERT_GATE = (
    "megatron/core/transformer/moe/shared_experts.py SharedExpertMLP.forward: "
    "output * sigmoid(linear(hidden_states, gate_weight))"
)
"""Where megatron-core 0.16 computes the shared-expert gate; equal to transformers' Qwen2-MoE
``F.sigmoid(shared_expert_gate(x)) * shared_expert(x)`` (same input, same [1, hidden] weight, no bias)."""
TOKEN_DISPATCHERS = ("alltoall", "allgather")
ROUTING_REPLAY_MODES = ("none", "rollout")
"""``moe.routing_replay``: 'none' routes every forward freshly; 'rollout' replays the rollout engine's routes."""
_LOAD_ATTR = "_mugrpo_tokens_per_expert"
"""Router attribute holding this update's routed-token counts per expert (set by the forward hook)."""
_TRACKER_NAMES = {"load_balancing_loss": MOE_AUX_LOSS, "z_loss": MOE_Z_LOSS}


class MoeConfigError(InputError, ValueError):
    """A mixture-of-experts config.json or ``moe.*`` setting that cannot be built; says why."""


@dataclass(kw_only=True)
class MoeConfig:
    """``moe.*``: router losses and token dispatch of mixture-of-experts models (ignored for dense ones)."""

    aux_loss_coeff: float = 0.0
    """Coefficient of the Switch-style load-balancing loss (Qwen3-MoE pretraining used 1e-3); 0: off."""
    z_loss_coeff: float = 0.0
    """Coefficient of the router z-loss (mean squared logsumexp of the router logits); 0: off."""
    token_dispatcher: str = "alltoall"
    """How tokens reach experts on other expert-parallel ranks: 'alltoall' (sends each token only
    where its experts live) or 'allgather' (every rank sees every token; simpler, more traffic)."""
    routing_replay: str = "none"
    """'none': the trainer routes every token itself. 'rollout' (R3): every forward of an update, the
    backward's recompute included, uses the top-k experts the rollout engine chose for that token and
    layer (the batch's ``routes``); the router still computes the gate probabilities of those experts,
    so π_θ is evaluated with β's routes (docs/method.md). Needs a MoE model and an engine that records."""
    grouped_gemm: bool = True
    """Run each layer's local experts as one grouped GEMM (Transformer Engine's ``TEGroupedMLP``) when
    Transformer Engine imports, i.e. on GPU; false, or without it: one expert after another
    (``SequentialMLP``). Both hold the same weights under different names, which the converter maps alike."""

    def __post_init__(self) -> None:
        require(
            self.routing_replay in ROUTING_REPLAY_MODES,
            f"moe.routing_replay={self.routing_replay!r} is not one of {ROUTING_REPLAY_MODES}",
        )
        for name in ("aux_loss_coeff", "z_loss_coeff"):
            require(getattr(self, name) >= 0, f"moe.{name} must be >= 0, got {getattr(self, name)}")
        require(
            self.token_dispatcher in TOKEN_DISPATCHERS,
            f"moe.token_dispatcher={self.token_dispatcher!r} is not one of {TOKEN_DISPATCHERS}",
        )


def is_moe(hf_config: dict[str, Any]) -> bool:
    """True for a mixture-of-experts architecture (``model_type`` in ``MOE_MODEL_TYPES``)."""
    return hf_config.get("model_type") in MOE_MODEL_TYPES


def has_shared_expert(hf_config: dict[str, Any]) -> bool:
    """True for an architecture whose sparse layers carry a gated shared expert (Qwen2-MoE)."""
    return hf_config.get("model_type") in SHARED_EXPERT_MODEL_TYPES


def shared_expert_width(hf_config: dict[str, Any]) -> int:
    """Width of the shared expert's gated MLP (``shared_expert_intermediate_size``); 0 without one."""
    return int(hf_config.get("shared_expert_intermediate_size") or 0) if has_shared_expert(hf_config) else 0


def num_experts(hf_config: dict[str, Any]) -> int:
    """Routed experts per MoE layer: ``num_experts`` in released Qwen3-MoE configs, ``num_local_experts``
    in those transformers 5 writes; 0 when neither is there."""
    return int(hf_config.get("num_experts") or hf_config.get("num_local_experts") or 0)


def moe_layer_pattern(hf_config: dict[str, Any]) -> list[int]:
    """1 for each layer whose MLP is sparse, 0 for a dense one, as transformers' Qwen3-MoE decides:
    layer i is sparse unless listed in ``mlp_only_layers`` or (i + 1) is off the ``decoder_sparse_step`` grid."""
    step = int(hf_config.get("decoder_sparse_step", 1) or 1)
    dense = set(hf_config.get("mlp_only_layers") or [])
    return [
        int(i not in dense and (i + 1) % step == 0 and num_experts(hf_config) > 0)
        for i in range(hf_config["num_hidden_layers"])
    ]


def check_moe(
    hf_config: dict[str, Any], *, tensor_parallel: int, expert_parallel: int, expert_tensor_parallel: int | None = None
) -> None:
    """MoeConfigError naming the key when the experts cannot be built or split as asked
    (``expert_tensor_parallel`` splits each expert; None: ``tensor_parallel``)."""
    experts, topk = num_experts(hf_config), int(hf_config["num_experts_per_tok"])
    if not 1 <= topk <= experts:
        raise MoeConfigError(f"num_experts_per_tok={topk} must be between 1 and num_experts={experts}")
    _check_shared_expert(hf_config, tensor_parallel)
    if experts % expert_parallel:
        raise MoeConfigError(
            f"expert parallel size {expert_parallel} must divide num_experts={experts}; "
            "choose parallel.expert_parallel among its divisors"
        )
    width = int(hf_config["moe_intermediate_size"])
    etp = tensor_parallel if expert_tensor_parallel is None else expert_tensor_parallel
    if width % etp:
        name = "tensor" if expert_tensor_parallel is None else "expert tensor"
        raise MoeConfigError(f"{name} parallel size {etp} must divide moe_intermediate_size={width}")
    if not any(moe_layer_pattern(hf_config)):
        raise MoeConfigError("no layer is sparse (decoder_sparse_step / mlp_only_layers leave every MLP dense)")


def _check_shared_expert(hf_config: dict[str, Any], tensor_parallel: int) -> None:
    """MoeConfigError naming ``shared_expert_intermediate_size`` when the shared expert cannot be built as asked."""
    arch, width = hf_config.get("model_type"), hf_config.get("shared_expert_intermediate_size")
    if not has_shared_expert(hf_config):
        if width:
            raise MoeConfigError(
                f"shared_expert_intermediate_size={width} with model_type={arch!r}: transformers' {arch} has no "
                f"shared expert and ignores the key; remove it, or use a model type with shared experts "
                f"{SHARED_EXPERT_MODEL_TYPES}"
            )
        return
    if not isinstance(width, int) or width < 1:
        raise MoeConfigError(
            f"model_type={arch!r} needs shared_expert_intermediate_size >= 1 (the shared expert's width), got {width!r}"
        )
    if width % tensor_parallel:
        raise MoeConfigError(
            f"tensor parallel size {tensor_parallel} must divide shared_expert_intermediate_size={width}; "
            "choose parallel.tensor_parallel among its divisors"
        )


def moe_transformer_fields(
    hf_config: dict[str, Any],
    moe: MoeConfig,
    *,
    expert_parallel: int,
    grouped_gemm: bool,
    expert_tensor_parallel: int | None = None,
) -> dict[str, Any]:
    """``TransformerConfig`` fields of the MoE layers; ``grouped_gemm`` only with Transformer Engine
    (on CPU the experts run one after another: ``SequentialMLP``)."""
    return dict(
        num_moe_experts=num_experts(hf_config),
        moe_router_topk=int(hf_config["num_experts_per_tok"]),
        moe_ffn_hidden_size=int(hf_config["moe_intermediate_size"]),
        moe_layer_freq=moe_layer_pattern(hf_config),
        moe_router_score_function="softmax",
        # norm_topk_prob: softmax over the chosen k logits == renormalised top-k of the full softmax.
        moe_router_pre_softmax=not bool(hf_config.get("norm_topk_prob", True)),
        moe_router_dtype="fp32",  # transformers computes the router softmax in float32
        moe_router_load_balancing_type="aux_loss" if moe.aux_loss_coeff > 0 else "none",
        moe_aux_loss_coeff=float(moe.aux_loss_coeff),
        moe_z_loss_coeff=float(moe.z_loss_coeff) if moe.z_loss_coeff > 0 else None,
        moe_token_dispatcher_type=moe.token_dispatcher,
        moe_grouped_gemm=grouped_gemm,
        expert_model_parallel_size=expert_parallel,
        expert_tensor_parallel_size=expert_tensor_parallel,  # None: megatron-core takes the TP size
        moe_enable_routing_replay=moe.routing_replay == "rollout",
        # Qwen2-MoE: sigmoid(x · w_gate) · shared_expert(x), added to the routed output (SHARED_EXPERT_GATE).
        moe_shared_expert_intermediate_size=shared_expert_width(hf_config) or None,
        moe_shared_expert_gate=has_shared_expert(hf_config),
    )


def check_routing_replay(hf_config: dict[str, Any], moe: MoeConfig) -> None:
    """MoeConfigError naming ``moe.routing_replay`` when it is on for a model without routers."""
    if moe.routing_replay != "none" and not is_moe(hf_config):
        raise MoeConfigError(
            f"moe.routing_replay={moe.routing_replay!r} replays the experts a rollout engine chose, but the model "
            f"(model_type={hf_config.get('model_type')!r}) is dense and has no router; set moe.routing_replay=none"
        )


# ------------------------------------------------------------------------------------ metrics


def _bare(module: torch.nn.Module) -> torch.nn.Module:
    while isinstance(getattr(module, "module", None), torch.nn.Module):
        module = module.module
    return module


def _routers(model_chunks: list[torch.nn.Module]) -> list[torch.nn.Module]:
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for chunk in model_chunks for m in chunk.modules() if isinstance(m, TopKRouter)]


def _count_routed(router: torch.nn.Module, _inputs: Any, output: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Forward hook: add this micro-batch's routed tokens per expert (routing_map [tokens, E])."""
    counts = output[1].detach().sum(dim=0, dtype=torch.float64)
    setattr(router, _LOAD_ATTR, getattr(router, _LOAD_ATTR) + counts)


def install_expert_load_hooks(model: torch.nn.Module) -> int:
    """Count routed tokens per expert in every router of ``model``; returns the number of routers."""
    routers = _routers([model])
    for router in routers:
        setattr(router, _LOAD_ATTR, torch.zeros(router.config.num_moe_experts, dtype=torch.float64))
        router.register_forward_hook(_count_routed)
    return len(routers)


def reset_moe_metrics(model_chunks: list[torch.nn.Module]) -> None:
    """Zero the expert counts and megatron's aux-loss tracker (call before an update's schedule)."""
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

    for router in _routers(model_chunks):
        getattr(router, _LOAD_ATTR).zero_()
    reset_routing_agreement(model_chunks)
    clear_aux_losses_tracker()


def expert_load(model_chunks: list[torch.nn.Module], dp_group: Any, sp_group: Any = None) -> torch.Tensor:
    """[local MoE layers, E] share of routed token slots per expert since the last reset, summed over
    the data-parallel ranks, which route different tokens. TP ranks route the same tokens, except
    under sequence parallelism, where each routes its own slice of the sequence: ``sp_group`` (the TP
    group then) sums those too."""
    routers = _routers(model_chunks)
    if not routers:
        return torch.zeros(0, 0, dtype=torch.float64)
    counts = torch.stack([getattr(r, _LOAD_ATTR) for r in routers])
    for group in (dp_group, sp_group):
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(counts, group=group)
    return counts / counts.sum(dim=1, keepdim=True).clamp_min(1.0)


def _sequence_parallel_group(config: Any, groups: Any) -> Any:
    """The TP group when sequence parallelism splits the tokens over it, else None."""
    return groups.tp_group if getattr(config, "sequence_parallel", False) and groups.tp > 1 else None


def load_layer_key(bound: str, layer: int) -> str:
    """``train/moe_load_{min,max}_layer_NN``: the load bound of one MoE layer (0-based global index)."""
    return moe_layer_load_key(bound, layer)


def _load_metrics(model_chunks: list[torch.nn.Module], groups: Any, config: Any) -> dict[str, float]:
    """Smallest and largest expert share, over the model and per MoE layer, equal on every rank.

    Each pipeline stage fills the rows of its own layers (by the router's global ``layer_number``) of
    a [layers, 2] table of (min, −max), which one MIN all-reduce over PP completes; dense layers keep
    +inf and are left out.
    """
    load = expert_load(model_chunks, groups.dp_group, _sequence_parallel_group(config, groups))
    table = torch.full((config.num_layers, 2), math.inf, dtype=torch.float64)
    for router, row in zip(_routers(model_chunks), load):
        table[router.layer_number - 1] = torch.stack([row.min(), -row.max()])
    table = table.to(groups.device)
    if groups.pp > 1:  # each stage holds other layers
        dist.all_reduce(table, op=dist.ReduceOp.MIN, group=groups.pp_group)
    sparse = [
        (layer, float(low), -float(neg_high)) for layer, (low, neg_high) in enumerate(table.cpu()) if low < math.inf
    ]
    if not sparse:
        return {MOE_LOAD_MIN: 1.0, MOE_LOAD_MAX: 0.0}
    metrics = {MOE_LOAD_MIN: min(low for _, low, _ in sparse), MOE_LOAD_MAX: max(h for *_, h in sparse)}
    for layer, low, high in sparse:
        metrics[load_layer_key("min", layer)] = low
        metrics[load_layer_key("max", layer)] = high
    return metrics


def _tracked_losses(config: Any, groups: Any, num_micro_batches: int) -> dict[str, float]:
    """Mean aux / z loss per MoE layer and micro-batch from megatron's tracker, equal on every rank.

    Per layer the tracker holds the sum over micro-batches of each micro-batch's loss over this
    rank's tokens. Layers are summed over PP stages (each holds its own), over the router's reduce
    group when it has one (partial losses of split tokens), then averaged over DP (other tokens).
    Entries are created when absent so that every rank runs the same collectives.
    """
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    enabled = {"load_balancing_loss": config.moe_aux_loss_coeff > 0, "z_loss": config.moe_z_loss_coeff is not None}
    tracker = get_moe_layer_wise_logging_tracker()
    out = {}
    for name, on in enabled.items():
        if not on:
            continue
        entry = tracker.setdefault(name, {"values": torch.zeros(config.num_layers)})
        values = entry["values"].to(groups.device, torch.float64)
        if groups.pp > 1:
            dist.all_reduce(values, group=groups.pp_group)
        if entry.get("reduce_group") is not None and dist.get_world_size(entry["reduce_group"]) > 1:
            dist.all_reduce(values, group=entry["reduce_group"])
        elif (sp_group := _sequence_parallel_group(config, groups)) is not None:
            # Each TP rank logged the mean over its own slice of the sequence (megatron divides the
            # z-loss coefficient by the TP size): the mean of the slices' means is the whole's.
            dist.all_reduce(values, group=sp_group)
            values /= groups.tp
        if groups.dp > 1:
            dist.all_reduce(values, group=groups.dp_group)
            values /= groups.dp
        layers = max(sum(config.moe_layer_freq), 1)
        out[_TRACKER_NAMES[name]] = float(values.sum()) / layers / max(num_micro_batches, 1)
    return out


def moe_step_metrics(model_chunks: list[torch.nn.Module], groups: Any, num_micro_batches: int) -> dict[str, float]:
    """``train/moe_*`` of the update that just ran, identical on every rank (see the module docstring).

    Collective over the DP and PP groups: every rank must call it.
    """
    config = _bare(model_chunks[0]).config
    metrics = _load_metrics(model_chunks, groups, config)
    metrics.update(_tracked_losses(config, groups, num_micro_batches))
    agreement = routing_agreement(model_chunks, groups)
    if agreement is not None:
        metrics[ROUTING_AGREEMENT] = agreement
    return metrics
