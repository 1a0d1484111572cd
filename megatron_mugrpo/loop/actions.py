"""What both loops do besides generating: train on prompt groups, evaluate, checkpoint, summarise.

The staged loop (``loop/staged.py``) and the async loop (``loop/asynchronous.py``) differ only in
where their groups come from; everything they do with them, and when they evaluate and checkpoint
(``Run.cadence``), is here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

from megatron_mugrpo import durable
from megatron_mugrpo.asynchronous.liveness import advance
from megatron_mugrpo.evaluation import AVG_KEY, evaluate
from megatron_mugrpo.loop import hdr, preemption
from megatron_mugrpo.loop.engines import release_engine, sync_engine
from megatron_mugrpo.loop.run import Run
from megatron_mugrpo.metric_names import LOGPROB_GAP_MAX, STAGE_OVERHEAD_PREFIX, T_EVAL, T_OPTIMIZE, T_ROLLOUT, T_TOTAL
from megatron_mugrpo.metrics import progress
from megatron_mugrpo.records import RolloutGroup, collate
from megatron_mugrpo.rollout.placement import engine_threads
from megatron_mugrpo.state import BestEval
from megatron_mugrpo.training.checkpoint import step_dir_name
from megatron_mugrpo.training.train_step import train_step

log = logging.getLogger(__name__)

GAP_KEY = LOGPROB_GAP_MAX
BEST_FILE = "best.json"
"""RUN_DIR/best.json: the best eval/avg_pass@1 so far, its update and its checkpoint (kept from pruning)."""
TIMER_KEYS = (T_ROLLOUT, T_OPTIMIZE, T_EVAL)


def train_on_groups(run: Run, groups: list[RolloutGroup]) -> tuple[dict[str, float], float]:
    """One optimizer step on some prompt groups; returns its metrics and response tokens."""
    cfg, scoring = run.cfg, run.trainer.scoring
    batch = collate(groups, pad_id=scoring.pad_id)
    metrics = train_step(
        run.policy,
        batch,
        loss_name=cfg.algo.loss,
        loss_options=cfg.algo.loss_options(),
        temperature=scoring.temperature,
        micro_batch_size=scoring.micro_batch_size,
        impl=scoring.impl,
        rollout_correction=cfg.algo.rollout_correction,
        logits_budget_mib=scoring.logits_budget_mib,
        micro_batch_tokens=scoring.micro_batch_tokens,
        pack_sequences=scoring.pack_sequences,
    )
    tokens = float(batch.response_mask.sum())
    run.state.train_tokens += tokens
    return metrics, tokens


def check_first_update(run: Run, metrics: dict[str, float], stage: int) -> None:
    """At a stage's first update π_θ is β: trainer and engine log-probs must agree, unless the engine
    runs a quantized copy of the policy, whose gap is expected (and measured by rollout/mismatch_*)."""
    gap, tolerance = metrics.get(GAP_KEY, float("nan")), run.cfg.logging.logprob_gap_tolerance
    run.state.first_update_gap[str(stage)] = gap
    if run.cfg.rollout.quantization != "none":
        log.info("stage %d: first-update log-prob gap %.3g = the quantized behaviour policy's mismatch", stage, gap)
    elif not gap <= tolerance:
        log.warning(
            "STAGE %d: trainer vs rollout log-prob gap %.3g exceeds logging.logprob_gap_tolerance=%.3g at the first "
            "update, where the policy equals the behaviour policy. Converter, engine and trainer disagree "
            "(dtype, temperature, vocabulary padding or weight sync): the importance ratios are biased.",
            stage,
            gap,
            tolerance,
        )


def evaluate_and_checkpoint(run: Run, *, stage_end: bool, last: bool) -> bool:
    """What ``run.trainer.cadence`` asks for after the update just made: evaluation first, so that a checkpoint
    written now holds its result and a resume never loses the record. Returns whether it checkpointed."""
    done, cadence = run.state.global_update, run.trainer.cadence
    if cadence.evaluate_now(done, stage_end=stage_end, last=last):
        run_evaluation(run)
    due = cadence.checkpoint_now(done, stage_end=stage_end, last=last, stages_done=run.state.stage)
    if due:
        checkpoint(run)
    return due


def stop_if_preempted(run: Run, *, checkpointed: bool) -> None:
    """A safe point (every trainer rank calls it at the same place): when any rank was signalled
    (``loop.preemption``), checkpoint the state unless ``checkpointed`` already holds it, and raise
    ``Preempted``; the background writer is published as the run closes."""
    if not preemption.agreed(run.groups.any_rank):
        return
    if not checkpointed:
        checkpoint(run)
    raise preemption.stopped(run.state.global_update, checkpointed=True)


def run_evaluation(run: Run) -> dict[str, float]:
    """Evaluate the current policy on every benchmark over every engine host; records the best by average."""
    if not run.inputs.benchmarks:
        return {}
    advance(f"evaluating after update {run.state.global_update}")
    with run.telemetry.timer(T_EVAL):
        synced = sync_engine(run)
        with engine_threads(run.placement.cpu_threads):
            metrics = evaluate(
                run.engine,
                run.inputs.benchmarks,
                tokenizer=run.inputs.tokenizer,
                eval_cfg=run.cfg.eval,
                seed=run.cfg.seed + 7919 * run.state.global_update,
                hosts=run.hosts,
                env=run.cfg.env,  # multi-turn problems when env.enabled (the environment lives for this call)
            )
        release_engine(run)
        run.hosts.barrier()
    if run.is_writer:
        run.state.acc_last = metrics[AVG_KEY]
        best = run.state.best
        if best is None or metrics[AVG_KEY] > best.avg_pass_at_1:
            run.state.best = BestEval(avg_pass_at_1=metrics[AVG_KEY], global_update=run.state.global_update)
        run.telemetry.logger.log(metrics | synced | timers(run), step=run.state.global_update)
    return metrics


def checkpoint(run: Run) -> None:
    """Save model, optimizer and trainer state (timers included); the best evaluated step is never pruned.

    The state also stores how many metrics records exist now: a run resumed from this checkpoint drops
    exactly the records logged after it (work it redoes), even those logged at this same step.
    """
    advance(f"checkpointing update {run.state.global_update}")
    run.state.timers = timers(run)
    run.state.metrics_records = run.telemetry.logger.records
    best = run.state.best
    saved = run.trainer.checkpoints.save(
        run.state.global_update,
        run.policy.model_chunks,
        hf_config=run.origin.hf_config,
        optimizer=run.policy.optimizer,
        scheduler=run.policy.scheduler,
        trainer_state=run.state,
        run_config=run.cfg.to_dict(),
        keep=[best.global_update] if best else [],
        write_extra=hdr.checkpoint_writer(run.trainer.replay),
    )
    if run.is_writer and best:
        step_dir = run.checkpoint_root / step_dir_name(best.global_update)
        # The best may be the starting policy (update 0), which lives in the base HF directory; the
        # step just saved may still be being written in the background.
        exists = step_dir.is_dir() or step_dir == saved
        where = step_dir if exists else (run.origin.hf_dir if best.global_update == 0 else None)
        record = {
            "avg_pass@1": best.avg_pass_at_1,
            "global_update": best.global_update,
            "checkpoint": str(where) if where else None,
        }
        durable.atomic_write_json(run.run_dir / BEST_FILE, record, indent=2)  # it names a checkpoint: whole or old


def summary(run: Run) -> dict[str, float]:
    """End-of-run figures: accuracy before/after, time per phase, updates, tokens."""
    phases = timers(run)
    return {
        "acc_before": _or_nan(run.state.acc_before),
        "acc_after": _or_nan(run.state.acc_last),
        "best_acc": _or_nan(run.state.best.avg_pass_at_1 if run.state.best else None),
        "t_rollout_s": phases[T_ROLLOUT],
        "t_optimize_s": phases[T_OPTIMIZE],
        "t_eval_s": phases[T_EVAL],
        "t_total_s": phases[T_TOTAL],
        "updates": float(run.state.global_update),
        "train_tokens": run.state.train_tokens,
    }


def timers(run: Run) -> dict[str, float]:
    """Phase times and the run's wall clock, accumulated across resumes."""
    phases = {k: run.telemetry.extra_timers.get(k, 0.0) + run.telemetry.timer.total(k) for k in TIMER_KEYS}
    total = run.telemetry.extra_timers.get(T_TOTAL, 0.0) + (time.monotonic() - run.telemetry.started)
    return phases | {T_TOTAL: total}


@contextmanager
def overhead_part(parts: dict[str, float], name: str) -> Iterator[None]:
    """Add the block's wall-clock seconds to ``parts["perf/stage_overhead_<name>_s"]``: one part of a
    stage's boundary (what a stage costs besides sampling and optimizer updates)."""
    started = time.perf_counter()
    try:
        yield
    finally:
        key = f"{STAGE_OVERHEAD_PREFIX}{name}_s"
        parts[key] = parts.get(key, 0.0) + time.perf_counter() - started


def progress_range(run: Run, start: int, stop: int, desc: str) -> Iterator[int]:
    """``range(start, stop)`` with a progress bar on rank 0 when enabled."""
    bar = progress(stop, desc, enabled=run.is_writer and run.cfg.logging.progress_bars, initial=start)
    for index in range(start, stop):
        yield index
        bar.update(1)
    bar.close()


def _or_nan(value: float | None) -> float:
    return float("nan") if value is None else float(value)
