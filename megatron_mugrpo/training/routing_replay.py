"""Routing replay (R3) in the trainer, and how often the trainer's own routing agrees with the engine's.

A batch may carry the experts the rollout engine chose for every input token and MoE layer
(``TrainBatch.routes`` [B, L, moe_layers, k], recorded by ``rollout.routes``). Before each
micro-batch's forward, ``set_micro_batch_routes`` hands every router its layer's routes. A model built
with ``moe.routing_replay: rollout`` (``training.moe.MoeConfig``) then uses them in place of its
routers' own top-k, in the forward and in an activation recompute during backward; whenever routes
are given, ``train/routing_agreement`` is the fraction of (real token, MoE layer) pairs whose fresh
top-k set equals them (``StageRoutingAgreement``: a stage's first value and mean). Under replay the
fresh choice at a layer is made on hidden states that earlier replayed layers produced.

    install_routing_hooks(model)                                  # the model provider, once per model
    with routes_for_schedule(model_chunks):                       # around each schedule
        set_micro_batch_routes(model, mb.routes, mb.response_mask)   # in forward_step, each micro-batch
    routing_agreement(model_chunks, groups)                       # after the update (collective)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron_mugrpo.errors import InputError
from megatron_mugrpo.metric_names import ROUTING_AGREEMENT, ROUTING_AGREEMENT_FIRST, ROUTING_AGREEMENT_STAGE_MEAN


def _routers(model_chunks: list[torch.nn.Module]) -> list[torch.nn.Module]:
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for chunk in model_chunks for m in chunk.modules() if isinstance(m, TopKRouter)]


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
            raise RoutingReplayError(
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
        tp_group = routers[0].tp_group  # the model's TP group (GPTModel's pg_collection.tp)
        tp, rank = dist.get_world_size(tp_group), dist.get_rank(tp_group)
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


def reset_routing_agreement(model_chunks: list[torch.nn.Module]) -> None:
    """Zero every router's agreement counts (before an update's schedule)."""
    for router in _routers(model_chunks):
        state = getattr(router, _ROUTES_ATTR, None)
        if state is not None:
            state.counts.zero_()


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

        stage = StageRoutingAgreement(from_first_update=update_in_stage == 0)
        for each update: stage.add(metrics)
        logger.log(stage.summary(), step=...)   # train/routing_agreement_{first,stage_mean}

    A stage resumed after its first update has no first value to report (``from_first_update=False``):
    its summary holds the mean of the updates this process made, and no ``_first``.
    """

    def __init__(self, from_first_update: bool = True) -> None:
        self.from_first_update = from_first_update
        self.values: list[float] = []

    def add(self, metrics: dict[str, float]) -> None:
        if ROUTING_AGREEMENT in metrics:
            self.values.append(float(metrics[ROUTING_AGREEMENT]))

    def summary(self) -> dict[str, float]:
        if not self.values:
            return {}
        first = {ROUTING_AGREEMENT_FIRST: self.values[0]} if self.from_first_update else {}
        return first | {ROUTING_AGREEMENT_STAGE_MEAN: sum(self.values) / len(self.values)}
