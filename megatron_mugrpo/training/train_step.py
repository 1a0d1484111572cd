"""One optimizer update on B_mini prompt groups, and a no-grad log-prob pass, through Megatron's schedules.

    metrics = train_step(policy, batch, loss_name="mu_grpo", loss_options=cfg.algo.loss_options(),
                         temperature=cfg.rollout.temperature,
                         micro_batch_size=cfg.parallel.micro_batch_size, impl=cfg.kernels.logprob_impl,
                         logits_budget_mib=cfg.kernels.logits_budget_mib)

The whole update's ``TrainBatch`` is passed identically to every rank. ``training.batching`` plans
each data-parallel rank's micro-batches, which run through ``get_forward_backward_func()`` (1F1B
across pipeline stages):

* fixed rows (``micro_batch_size``): a contiguous equal share of the rows in micro-batches of
  ``micro_batch_size`` sequences, each as wide as the update's longest row;
* token budget (``micro_batch_tokens``, ``parallel.micro_batch_tokens``): a share balanced by tokens,
  rows sorted by length, each micro-batch as wide as its own longest row and at most the budget in
  tokens, padding included. Micro-batches then differ in shape; pipeline stages exchange the shapes
  (megatron-core's ``variable_seq_lengths``, switched on for that schedule only).

Empty responses (mask 0: zero loss, zero normaliser) fill the micro-batches so that every rank runs
the same number of them, which expert-parallel all-to-alls and pipeline communication require.

Loss normalisation follows Megatron's ``calculate_per_token_loss`` mechanism and the loss
registry's (loss_sum, normaliser) contract: each micro-batch backpropagates its loss *sum*; the
schedule accumulates the normalisers, ``finalize_model_grads`` all-reduces them over DP (and
broadcasts across PP) and divides the summed gradients by the global normaliser. The update is
therefore Σ ∇loss_sum / Σ normaliser over micro-batches and DP ranks, independent of both counts.
The normaliser never depends on θ (see ``algorithms.losses``), so this is exact, and so are the
reported metrics: each micro-batch's loss returns its diagnostics as sums and counts
(``LossStats``), merged over micro-batches and DP ranks before any fraction is taken.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.distributed import finalize_model_grads
from megatron.core.distributed.finalize_model_grads import reset_model_temporary_tensors
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.utils import get_model_config
from torch import Tensor

from megatron_mugrpo.algorithms.diagnostics import drift_stats, trigger_threshold, with_drift
from megatron_mugrpo.algorithms.losses import LossStats, has_update_pass, update_inputs
from megatron_mugrpo.algorithms.rollout_correction import (
    RolloutCorrectionConfig,
    corrected_policy_loss,
    correction_inputs,
)
from megatron_mugrpo.kernels.config import DEFAULT_LOGITS_BUDGET_MIB
from megatron_mugrpo.kernels.policy import choose_logprob_path
from megatron_mugrpo.metric_names import (
    DP_TOKEN_IMBALANCE,
    GRAD_NORM,
    LOGPROB_GAP_MAX,
    LOGPROB_GAP_MEAN,
    LOSS,
    LR,
    NORMALISER,
    PADDING_FRAC,
    RESPONSE_TOKENS,
    TRAIN_PREFIX,
    UPDATE_SUCCESSFUL,
)
from megatron_mugrpo.records import TrainBatch
from megatron_mugrpo.training.batching import (
    MicroBatchPlan,
    padding_fraction,
    plan_update,
    round_up,
    row_lengths,
    token_imbalance,
)
from megatron_mugrpo.training.logprobs import (
    check_impl,
    hidden_states_instead_of_logits,
    logprobs_from_hidden,
    logprobs_from_logits,
)
from megatron_mugrpo.training.moe import moe_step_metrics, reset_moe_metrics
from megatron_mugrpo.training.optimizer import current_lr
from megatron_mugrpo.training.packing import (
    PackedRows,
    pack_micro_batch,
    per_sequence_rotary,
    te_attention,
    thd_inputs,
)
from megatron_mugrpo.training.parallel import ParallelGroups
from megatron_mugrpo.training.rope_cache import shared_cos_sin
from megatron_mugrpo.training.routing_replay import routes_for_schedule, set_micro_batch_routes
from megatron_mugrpo.training.setup import Policy

LossFn = Callable[[TrainBatch, Tensor], tuple[Tensor, Tensor, dict[str, float]]]


# ------------------------------------------------------------------------------------ batching


def append_rows(batch: TrainBatch, extra: int) -> TrainBatch:
    """``batch`` with ``extra`` empty responses (mask 0, advantage 0) appended."""
    if extra == 0:
        return batch

    def grow(tensor: Tensor) -> Tensor:
        filler = torch.zeros((extra, *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
        return torch.cat([tensor, filler])

    return batch.map_rows(grow)


def pad_length(batch: TrainBatch, multiple: int) -> TrainBatch:
    """Append padding columns (mask 0) until the sequence length is a multiple of ``multiple``
    (sequence parallelism splits the sequence into TP equal parts)."""
    return set_length(batch, round_up(batch.tokens.shape[1], multiple))


def set_length(batch: TrainBatch, length: int) -> TrainBatch:
    """Every [B, L] tensor cut or right-padded (mask 0) to ``length`` columns; routes [B, L', ...] are
    only cut (``routing_replay.replay_rows`` takes routes shorter than the row)."""

    def fit(tensor: Tensor) -> Tensor:
        if tensor.dim() < 2:
            return tensor
        if tensor.dim() > 2:  # routes
            return tensor[:, :length]
        return torch.nn.functional.pad(tensor[:, :length], (0, max(0, length - tensor.shape[1])))

    if batch.tokens.shape[1] == length:
        return batch
    return batch.map_rows(fit)


def take(batch: TrainBatch, plan: MicroBatchPlan) -> TrainBatch:
    """The micro-batch ``plan`` describes: its rows of ``batch``, ``plan.length`` columns, filler rows
    (mask 0: zero loss, zero normaliser) up to ``plan.size``."""
    index = torch.tensor(plan.rows, dtype=torch.long, device=batch.tokens.device)
    rows = batch.map_rows(lambda tensor: tensor.index_select(0, index))
    return append_rows(set_length(rows, plan.length), plan.size - len(plan.rows))


def update_plan(
    batch: TrainBatch,
    groups: ParallelGroups,
    micro_batch_size: int,
    micro_batch_tokens: int | None = None,
    *,
    sequence_parallel: bool = False,
    pack_sequences: bool = False,
) -> list[list[MicroBatchPlan]]:
    """Every DP rank's micro-batches for ``batch`` (``training.batching``): fixed rows when
    ``micro_batch_tokens`` is None, else token-budget micro-batches over a by-tokens DP share,
    several sequences per row with ``pack_sequences``."""
    return plan_update(
        row_lengths(batch.response_mask),
        width=batch.tokens.shape[1],
        dp=groups.dp,
        micro_batch_size=micro_batch_size,
        micro_batch_tokens=micro_batch_tokens,
        multiple=groups.tp if sequence_parallel else 1,
        pack=pack_sequences,
    )


MicroBatch = tuple[TrainBatch, PackedRows | None]
"""What the schedule's data iterator yields: the micro-batch one response per row (the loss's
layout), and its packed rows when it is packed (the model's input)."""


def build_micro_batches(batch: TrainBatch, plans: list[MicroBatchPlan], device: torch.device) -> list[MicroBatch]:
    """This rank's micro-batches of ``batch`` as ``plans`` cut them, on ``device``."""
    lengths = row_lengths(batch.response_mask)
    out: list[MicroBatch] = []
    for plan in plans:
        mb = take(batch, plan)
        packed = pack_micro_batch(mb, plan, lengths) if plan.bins else None
        out.append((mb.to(device), _packed_to(packed, device)))
    return out


def _packed_to(packed: PackedRows | None, device: torch.device) -> PackedRows | None:
    if packed is None:
        return None
    fields = {f.name: getattr(packed, f.name) for f in dataclasses.fields(packed)}
    return PackedRows(**{name: None if value is None else value.to(device) for name, value in fields.items()})


def plan_metrics(plans: list[list[MicroBatchPlan]], batch: TrainBatch) -> dict[str, float]:
    """``perf/dp_token_imbalance`` (the most-loaded DP rank's computed tokens over the mean) and
    ``perf/padding_frac`` (share of the computed tokens that are padding)."""
    return {
        DP_TOKEN_IMBALANCE: token_imbalance(plans),
        PADDING_FRAC: padding_fraction(plans, row_lengths(batch.response_mask)),
    }


def _is_moe(policy: Policy) -> bool:
    return bool(getattr(_bare(policy.model_chunks[0]).config, "num_moe_experts", None))


def _sequence_parallel(policy: Policy) -> bool:
    return bool(getattr(_bare(policy.model_chunks[0]).config, "sequence_parallel", False))


def _position_ids(tokens: Tensor) -> Tensor:
    return torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)


