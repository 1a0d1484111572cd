"""The staged μ-GRPO loop: the whole method in one function, ``train``.

Each stage k freezes the policy π_k, pushes its weights to every rollout engine (one per engine
group), bulk-generates the static dataset D_k (B_train prompt groups with stored behaviour
log-probs) to disk on all of them, releases the engines, then makes μ = B_train / B_mini optimizer
updates on D_k. Standard GRPO (μ = 4), the
high-staleness baseline and M2PO are the same loop with other configs.

    mugrpo train --config configs/demo_cpu.yaml --run-dir runs/demo
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from megatron_mugrpo import replay
from megatron_mugrpo.evaluation import AVG_KEY, evaluate
from megatron_mugrpo.faults import crash_point
from megatron_mugrpo.metrics import progress
from megatron_mugrpo.records import RolloutGroup, collate
from megatron_mugrpo.replay import StageData
from megatron_mugrpo.rollout.generate import generate_planned, plan_stage, stage_identity, stage_store_metrics
from megatron_mugrpo.rollout.placement import engine_threads
from megatron_mugrpo.rollout.store import RolloutStore, StorePlan
from megatron_mugrpo.runtime import Run, barrier, behaviour_policy, release_engine, stage_prompts, sync_engine
from megatron_mugrpo.state import BestEval
from megatron_mugrpo.training.checkpoint import step_dir_name
from megatron_mugrpo.training.stage_reference import OldLogprobs, ScoreSettings, prepare_stage_reference
from megatron_mugrpo.training.train_step import train_step

if TYPE_CHECKING:
    from tqdm import tqdm

    from megatron_mugrpo.rollout.prompts import PromptRecord

log = logging.getLogger(__name__)

GAP_KEY = "train/rollout_logprob_abs_diff_max"
BEST_FILE = "best.json"
"""RUN_DIR/best.json: the best eval/avg_pass@1 so far, its update and its checkpoint (kept from pruning)."""
FINAL_HF_DIR = "hf_final"
TIMER_KEYS = ("perf/t_rollout_s", "perf/t_optimize_s", "perf/t_eval_s")


def train(run: Run) -> dict[str, float]:
    """Run (or continue) every stage of ``run``; returns the end-of-run summary."""
    cfg, state = run.cfg, run.state
    if state.global_update == 0 and state.acc_before is None:
        state.acc_before = run_evaluation(run).get(AVG_KEY, float("nan"))
    for stage in range(state.stage, cfg.stages.num_stages):
        with run.timer("perf/t_rollout_s"):
            store = rollout_phase(run, stage)  # sync weights → generate D_k → store → release engine
        crash_point(f"rollout:{stage}")
        if run.state.update_in_stage == 0:
            run.logger.log(store_summary(run, store, stage), step=run.state.global_update)
        optimize_stage(run, stage, store)  # μ updates on D_k → evaluate → checkpoint
    export_final(run)
    return summary(run)


def optimize_stage(run: Run, stage: int, store: RolloutStore | None = None) -> None:
    """The μ = B_train / B_mini updates of stage ``stage`` (continuing a resumed one), then eval + checkpoint."""
    cfg = run.cfg
    store = store or RolloutStore.open(run.rollout_dir(stage))
    if run.state.stage != stage:  # `mugrpo optimize` of another stage than the checkpoint's cursor
        run.state = run.state.at_stage(stage)
    mu = cfg.stages.updates_per_stage
    with run.timer("perf/t_optimize_s"):
        run.checkpoints.poll()  # the stage-end checkpoint, written in the background during generation
        old_logprobs = stage_reference(run, store)  # π_train(θ_old): rollout/mismatch_*, rollout correction
        data = replay.stage_data(run, stage, store)  # D_k, plus the buffered groups HDR accepts (if enabled)
        for update in progress_range(run, run.state.update_in_stage, mu, f"stage {stage} updates"):
            metrics = optimizer_update(run, data, stage, update, old_logprobs)
            run.logger.log(metrics, step=run.state.global_update)
            crash_point(f"update:{run.state.global_update}")
            run.checkpoints.poll()  # publish a background checkpoint once every rank has written it
            # Evaluate first: the checkpoint then holds the result, and a resume never loses the record.
            if _due(cfg.eval.every_updates, run.state.global_update):
                run_evaluation(run)
            if _due(cfg.checkpoint.every_updates, run.state.global_update) and update + 1 < mu:
                checkpoint(run)
    replay.end_stage(run, stage, store)  # D_k's mixed-outcome groups enter the replay FIFO
    run.state = run.state.at_stage(stage + 1)
    last = stage + 1 == cfg.stages.num_stages
    if cfg.eval.every_updates == 0 or (last and not _due(cfg.eval.every_updates, run.state.global_update)):
        run_evaluation(run)  # every stage end by default; always once at the end of training
    if last or _due(cfg.checkpoint.every_stages, stage + 1):
        checkpoint(run)


def rollout_phase(run: Run, stage: int) -> RolloutStore:
    """Generate D_k on every engine host, unless a complete, intact one is on disk; every rank opens it."""
    cfg = run.cfg
    prompts = stage_prompts(run.prompts, stage, cfg.stages.train_groups, cfg.data.seed)
    plan = plan_rollout(run, stage, prompts)  # rank 0 verifies or repairs the store; every rank gets the plan
    if plan.missing:
        with behaviour_policy(run, plan.manifest.policy_version):  # β_k (an older policy only when repairing)
            sync_engine(run)
        with engine_threads(run.placement.cpu_threads), stage_progress(run, plan, stage) as bar:
            metrics = generate_planned(
                plan,
                engine=run.engine,
                prompts=prompts,
                tokenizer=run.tokenizer,
                reward_fn=run.reward_fn,
                cfg=cfg.rollout,
                adv_eps=cfg.algo.adv_eps,
                store_dir=run.rollout_dir(stage),
                seed=cfg.stages.seed,
                hosts=run.hosts,
                progress=bar.update,
                on_shard_written=lambda index: crash_point(f"shard:{stage}:{index}"),
            )
        release_engine(run)  # free every engine's memory for the optimizer phase
        run.logger.log({k: v for k, v in metrics.items() if k.startswith("perf/")}, step=run.state.global_update)
    return RolloutStore.open(run.rollout_dir(stage), verify=False)  # rank 0 verified every shard


def plan_rollout(run: Run, stage: int, prompts: list[PromptRecord]) -> StorePlan:
    """What stage ``stage``'s store needs (collective); a store made by an older policy keeps its version."""
    identity = stage_identity(
        cfg=run.cfg.rollout,
        prompts=prompts,
        stage=stage,
        policy_version=run.state.global_update,
        seed=run.cfg.stages.seed,
        vocab_size=int(run.hf_config["vocab_size"]),
        engine_name=run.cfg.rollout.engine,
    )
    return plan_stage(run.rollout_dir(stage), identity, run.hosts, keep_policy_version=True)


