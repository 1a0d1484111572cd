"""Mixture-of-experts models: Qwen3-MoE config → Megatron MoE fields, expert-load and aux-loss metrics.

A Hugging Face ``config.json`` with ``model_type: qwen3_moe`` describes a decoder whose MLPs are
sparse: every token goes to the top ``num_experts_per_tok`` of ``num_experts`` SwiGLU experts of width
``moe_intermediate_size``. Layers listed in ``mlp_only_layers`` (or not on the ``decoder_sparse_step``
grid) keep a dense MLP of width ``intermediate_size``. There is no shared expert.

Routing follows the model: softmax scores; with ``norm_topk_prob`` the top-k probabilities are
renormalised, which Megatron expresses as softmax *after* the top-k (``moe_router_pre_softmax=False``);
without it, softmax over all experts *before* the top-k. The load-balancing auxiliary loss and the
router z-loss are off unless ``moe.*`` sets their coefficients: for RL fine-tuning the policy loss is
the objective, and the routing of a pretrained model is already balanced.

    fields = moe_transformer_fields(hf_config, MoeConfig(aux_loss_coeff=1e-3), expert_parallel=2)
    metrics = moe_step_metrics(model_chunks, groups, num_micro_batches=4)   # after the schedule

Metrics (``train/``): ``moe_load_min`` / ``moe_load_max``, the smallest and largest share of routed
token slots any expert of any MoE layer received during the update (1/E when perfectly balanced;
padding tokens are routed too and are counted), and, when their coefficients are on,
``moe_aux_loss`` / ``moe_z_loss`` from megatron-core's aux-loss tracker (mean over MoE layers and
micro-batches, unscaled by the coefficient).

Routing replay (R3, ``moe.routing_replay: rollout``): a batch may carry the experts the rollout engine
chose for every input token and MoE layer (``TrainBatch.routes`` [B, L, moe_layers, k], recorded by
``rollout.routes``). ``set_micro_batch_routes`` hands each micro-batch's routes to the routers before
its forward; with replay on, megatron-core's replay hook uses them in place of the routers' own
top-k, in the forward and in an activation recompute during backward. Whenever routes are given,
``train/routing_agreement`` is the fraction of (real token, MoE layer) pairs whose fresh top-k set
equals them (``StageRoutingAgreement`` gives a stage's first value and mean).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron_mugrpo.errors import InputError, require

MOE_MODEL_TYPES = ("qwen3_moe",)
TOKEN_DISPATCHERS = ("alltoall", "allgather")
ROUTING_REPLAY_MODES = ("none", "rollout")
"""``moe.routing_replay``: 'none' routes every forward freshly; 'rollout' replays the rollout engine's routes."""
_LOAD_ATTR = "_mugrpo_tokens_per_expert"
"""Router attribute holding this update's routed-token counts per expert (set by the forward hook)."""
_TRACKER_NAMES = {"load_balancing_loss": "train/moe_aux_loss", "z_loss": "train/moe_z_loss"}


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


def check_moe(hf_config: dict[str, Any], *, tensor_parallel: int, expert_parallel: int) -> None:
    """MoeConfigError naming the key when the experts cannot be built or split as asked."""
    experts, topk = num_experts(hf_config), int(hf_config["num_experts_per_tok"])
    if not 1 <= topk <= experts:
        raise MoeConfigError(f"num_experts_per_tok={topk} must be between 1 and num_experts={experts}")
    if hf_config.get("shared_expert_intermediate_size"):
        raise MoeConfigError("shared experts (shared_expert_intermediate_size) are not supported yet")
    if experts % expert_parallel:
        raise MoeConfigError(
            f"expert parallel size {expert_parallel} must divide num_experts={experts}; "
            "choose parallel.expert_parallel among its divisors"
        )
    width = int(hf_config["moe_intermediate_size"])
    if width % tensor_parallel:
        raise MoeConfigError(f"tensor parallel size {tensor_parallel} must divide moe_intermediate_size={width}")
    if not any(moe_layer_pattern(hf_config)):
        raise MoeConfigError("no layer is sparse (decoder_sparse_step / mlp_only_layers leave every MLP dense)")