def _bare(model: torch.nn.Module) -> torch.nn.Module:
    while hasattr(model, "module"):
        model = model.module
    return model


# ----------------------------------------------------------------------------- forward step


def _forward_step_func(
    impl: str,
    temperature: float,
    vocab_size: int,
    groups: ParallelGroups,
    loss_fn: LossFn,
    logits_budget_mib: float = DEFAULT_LOGITS_BUDGET_MIB,
) -> Callable[[Any, torch.nn.Module], tuple[Tensor, Callable[[Tensor], Any]]]:
    """The ``forward_step_func`` Megatron's schedules call once per micro-batch.

    On the last stage the returned loss function turns the model output into [B, L] log-probs
    (fused: from hidden states and the output weight; unfused: from the logits shard) and hands
    them to ``loss_fn``. Other stages' outputs are activations sent down the pipeline. ``impl``
    "auto" picks the path per micro-batch (``kernels.policy``); ``logits_budget_mib`` is
    ``kernels.logits_budget_mib``.
    """
    check_impl(impl)
    budget = int(logits_budget_mib * 2**20)

    thd_models: dict[int, bool] = {}  # model id -> takes packed rows as THD (Transformer Engine attention)

    def forward_step(data_iterator: Any, model: torch.nn.Module) -> tuple[Tensor, Callable[[Tensor], Any]]:
        mb, packed = next(data_iterator)
        thd = packed is not None and thd_models.setdefault(id(model), te_attention(_bare(model)))
        _set_routes(_bare(model), mb, packed, thd)
        tokens = mb.tokens if packed is None else packed.tokens
        n_columns = _bare(model).vocab_size // groups.tp  # the padded vocabulary's rows on this TP rank
        path = choose_logprob_path(
            impl, n_tokens=tokens.numel(), n_columns=n_columns, device=tokens.device, budget_bytes=budget
        )
        with contextlib.ExitStack() as stack:
            head = stack.enter_context(hidden_states_instead_of_logits(_bare(model))) if path == "fused" else None
            if packed is None:
                output = model(tokens, _position_ids(tokens), None)
            elif thd:  # one [1, R·W] row; TE's attention and megatron's RoPE read each sequence's bounds
                flat_tokens, flat_positions, params = thd_inputs(_bare(model), packed)
                output = model(flat_tokens, flat_positions, None, packed_seq_params=params)
            else:
                stack.enter_context(per_sequence_rotary(_bare(model), packed.positions))
                output = model(tokens, packed.positions, packed.attention_mask)

        def loss_func(model_output: Tensor) -> Any:
            if packed is None:
                targets = torch.where(mb.response_mask.bool(), mb.targets, 0)  # pad ids need not be real ids
            else:
                targets = packed.targets.reshape(1, -1) if thd else packed.targets
            kwargs = {"temperature": temperature, "vocab_size": vocab_size, "tp_group": groups.tp_group}
            if head is not None:
                logprobs = logprobs_from_hidden(model_output, head.weight, targets, keep_bytes=budget, **kwargs)
            else:
                logprobs = logprobs_from_logits(model_output, targets, **kwargs)
            return loss_fn(mb, logprobs if packed is None else packed.unpack(logprobs))

        return output, loss_func

    return forward_step