def stage_progress(run: Run, plan: StorePlan, stage: int) -> tqdm:
    """Rank 0's progress bar over the rows its own engine generates (a total only with one engine)."""
    rows = sum(len(plan.manifest.shard_range(i)) for i in plan.missing) * run.cfg.rollout.group_size
    total = rows if run.placement.num_engines == 1 else None
    return progress(total, f"stage {stage} rollout", enabled=run.is_writer and run.cfg.logging.progress_bars)


def optimizer_update(
    run: Run, data: StageData, stage: int, update: int, old_logprobs: OldLogprobs | None = None
) -> dict[str, float]:
    """One optimizer update on the ``update``-th seeded minibatch of B_mini groups of D_k (+ replayed groups)."""
    cfg = run.cfg
    started = time.perf_counter()
    groups = data.minibatch(update, cfg.stages.mini_groups, cfg.stages.seed, old_logprobs)
    metrics, tokens = train_on_groups(run, groups)
    if update == 0:
        check_first_update(run, metrics, stage)
    run.state.update_in_stage, run.state.global_update = update + 1, run.state.global_update + 1
    run.state.data_cursor = (update + 1) * cfg.stages.mini_groups
    seconds = time.perf_counter() - started
    return metrics | {
        "train/stage": float(stage),
        "perf/update_s": seconds,
        "perf/train_tokens_per_s": tokens / max(seconds, 1e-9),
    }