def moe_transformer_fields(
    hf_config: dict[str, Any], moe: MoeConfig, *, expert_parallel: int, grouped_gemm: bool
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
        moe_enable_routing_replay=moe.routing_replay == "rollout",
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
        state = getattr(router, _ROUTES_ATTR, None)
        if state is not None:
            state.counts.zero_()
    clear_aux_losses_tracker()


def expert_load(model_chunks: list[torch.nn.Module], dp_group: Any) -> torch.Tensor:
    """[local MoE layers, E] share of routed token slots per expert since the last reset, summed
    over the data-parallel ranks (which route different tokens; TP ranks route the same ones)."""
    routers = _routers(model_chunks)
    if not routers:
        return torch.zeros(0, 0, dtype=torch.float64)
    counts = torch.stack([getattr(r, _LOAD_ATTR) for r in routers])
    if dp_group is not None and dist.get_world_size(dp_group) > 1:
        dist.all_reduce(counts, group=dp_group)
    return counts / counts.sum(dim=1, keepdim=True).clamp_min(1.0)


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
    load = expert_load(model_chunks, groups.dp_group)
    bounds = torch.tensor(
        [float(load.min()) if load.numel() else 1.0, -float(load.max()) if load.numel() else 0.0],
        dtype=torch.float64,
        device=groups.device,
    )
    if groups.pp > 1:  # each stage holds other layers
        dist.all_reduce(bounds, op=dist.ReduceOp.MIN, group=groups.pp_group)
    metrics = {"train/moe_load_min": float(bounds[0]), "train/moe_load_max": -float(bounds[1])}
    config = _bare(model_chunks[0]).config
    metrics.update(_tracked_losses(config, groups, num_micro_batches))
    agreement = routing_agreement(model_chunks, groups)
    if agreement is not None:
        metrics["train/routing_agreement"] = agreement
    return metrics


# ------------------------------------------------------------------------------ routing replay
#
# megatron-core 0.16's hook (``moe_enable_routing_replay``, transformer/moe/router_replay.py) gives
# every TopKRouter a ``RouterReplay``: with action REPLAY_FORWARD its top-k is ``target_topk_idx``
# (the gate probabilities of those experts are still computed, so gradients reach the router), with
# REPLAY_BACKWARD it pops the oldest entry of ``replay_backward_list`` (one is appended per forward),
# which is what an activation-recompute in backward must see. Four traps of that hook are handled here:
#
# - rows: a router sees hidden states [s, b, h] flattened sequence-major (row s·B + b); routes arrive
#   batch-major [B, L, layers, k] (as HF and the engines lay them out) and are transposed;
# - ``set_target_indices`` accepts any row count and duplicate experts without a word (a wrong row
#   count silently routes other tokens' experts): every micro-batch's routes are checked for shape,
#   range and distinctness, and every router forward for its row count;
# - ``RouterReplay.global_router_replay_instances`` is one process-wide list, and
#   ``set_replay_data`` / ``set_global_router_replay_action`` address routers by position in it, so a
#   second replay-enabled model in the process shifts every index: our models leave that list and
#   are driven through their own routers' instances;
# - ``replay_backward_list`` grows by one entry per forward and is only popped by a recompute:
#   ``routes_for_schedule`` empties it before and after every schedule.
#
# Which action a forward takes is decided per call: inside the autograd engine (a recompute in
# backward) it is REPLAY_BACKWARD, else REPLAY_FORWARD; megatron-core itself never switches.

_ROUTES_ATTR = "_mugrpo_routes"
"""Router attribute holding its ``_RouterRoutes`` (set by ``install_routing_hooks``)."""


class RoutingReplayError(InputError, ValueError):
    """Routes that cannot be replayed (missing, wrong shape, out of range, repeated experts); says which."""


@dataclass
class _RouterRoutes:
    """One router's routes for the current forward and its agreement counts over the update."""

    moe_index: int
    """Position of this router's layer among the model's MoE layers (index into routes' layer axis)."""
    replay: bool
    given: torch.Tensor | None = None
    """[rows, k] int64 routes of the current micro-batch, sequence-major (None: none were given)."""
    valid: torch.Tensor | None = None
    """[rows] bool: rows that are real tokens (padding rows are routed but not compared)."""
    counts: torch.Tensor | None = None
    """[2] float64: (token-layer top-k sets equal to the given routes, sets compared) since the last reset."""


def _in_backward() -> bool:
    """True while the autograd engine runs (an activation recompute inside backward)."""
    return torch._C._current_graph_task_id() != -1


def install_routing_hooks(model: torch.nn.Module) -> int:
    """Give every router of ``model`` (one pipeline stage of a MoE GPTModel) its routes slot and hooks.

    Routers of a replay-enabled model leave megatron's process-global instance list (see above).
    Returns the number of routers.
    """
    from megatron.core.transformer.moe.router_replay import RouterReplay

    routers = _routers([model])
    ours = {id(r.router_replay) for r in routers if r.router_replay is not None}
    instances = RouterReplay.global_router_replay_instances
    instances[:] = [r for r in instances if id(r) not in ours]
    for router in routers:
        if router.router_replay is not None and router.config.moe_router_fusion:
            raise MoeConfigError(
                "moe.routing_replay=rollout cannot run with moe_router_fusion: megatron-core's fused top-k "
                "(Transformer Engine) bypasses the replay hook and would route freshly without a word"
            )
        pattern = list(router.config.moe_layer_freq)
        setattr(
            router,
            _ROUTES_ATTR,
            _RouterRoutes(
                moe_index=sum(pattern[: router.layer_number - 1]),
                replay=router.router_replay is not None,
                counts=torch.zeros(2, dtype=torch.float64),
            ),
        )
        router.register_forward_pre_hook(_before_router)
    return len(routers)


def _before_router(router: torch.nn.Module, args: tuple[Any, ...]) -> None:
    """Forward pre-hook: pick the replay action, check the rows, count agreement with the given routes."""
    state: _RouterRoutes = getattr(router, _ROUTES_ATTR)
    hidden = args[0]
    rows = hidden.shape[0] * hidden.shape[1]
    backward = _in_backward()
    if state.replay:
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        replay = router.router_replay
        target = (replay.replay_backward_list[0] if replay.replay_backward_list else None) if backward else state.given
        if target is None:
            raise RoutingReplayError(
                f"moe.routing_replay=rollout: MoE layer {router.layer_number} ran a forward without routes "
                "(the batch has no routes, or they were not set for this micro-batch)"
            )
        if target.shape[0] != rows:
            raise RoutingReplayError(
                f"moe.routing_replay=rollout: MoE layer {router.layer_number} routes {rows} token rows "
                f"(hidden {tuple(hidden.shape[:2])}) but was given routes for {target.shape[0]}"
            )
        replay.set_router_replay_action(
            RouterReplayAction.REPLAY_BACKWARD if backward else RouterReplayAction.REPLAY_FORWARD
        )
    if state.given is not None and not backward:
        _count_agreement(router, hidden, state)


@torch.no_grad()
def _count_agreement(router: torch.nn.Module, hidden: torch.Tensor, state: _RouterRoutes) -> None:
    """Add to ``state.counts`` how many real tokens' fresh top-k sets equal the given routes.

    The fresh choice is the top-k of the gate logits (softmax is monotonic, so pre- or post-softmax
    selection picks the same set); one extra [rows, h] × [h, E] product per layer."""
    if state.given.shape[0] != hidden.shape[0] * hidden.shape[1]:
        return  # a replaying router raises on this; a fresh one has nothing to compare
    logits = router.gating(hidden).reshape(-1, router.config.num_moe_experts)
    fresh = logits.topk(router.topk, dim=-1).indices.sort(dim=-1).values
    same = (fresh == state.given.to(fresh.device).sort(dim=-1).values).all(dim=-1)
    valid = state.valid.to(same.device)
    state.counts += torch.tensor([float((same & valid).sum()), float(valid.sum())], dtype=torch.float64)


def replay_rows(
    routes: torch.Tensor, valid: torch.Tensor, *, num_experts: int, topk: int, moe_layers: int
) -> torch.Tensor:
    """Check a micro-batch's routes and lay them out as a router sees its tokens.

    Args:
        routes: [B, L', moe_layers, k] integer expert ids aligned with the input tokens (L' <= L:
            positions past L' are padding).
        valid: [B, L] bool, the real input tokens (prompt + response minus its last token).
    Returns:
        [moe_layers, L·B, k] int64, row s·B + b = token (b, s); padding rows get experts 0..k-1.
    Raises RoutingReplayError naming what is wrong in a real token's routes.
    """
    batch, length = valid.shape
    if (
        routes.dim() != 4
        or routes.shape[0] != batch
        or routes.shape[1] > length
        or tuple(routes.shape[2:]) != (moe_layers, topk)
    ):
        raise RoutingReplayError(
            f"routes of shape {tuple(routes.shape)} do not fit a micro-batch of {batch} x {length} tokens of a "
            f"model with {moe_layers} MoE layers and top-{topk} routing "
            f"(expected [{batch}, <= {length}, {moe_layers}, {topk}])"
        )
    full = torch.arange(topk, dtype=torch.int64, device=routes.device).expand(batch, length, moe_layers, topk).clone()
    full[:, : routes.shape[1]] = routes.to(torch.int64)
    full[~valid.to(routes.device)] = torch.arange(topk, dtype=torch.int64, device=routes.device)
    if routes.shape[1] < length and bool(valid[:, routes.shape[1] :].any()):
        raise RoutingReplayError(f"routes cover {routes.shape[1]} positions but tokens up to {length} are real")
    real = full[valid.to(routes.device)]  # [tokens, layers, k]
    if real.numel() and (int(real.min()) < 0 or int(real.max()) >= num_experts):
        raise RoutingReplayError(
            f"routes hold expert ids in [{int(real.min())}, {int(real.max())}] outside [0, {num_experts}): "
            "recorded for another model?"
        )
    if topk > 1 and real.numel():
        ordered = real.sort(dim=-1).values
        repeated = (ordered[..., 1:] == ordered[..., :-1]).any(dim=-1)
        if bool(repeated.any()):
            where = repeated.nonzero()[0].tolist()
            raise RoutingReplayError(
                f"routes repeat an expert within one token's top-{topk} ({int(repeated.sum())} token-layer sets, "
                f"first at real token {where[0]}, MoE layer {where[1]}: {ordered[where[0], where[1]].tolist()})"
            )
    return full.permute(2, 1, 0, 3).reshape(moe_layers, length * batch, topk)


def real_tokens(response_mask: torch.Tensor) -> torch.Tensor:
    """[B, L] bool: the input positions a trainer batch row really holds, 0 .. its last response target
    (targets are the inputs shifted by one, so prompt + response minus its last token); rows without
    a response token (padding rows) hold none."""
    length = response_mask.shape[1]
    positions = torch.arange(length, device=response_mask.device)
    last = torch.where(response_mask.bool(), positions, -1).max(dim=1).values
    return positions[None, :] <= last[:, None]


def set_micro_batch_routes(model: torch.nn.Module, routes: torch.Tensor | None, response_mask: torch.Tensor) -> None:
    """Give every router of ``model`` its layer's routes for the next forward (call before each forward).

    ``routes``: the micro-batch's [B, L', moe_layers, k] (``TrainBatch.routes``), or None. A model built
    with ``moe.routing_replay=rollout`` replays them (None is an error); otherwise they only feed
    ``train/routing_agreement``.
    """
    routers = _routers([model])
    if not routers:
        return
    states: list[_RouterRoutes] = [getattr(r, _ROUTES_ATTR) for r in routers]
    if routes is None:
        if any(s.replay for s in states):
            raise RoutingReplayError(
                "moe.routing_replay=rollout needs the batch's routes (TrainBatch.routes), recorded by the rollout "
                "engine; this batch has none. Record routes in the engine or set moe.routing_replay=none"
            )
        for state in states:
            state.given = state.valid = None
        return
    config = routers[0].config
    rows = replay_rows(
        routes,
        real_tokens(response_mask),
        num_experts=config.num_moe_experts,
        topk=config.moe_router_topk,
        moe_layers=sum(config.moe_layer_freq),
    )
    valid = real_tokens(response_mask).t().reshape(-1)  # sequence-major like the rows
    if config.sequence_parallel:  # each TP rank routes its own slice of the sequence
        from megatron.core import parallel_state

        tp, rank = (
            parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_tensor_model_parallel_rank(),
        )
        share = rows.shape[1] // tp
        rows, valid = rows[:, rank * share : (rank + 1) * share], valid[rank * share : (rank + 1) * share]
    for router, state in zip(routers, states):
        state.given, state.valid = rows[state.moe_index].contiguous(), valid
        if state.replay:
            router.router_replay.set_target_indices(state.given)


def clear_routes(model_chunks: list[torch.nn.Module]) -> None:
    """Forget every router's routes and empty megatron's replay lists (before and after a schedule)."""
    for router in _routers(model_chunks):
        state = getattr(router, _ROUTES_ATTR, None)
        if state is not None:
            state.given = state.valid = None
        if router.router_replay is not None:
            router.router_replay.clear_indices()
            router.router_replay.clear_router_replay_action()


@contextlib.contextmanager
def routes_for_schedule(model_chunks: list[torch.nn.Module]) -> Iterator[None]:
    """Run one forward(-backward) schedule with clean route state: megatron's backward lists would
    otherwise grow by one entry per forward that no recompute pops, and stale routes could be replayed."""
    clear_routes(model_chunks)
    try:
        yield
    finally:
        clear_routes(model_chunks)


def routing_agreement(model_chunks: list[torch.nn.Module], groups: Any) -> float | None:
    """``train/routing_agreement`` since the last reset: the fraction of (real token, MoE layer) pairs
    whose fresh top-k set equals the given routes, over every DP rank and pipeline stage; None when
    no routes were given. Collective over the DP and PP groups (every rank must call it)."""
    counts = torch.zeros(2, dtype=torch.float64)
    for router in _routers(model_chunks):
        state = getattr(router, _ROUTES_ATTR, None)
        if state is not None:
            counts += state.counts
    counts = counts.to(groups.device)
    for size, group in ((groups.dp, groups.dp_group), (groups.pp, groups.pp_group)):
        if size > 1:
            dist.all_reduce(counts, group=group)
    return float(counts[0] / counts[1]) if counts[1] > 0 else None


class StageRoutingAgreement:
    """``train/routing_agreement`` of a stage's updates → the stage's first value and its mean.

    The first update's agreement is the numerics-only mismatch (π_θ = β); later updates add the drift
    of θ away from β, which is what replay hides under staleness.

        stage = StageRoutingAgreement()
        for each update: stage.add(metrics)
        logger.log(stage.summary(), step=...)   # train/routing_agreement_{first,stage_mean}
    """

    def __init__(self) -> None:
        self.values: list[float] = []

    def add(self, metrics: dict[str, float]) -> None:
        if "train/routing_agreement" in metrics:
            self.values.append(float(metrics["train/routing_agreement"]))

    def summary(self) -> dict[str, float]:
        if not self.values:
            return {}
        return {
            "train/routing_agreement_first": self.values[0],
            "train/routing_agreement_stage_mean": sum(self.values) / len(self.values),
        }