def _set_routes(model: torch.nn.Module, mb: TrainBatch, packed: PackedRows | None, thd: bool) -> None:
    """MoE routing replay / agreement for this micro-batch: routes follow their tokens into packed rows,
    and into THD's single flattened row."""
    rows = mb if packed is None else packed
    routes, mask = rows.routes, rows.response_mask
    if thd:
        mask = mask.reshape(1, -1)
        routes = None if routes is None else routes.reshape(1, -1, *routes.shape[2:])
    set_micro_batch_routes(model, routes, mask)


def _run_schedule(
    policy: Policy, micro_batches: list[MicroBatch], forward_step: Callable, *, forward_only: bool
) -> list[dict[str, Any]]:
    """Run all micro-batches through the forward(-backward) schedule; the last stage's per-micro-batch
    loss outputs come back (other stages get an empty list)."""
    schedule = get_forward_backward_func()
    shapes = [tuple((mb if packed is None else packed).tokens.shape) for mb, packed in micro_batches]
    with (
        routes_for_schedule(policy.model_chunks),
        _variable_shapes(policy.model_chunks, len(set(shapes)) > 1),
        shared_cos_sin(),  # RoPE's cos / sin once per table, not per layer and micro-batch (training.rope_cache)
        _one_rank_finalize(policy.model_chunks, policy.groups),
    ):
        return schedule(
            forward_step_func=forward_step,
            data_iterator=[iter(micro_batches)],
            model=policy.model_chunks,
            num_microbatches=len(micro_batches),
            seq_length=shapes[0][1],
            micro_batch_size=shapes[0][0],
            forward_only=forward_only,
        )