def train_on_groups(run: Run, groups: list[RolloutGroup]) -> tuple[dict[str, float], float]:
    """One optimizer step on some prompt groups (also the async loop's); returns its metrics and response tokens."""
    cfg = run.cfg
    batch = collate(groups, pad_id=run.tokenizer.pad_token_id or 0)
    metrics = train_step(
        run.policy,
        batch,
        loss_name=cfg.algo.loss,
        loss_options=cfg.algo.loss_options(),
        temperature=cfg.rollout.temperature,
        micro_batch_size=cfg.parallel.micro_batch_size,
        impl=cfg.kernels.logprob_impl,
        rollout_correction=cfg.algo.rollout_correction,
        logits_budget_mib=cfg.kernels.logits_budget_mib,
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


def stage_reference(run: Run, store: RolloutStore) -> OldLogprobs | None:
    """Score D_k with the trainer before the stage's first update (training.stage_reference): logs
    rollout/mismatch_* when rollout.quantization is on, returns log π_old when a rollout correction is on."""
    cfg = run.cfg
    settings = ScoreSettings(
        temperature=cfg.rollout.temperature,
        micro_batch_size=cfg.parallel.micro_batch_size,
        impl=cfg.kernels.logprob_impl,
        logits_budget_mib=cfg.kernels.logits_budget_mib,
        pad_id=run.tokenizer.pad_token_id or 0,
        chunk_groups=cfg.stages.mini_groups,
    )
    old_logprobs, metrics = prepare_stage_reference(
        run.policy,
        store,
        correction=cfg.algo.rollout_correction,
        measure=cfg.rollout.quantization != "none",
        first_update=run.state.update_in_stage == 0,
        settings=settings,
        seed=cfg.stages.seed,
        write=run.is_writer,
    )
    if metrics:
        run.logger.log(metrics, step=run.state.global_update)
    return old_logprobs


def run_evaluation(run: Run) -> dict[str, float]:
    """Evaluate the current policy on every benchmark over every engine host; records the best by average."""
    if not run.benchmarks:
        return {}
    with run.timer("perf/t_eval_s"):
        sync_engine(run)
        with engine_threads(run.placement.cpu_threads):
            metrics = evaluate(
                run.engine,
                run.benchmarks,
                tokenizer=run.tokenizer,
                reward_fn=run.reward_fn,
                eval_cfg=run.cfg.eval,
                seed=run.cfg.seed + 7919 * run.state.global_update,
                hosts=run.hosts,
            )
        release_engine(run)
        barrier()
    if run.is_writer:
        run.state.acc_last = metrics[AVG_KEY]
        best = run.state.best
        if best is None or metrics[AVG_KEY] > best.avg_pass_at_1:
            run.state.best = BestEval(avg_pass_at_1=metrics[AVG_KEY], global_update=run.state.global_update)
        run.logger.log(metrics | _timers(run), step=run.state.global_update)
    return metrics


def checkpoint(run: Run) -> None:
    """Save model, optimizer and trainer state (timers included); the best evaluated step is never pruned.

    The state also stores how many metrics records exist now: a run resumed from this checkpoint drops
    exactly the records logged after it (work it redoes), even those logged at this same step.
    """
    run.state.timers = _timers(run)
    run.state.metrics_records = run.logger.records
    best = run.state.best
    saved = run.checkpoints.save(
        run.state.global_update,
        run.policy.model_chunks,
        hf_config=run.hf_config,
        optimizer=run.policy.optimizer,
        scheduler=run.policy.scheduler,
        trainer_state=run.state,
        run_config=run.cfg.to_dict(),
        keep=[best.global_update] if best else [],
        write_extra=replay.checkpoint_writer(run),
    )
    if run.is_writer and best:
        step_dir = run.checkpoint_root / step_dir_name(best.global_update)
        # The best may be the starting policy (update 0), which lives in the base HF directory; the
        # step just saved may still be being written in the background.
        exists = step_dir.is_dir() or step_dir == saved
        where = step_dir if exists else (run.hf_dir if best.global_update == 0 else None)
        record = {
            "avg_pass@1": best.avg_pass_at_1,
            "global_update": best.global_update,
            "checkpoint": str(where) if where else None,
        }
        (run.run_dir / BEST_FILE).write_text(json.dumps(record, indent=2) + "\n")


def export_final(run: Run) -> None:
    """Write the trained policy as a Hugging Face directory, ``RUN_DIR/hf_final`` (replacing an older one)."""
    import shutil

    from conversion import export_hf, save_hf_dir

    target = run.run_dir / FINAL_HF_DIR
    tensors = export_hf(run.policy.unwrapped(), run.hf_config, run.groups)
    if run.is_writer:
        shutil.rmtree(target, ignore_errors=True)
        save_hf_dir(((name, tensor.cpu()) for name, tensor in tensors), target, run.hf_config, run.hf_dir)
    else:
        for _ in tensors:  # take part in the export's collectives
            pass
    barrier()


def store_summary(run: Run, store: RolloutStore, stage: int) -> dict[str, float]:
    """The stage's rollout metrics (from the store's manifest, so a resumed run reports the same)."""
    return stage_store_metrics(store.store_dir) | {"rollout/stage": float(stage)} | _timers(run)


def summary(run: Run) -> dict[str, float]:
    """End-of-run figures: accuracy before/after, time per phase, updates, tokens."""
    timers = _timers(run)
    return {
        "acc_before": _or_nan(run.state.acc_before),
        "acc_after": _or_nan(run.state.acc_last),
        "best_acc": _or_nan(run.state.best.avg_pass_at_1 if run.state.best else None),
        "t_rollout_s": timers["perf/t_rollout_s"],
        "t_optimize_s": timers["perf/t_optimize_s"],
        "t_eval_s": timers["perf/t_eval_s"],
        "t_total_s": timers["perf/t_total_s"],
        "updates": float(run.state.global_update),
        "train_tokens": run.state.train_tokens,
    }


def _or_nan(value: float | None) -> float:
    return float("nan") if value is None else float(value)


def _timers(run: Run) -> dict[str, float]:
    """Phase times and the run's wall clock, accumulated across resumes."""
    phases = {k: run.extra_timers.get(k, 0.0) + run.timer.total(k) for k in TIMER_KEYS}
    total = run.extra_timers.get("perf/t_total_s", 0.0) + (time.monotonic() - run.started)
    return phases | {"perf/t_total_s": total}


def _due(every: int, global_update: int) -> bool:
    return every > 0 and global_update % every == 0


def progress_range(run: Run, start: int, stop: int, desc: str) -> Iterator[int]:
    """``range(start, stop)`` with a progress bar on rank 0 when enabled."""
    bar = progress(stop, desc, enabled=run.is_writer and run.cfg.logging.progress_bars, initial=start)
    for index in range(start, stop):
        yield index
        bar.update(1)
    bar.close()