@contextmanager
def _variable_shapes(model_chunks: list[torch.nn.Module], varied: bool) -> Iterator[None]:
    """Megatron's ``variable_seq_lengths`` for one schedule whose micro-batches differ in shape
    (token-budget micro-batches): pipeline stages then send each activation's shape before it instead
    of assuming the schedule's one ``seq_length`` × ``micro_batch_size``. Only on when needed: it
    costs one small message per send. The schedule reads it from the model's config at each send."""
    config = get_model_config(model_chunks[0])
    before = config.variable_seq_lengths
    config.variable_seq_lengths = before or varied
    try:
        yield
    finally:
        config.variable_seq_lengths = before


def one_rank(groups: ParallelGroups) -> bool:
    """Every parallel group of the model has one rank (DP = TP = PP = EP = expert TP = 1)."""
    return groups.dp == groups.tp == groups.pp == groups.ep == groups.etp == 1


@contextmanager
def _one_rank_finalize(model_chunks: list[torch.nn.Module], groups: ParallelGroups) -> Iterator[None]:
    """After the last micro-batch, a one-rank update only divides its gradients by the normaliser.

    megatron-core's ``finalize_model_grads`` would also run three collectives on groups of one rank
    (the DDP buckets' all-reduce, the normaliser's PP broadcast and DP all-reduce): identities that
    cost a few milliseconds per update at the demo's shape. With per-token loss the DDP buckets are
    not pre-scaled (gradient_scaling_factor 1), so what remains is exactly the division below. A
    router with expert bias (which updates it from an all-reduce) keeps megatron-core's function."""
    config = get_model_config(model_chunks[0])
    mine = config.finalize_model_grads_func is finalize_model_grads  # not a caller's own hook
    if not (one_rank(groups) and mine and not config.moe_router_enable_expert_bias):
        yield
        return
    config.finalize_model_grads_func = _finalize_one_rank
    try:
        yield
    finally:
        config.finalize_model_grads_func = finalize_model_grads


def _finalize_one_rank(model: list[torch.nn.Module], num_tokens: Tensor | None = None, **_collectives: Any) -> None:
    """``finalize_model_grads`` at one rank: the MoE trackers' reset and the division by the normaliser."""
    reset_model_temporary_tensors(get_model_config(model[0]), model)
    if num_tokens is not None and num_tokens > 0:
        for chunk in model:
            chunk.scale_gradients(1.0 / num_tokens)


# ---------------------------------------------------------------------------------- train step


def policy_loss_fn(loss_name: str, loss_options: dict[str, Any], caps: dict[str, float]) -> LossFn:
    """Registry loss (with the rollout correction's ``caps`` when one is on) plus the cheap
    train-vs-rollout log-prob gap and the paper's drift diagnostics, in Megatron's 3-tuple form."""
    threshold = trigger_threshold(loss_options)

    def loss_fn(mb: TrainBatch, logprobs: Tensor) -> tuple[Tensor, Tensor, dict[str, Any]]:
        out = corrected_policy_loss(
            loss_name,
            logprobs,
            mb.behaviour_logprobs,
            mb.advantages,
            mb.response_mask,
            old_logprobs=mb.old_logprobs,
            update_inputs=mb.loss_inputs,
            **caps,
            **loss_options,
        )
        with torch.no_grad():
            mask = mb.response_mask.bool()
            gap = torch.where(mask, (logprobs - mb.behaviour_logprobs).abs(), 0.0)
            stats = {
                "loss_sum": float(out.loss_sum.detach()),
                "normaliser": float(out.normaliser),
                "gap_sum": float(gap.sum()),
                "gap_max": float(gap.max()) if gap.numel() else 0.0,
                "response_tokens": float(mask.sum()),
                # π_θ vs the stored β whatever the loss (and correction) sees: algorithms.diagnostics
                "stats": with_drift(
                    out.stats,
                    drift_stats(logprobs, mb.behaviour_logprobs, mb.advantages, mb.response_mask, threshold=threshold),
                ).host(),
            }
        # The normaliser counts responses or tokens: an integer, as Megatron's token count must be.
        num_tokens = out.normaliser.detach().round().to(torch.int)
        return out.loss_sum, num_tokens, stats

    return loss_fn


def with_update_inputs(
    batch: TrainBatch, scores: Tensor, loss_name: str, loss_options: dict[str, Any], caps: dict[str, float]
) -> TrainBatch:
    """``batch`` carrying its loss's update-pass inputs, computed from the whole update's ``scores``
    [B, L] (log π_θ, no grad) so that they travel with their rows into any micro-batch. The pass sees
    what the loss will see: under the rollout correction, π_old and w·A."""
    anchor, advantages, _ = correction_inputs(
        batch.behaviour_logprobs, batch.advantages, batch.response_mask, old_logprobs=batch.old_logprobs, **caps
    )
    inputs = update_inputs(loss_name, scores, anchor, advantages, batch.response_mask, **loss_options)
    return dataclasses.replace(batch, loss_inputs=inputs)


def _summarise(records: list[dict[str, Any]]) -> dict[str, float]:
    """Update-level metrics from every micro-batch's parts: sums add, fractions are Σ num / Σ den,
    so no figure depends on how the update was split into micro-batches or ranks."""
    normaliser = sum(r["normaliser"] for r in records)
    tokens = sum(r["response_tokens"] for r in records)
    summary = {
        LOSS: sum(r["loss_sum"] for r in records) / normaliser if normaliser > 0 else 0.0,
        NORMALISER: normaliser,
        RESPONSE_TOKENS: tokens,
        LOGPROB_GAP_MEAN: sum(r["gap_sum"] for r in records) / max(tokens, 1.0),
        LOGPROB_GAP_MAX: max((r["gap_max"] for r in records), default=0.0),
    }
    loss_metrics = LossStats.merge([r["stats"] for r in records]).finish()
    summary.update({f"{TRAIN_PREFIX}{name}": value for name, value in loss_metrics.items()})
    return summary


def _gather_records(records: list[dict[str, Any]], groups: ParallelGroups) -> list[dict[str, Any]]:
    """Every DP rank's last-stage micro-batch records, then shared from the last PP stage to all stages."""
    if groups.dp > 1:
        per_rank: list[Any] = [None] * groups.dp
        dist.all_gather_object(per_rank, records, group=groups.dp_group)
        records = [r for rank_records in per_rank for r in rank_records]
    if groups.pp > 1:
        box = [records]
        src = dist.get_global_rank(groups.pp_group, groups.pp - 1)
        dist.broadcast_object_list(box, src=src, group=groups.pp_group)
        records = box[0]
    return records


def train_step(
    policy: Policy,
    batch: TrainBatch,
    *,
    loss_name: str,
    loss_options: dict[str, Any],
    temperature: float,
    micro_batch_size: int,
    impl: str = "fused",
    rollout_correction: RolloutCorrectionConfig | None = None,
    logits_budget_mib: float = DEFAULT_LOGITS_BUDGET_MIB,
    micro_batch_tokens: int | None = None,
    pack_sequences: bool = False,
) -> dict[str, float]:
    """One optimizer update on ``batch`` (the whole update's rows, identical on every rank).

    With a ``rollout_correction`` that is on, the batch must carry ``old_logprobs`` (log π_old).
    ``micro_batch_tokens`` (``parallel.micro_batch_tokens``): token-budget micro-batches over a
    by-tokens DP share instead of ``micro_batch_size`` rows (``training.batching``); same update.

    Returns (on every rank) ``train/loss`` (Σ loss_sum / Σ normaliser), ``train/grad_norm`` (before
    clipping), ``train/lr``, ``train/update_successful``, the registry loss metrics prefixed
    ``train/`` (exact over micro-batches and DP ranks: counts summed, fractions Σ num / Σ den), and
    ``train/rollout_logprob_abs_diff_{mean,max}`` = |log π_θ − b| over response tokens. A
    mixture-of-experts policy adds ``train/moe_load_{min,max}`` and, when their coefficients are
    on, ``train/moe_aux_loss`` / ``train/moe_z_loss`` (``training.moe``).

    A loss with an update pass (M2PO) first scores the whole update without gradients
    (``forward_logprobs``, one extra forward) so that its mask or bound covers every token of the
    update on every rank, whatever the micro-batch split.
    """
    if policy.optimizer is None or policy.scheduler is None:
        raise ValueError("train_step needs a policy built with an optimizer (build_policy(..., optim=cfg.optim))")
    groups = policy.groups
    caps = rollout_correction.loss_options() if rollout_correction is not None else {}
    if has_update_pass(loss_name):  # e.g. M2PO's mask over the whole update, before any backward
        scores = forward_logprobs(
            policy,
            batch,
            temperature=temperature,
            micro_batch_size=micro_batch_size,
            impl=impl,
            logits_budget_mib=logits_budget_mib,
            micro_batch_tokens=micro_batch_tokens,
            pack_sequences=pack_sequences,
        )
        batch = with_update_inputs(batch, scores, loss_name, loss_options, caps)
    plans = update_plan(
        batch,
        groups,
        micro_batch_size,
        micro_batch_tokens,
        sequence_parallel=_sequence_parallel(policy),
        pack_sequences=pack_sequences,
    )
    micro_batches = build_micro_batches(batch, plans[groups.dp_rank], groups.device)
    loss_fn = policy_loss_fn(loss_name, loss_options, caps)
    forward_step = _forward_step_func(impl, temperature, policy.vocab_size, groups, loss_fn, logits_budget_mib)
    metrics = _update(policy, micro_batches, forward_step)
    return metrics | plan_metrics(plans, batch)


def _update(policy: Policy, micro_batches: list[TrainBatch], forward_step: Callable) -> dict[str, float]:
    """Zero the gradients, run forward and backward over this rank's micro-batches, step the optimizer
    and the schedule; returns the update's loss records summarised over DP ranks, the gradient norm, the
    learning rate, whether the step was taken and (MoE) the experts' load."""
    groups, moe = policy.groups, _is_moe(policy)
    for chunk in policy.model_chunks:
        chunk.train()
        chunk.zero_grad_buffer()
    policy.optimizer.zero_grad()
    if moe:
        reset_moe_metrics(policy.model_chunks)
    records = _run_schedule(policy, micro_batches, forward_step, forward_only=False)
    update_successful, grad_norm, _ = policy.optimizer.step()
    policy.scheduler.step(increment=1)
    metrics = _summarise(_gather_records(records, groups))
    metrics[GRAD_NORM] = float(grad_norm) if grad_norm is not None else float("nan")
    metrics[LR] = current_lr(policy.optimizer)
    metrics[UPDATE_SUCCESSFUL] = float(bool(update_successful))
    if moe:
        metrics.update(moe_step_metrics(policy.model_chunks, groups, len(micro_batches)))
    return metrics


# ------------------------------------------------------------------------------ forward only


def _logprob_only_fn(mb: TrainBatch, logprobs: Tensor) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    zero = torch.zeros((), device=logprobs.device)
    return zero, torch.zeros((), dtype=torch.int), {"logprobs": logprobs.detach()}


@torch.no_grad()
def forward_logprobs(
    policy: Policy,
    batch: TrainBatch,
    *,
    temperature: float,
    micro_batch_size: int,
    impl: str = "fused",
    logits_budget_mib: float = DEFAULT_LOGITS_BUDGET_MIB,
    micro_batch_tokens: int | None = None,
    pack_sequences: bool = False,
) -> Tensor:
    """Per-token log-probs [B, L] float32 of ``batch.targets`` (0 where the response mask is 0).

    No gradients, no optimizer. Each DP replica scores its share of rows (cut as ``train_step`` cuts
    them); the result is broadcast from the last pipeline stage and summed over DP, so every rank
    returns the full [B, L].
    """
    groups = policy.groups
    plans = update_plan(
        batch,
        groups,
        micro_batch_size,
        micro_batch_tokens,
        sequence_parallel=_sequence_parallel(policy),
        pack_sequences=pack_sequences,
    )
    mine = plans[groups.dp_rank]
    micro_batches = build_micro_batches(batch, mine, groups.device)
    for chunk in policy.model_chunks:
        chunk.eval()
    forward_step = _forward_step_func(impl, temperature, policy.vocab_size, groups, _logprob_only_fn, logits_budget_mib)
    records = _run_schedule(policy, micro_batches, forward_step, forward_only=True)
    # Each rank writes its rows into a zero [B, L] and the ranks' disjoint rows are summed: the
    # micro-batches differ in width and DP shares in size under the token budget.
    full = torch.zeros(batch.tokens.shape, device=groups.device)
    if groups.is_last_stage:
        for plan, (mb, _), record in zip(mine, micro_batches, records):
            width = min(plan.length, full.shape[1])
            scores = torch.where(mb.response_mask.bool(), record["logprobs"].float(), 0.0)
            rows = torch.tensor(plan.rows, dtype=torch.long, device=full.device)
            full[rows, :width] = scores[: len(plan.rows), :width]
    if groups.pp > 1:
        dist.broadcast(full, src=dist.get_global_rank(groups.pp_group, groups.pp - 1), group=groups.pp_group)
    if groups.dp > 1:
        dist.all_reduce(full, group=groups.dp_group)
    for chunk in policy.model_chunks:
        chunk.train()
    return full.cpu()
