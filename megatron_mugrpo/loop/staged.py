"""The staged μ-GRPO loop: the whole method in one function, ``train``.

Each stage k freezes the policy π_k, pushes its weights to every rollout engine (one per engine
group), bulk-generates the static dataset D_k (B_train prompt groups with stored behaviour
log-probs) to disk on all of them, releases the engines, then makes μ = B_train / B_mini optimizer
updates on D_k. Standard GRPO (μ = 4), the
high-staleness baseline and M2PO are the same loop with other configs.

    mugrpo train --config configs/demo_cpu.yaml --run-dir runs/demo
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from megatron_mugrpo.asynchronous.liveness import advance
from megatron_mugrpo.envs.episodes import ENV_METRICS
from megatron_mugrpo.evaluation import AVG_KEY
from megatron_mugrpo.faults import crash_point
from megatron_mugrpo.loop import hdr, preemption
from megatron_mugrpo.loop.actions import (
    check_first_update,
    evaluate_and_checkpoint,
    overhead_part,
    progress_range,
    run_evaluation,
    stop_if_preempted,
    summary,
    timers,
    train_on_groups,
)
from megatron_mugrpo.loop.data import StageData
from megatron_mugrpo.loop.engines import behaviour_policy, release_engine, restart_metrics, sync_engine
from megatron_mugrpo.loop.export import export_final
from megatron_mugrpo.loop.run import Run
from megatron_mugrpo.metric_names import (
    PERF_PREFIX,
    ROLLOUT_SAMPLING_S,
    STAGE,
    STAGE_OVERHEAD,
    STAGE_OVERHEAD_OTHER,
    STAGE_OVERHEAD_PREFIX,
    T_OPTIMIZE,
    T_ROLLOUT,
    TRAIN_STAGE,
    TRAIN_TOKENS_PER_S,
    UPDATE_S,
)
from megatron_mugrpo.metrics import progress
from megatron_mugrpo.rewards.registry import reward_record
from megatron_mugrpo.rollout.generate import (
    GenerationStopped,
    generate_planned,
    plan_stage,
    stage_identity,
    stage_store_metrics,
)
from megatron_mugrpo.rollout.placement import engine_threads
from megatron_mugrpo.rollout.prompts import stage_prompts
from megatron_mugrpo.rollout.store import RolloutStore, StorePlan
from megatron_mugrpo.training.routing_replay import StageRoutingAgreement
from megatron_mugrpo.training.stage_reference import OldLogprobs, prepare_stage_reference

if TYPE_CHECKING:
    from tqdm import tqdm

    from megatron_mugrpo.rollout.prompts import PromptRecord


def train(run: Run) -> dict[str, float]:
    """Run (or continue) every stage of ``run``; returns the end-of-run summary."""
    cfg, state = run.cfg, run.state
    if state.global_update == 0 and state.acc_before is None:
        state.acc_before = run_evaluation(run).get(AVG_KEY, float("nan"))
    for stage in range(state.stage, cfg.stages.num_stages):
        stop_if_preempted(run, checkpointed=stage_start_checkpointed(run, stage))  # a signal since the last update
        advance(f"in stage {stage}'s rollout phase")  # what a lost-rank report says this rank was doing
        with run.telemetry.timer(T_ROLLOUT):
            store = rollout_phase(run, stage)  # sync weights → generate D_k → store → release engine
        crash_point(f"rollout:{stage}")
        if run.state.update_in_stage == 0:
            run.telemetry.logger.log(store_summary(run, store, stage), step=run.state.global_update)
        optimize_stage(run, stage, store)  # μ updates on D_k → evaluate → checkpoint
    export_final(run)
    return summary(run)


def optimize_stage(run: Run, stage: int, store: RolloutStore | None = None) -> None:
    """The μ = B_train / B_mini updates of stage ``stage`` (continuing a resumed one), then eval + checkpoint."""
    store = store or RolloutStore.open(run.rollout_dir(stage))
    if run.state.stage != stage:  # `mugrpo optimize` of another stage than the checkpoint's cursor
        run.state = run.state.at_stage(stage)
    mu = run.cfg.stages.updates_per_stage
    with run.telemetry.timer(T_OPTIMIZE):
        run.trainer.checkpoints.poll()  # the stage-end checkpoint, written in the background during generation
        data = stage_data(run, stage, store)  # D_k, log π_old, and the buffered groups HDR accepts (if enabled)
        agreement = StageRoutingAgreement(from_first_update=run.state.update_in_stage == 0)  # MoE only
        for update in progress_range(run, run.state.update_in_stage, mu, f"stage {stage} updates"):
            metrics = optimizer_update(run, data, stage, update)
            agreement.add(metrics)
            run.telemetry.logger.log(metrics, step=run.state.global_update)
            crash_point(f"update:{run.state.global_update}")
            run.trainer.checkpoints.poll()  # publish a background checkpoint once every rank has written it
            if update + 1 < mu:  # the stage's last update is judged below, as the stage's end
                saved = evaluate_and_checkpoint(run, stage_end=False, last=False)
                stop_if_preempted(run, checkpointed=saved)  # SIGTERM / SIGUSR1: checkpoint now, exit
        if routing := agreement.summary():  # train/routing_agreement_{first,stage_mean}
            run.telemetry.logger.log(routing, step=run.state.global_update)
    hdr.end_stage(run, stage, store)  # D_k's mixed-outcome groups enter the replay FIFO
    run.state = run.state.at_stage(stage + 1)
    evaluate_and_checkpoint(run, stage_end=True, last=stage + 1 == run.cfg.stages.num_stages)


def stage_data(run: Run, stage: int, store: RolloutStore) -> StageData:
    """What the stage's updates draw from: D_k, its log π_old (rollout correction) and HDR's replayed groups."""
    old_logprobs = stage_reference(run, store)  # π_train(θ_old): rollout/mismatch_*, rollout correction
    mu = run.cfg.stages.updates_per_stage
    replayed = hdr.replayed_groups(run, stage, mu)  # collective when HDR re-scores the buffer
    return StageData(store=store, replayed=replayed, updates=mu, old_logprobs=old_logprobs, recheck=hdr.recheck(run))


def rollout_phase(run: Run, stage: int) -> RolloutStore:
    """Generate D_k on every engine host, unless a complete, intact one is on disk; every rank opens it.

    Logs, with the phase's ``perf/rollout_*`` metrics, the stage boundary: ``perf/stage_overhead_s``,
    the phase's seconds other than sampling, and its parts ``perf/stage_overhead_<part>_s`` (store_plan,
    weight_sync, reward, store_write, engine_release, store_open, other: the rest)."""
    cfg, started, parts = run.cfg, time.perf_counter(), {}
    prompts = stage_prompts(run.inputs.prompts, stage, cfg.stages.train_groups, cfg.data.seed)
    with overhead_part(parts, "store_plan"):
        plan = plan_rollout(run, stage, prompts)  # rank 0 verifies or repairs the store; every rank gets the plan
    if not plan.missing:
        return RolloutStore.open(run.rollout_dir(stage), verify=False)
    with overhead_part(parts, "weight_sync"), behaviour_policy(run, plan.manifest.policy_version):
        metrics = sync_engine(run)  # β_k (an older policy only when repairing)
    with engine_threads(run.placement.cpu_threads), stage_progress(run, plan, stage) as bar, stopping(run, stage):
        metrics |= generate_planned(
            plan,
            engine=run.engine,
            prompts=prompts,
            tokenizer=run.inputs.tokenizer,
            reward_fn=run.inputs.reward_fn,
            cfg=cfg.rollout,
            adv_eps=cfg.algo.adv_eps,
            store_dir=run.rollout_dir(stage),
            seed=cfg.stages.seed,
            hosts=run.hosts,
            progress=bar.update,
            on_shard_written=lambda index: crash_point(f"shard:{stage}:{index}"),  # fault injection
            stop=lambda: preemption.requested() is not None,  # a signalled host claims no further shard
            env=cfg.env,  # multi-turn trajectories when env.enabled (the environment lives for this call)
        )
    metrics |= restart_metrics(run)  # engines the watchdog replaced (rollout.max_restarts), over every host
    with overhead_part(parts, "engine_release"):
        release_engine(run)  # free every engine's memory for the optimizer phase (where that frees any)
    with overhead_part(parts, "store_open"):
        store = RolloutStore.open(run.rollout_dir(stage), verify=False)  # rank 0 verified every shard
    perf = {k: v for k, v in metrics.items() if k.startswith(PERF_PREFIX) or k in ENV_METRICS}
    run.telemetry.logger.log(
        perf | stage_overhead(parts | perf, time.perf_counter() - started), step=run.state.global_update
    )
    return store


@contextmanager
def stopping(run: Run, stage: int) -> Iterator[None]:
    """Turn the hosts' agreed stop in a rollout phase (``GenerationStopped``, raised on every rank) into
    ``Preempted``: the written shards are durable and a resume generates the missing ones."""
    try:
        yield
    except GenerationStopped:
        raise preemption.stopped(run.state.global_update, checkpointed=stage_start_checkpointed(run, stage)) from None


def stage_start_checkpointed(run: Run, stage: int) -> bool:
    """Whether a checkpoint holds the state stage ``stage`` starts from: the run's start (nothing to lose)
    or a stage end the cadence checkpointed (checkpoint.every_stages)."""
    if run.state.global_update == 0 or stage == 0:
        return True
    return run.trainer.cadence.checkpoint_now(run.state.global_update, stage_end=True, last=False, stages_done=stage)


def stage_overhead(parts: dict[str, float], seconds: float) -> dict[str, float]:
    """The stage boundary: ``seconds`` of the rollout phase less its sampling (``perf/rollout_sampling_s``),
    split into the measured parts and ``other``, the rest (prompt selection, advantages, progress bar).
    Rank 0's figures; other ranks have no sampling time of their own to subtract, and log nothing."""
    overhead = seconds - parts.get(ROLLOUT_SAMPLING_S, 0.0)
    measured = {k: v for k, v in parts.items() if k.startswith(STAGE_OVERHEAD_PREFIX)}
    return measured | {
        STAGE_OVERHEAD_OTHER: max(0.0, overhead - sum(measured.values())),
        STAGE_OVERHEAD: overhead,
    }


def plan_rollout(run: Run, stage: int, prompts: list[PromptRecord]) -> StorePlan:
    """What stage ``stage``'s store needs (collective); a store made by an older policy keeps its version."""
    identity = stage_identity(
        cfg=run.cfg.rollout,
        reward=reward_record(run.cfg.reward),
        prompts=prompts,
        stage=stage,
        policy_version=run.state.global_update,
        seed=run.cfg.stages.seed,
        vocab_size=int(run.origin.hf_config["vocab_size"]),
        engine_name=run.cfg.rollout.engine,
        routes=run.cfg.moe.routing_replay == "rollout",
        env=run.cfg.env,  # a store of multi-turn trajectories names its environment
    )
    return plan_stage(run.rollout_dir(stage), identity, run.hosts, keep_policy_version=True)


def stage_progress(run: Run, plan: StorePlan, stage: int) -> tqdm:
    """Rank 0's progress bar over the rows its own engine generates (a total only with one engine)."""
    rows = sum(len(plan.manifest.shard_range(i)) for i in plan.missing) * run.cfg.rollout.group_size
    total = rows if run.placement.num_engines == 1 else None
    return progress(total, f"stage {stage} rollout", enabled=run.is_writer and run.cfg.logging.progress_bars)


def optimizer_update(run: Run, data: StageData, stage: int, update: int) -> dict[str, float]:
    """One optimizer update on the ``update``-th seeded minibatch of B_mini groups of D_k (+ replayed groups)."""
    cfg = run.cfg
    started = time.perf_counter()
    crash_point(f"update_start:{run.state.global_update + 1}")
    advance(f"making update {run.state.global_update + 1}")
    groups = data.minibatch(update, cfg.stages.mini_groups, cfg.stages.seed)
    metrics, tokens = train_on_groups(run, groups)
    if update == 0:
        check_first_update(run, metrics, stage)
    run.state.update_in_stage, run.state.global_update = update + 1, run.state.global_update + 1
    run.state.data_cursor = (update + 1) * cfg.stages.mini_groups
    seconds = time.perf_counter() - started
    return metrics | {
        TRAIN_STAGE: float(stage),
        UPDATE_S: seconds,
        TRAIN_TOKENS_PER_S: tokens / max(seconds, 1e-9),
    }


def stage_reference(run: Run, store: RolloutStore) -> OldLogprobs | None:
    """Score D_k with the trainer before the stage's first update (training.stage_reference): logs
    rollout/mismatch_* when rollout.quantization is on, returns log π_old when a rollout correction is on
    (and stores it for HDR's drift when a quantized stage's groups may be replayed)."""
    cfg = run.cfg
    quantized = cfg.rollout.quantization != "none"
    old_logprobs, metrics = prepare_stage_reference(
        run.policy,
        store,
        correction=cfg.algo.rollout_correction,
        measure=quantized,
        first_update=run.state.update_in_stage == 0,
        settings=run.trainer.scoring,
        seed=cfg.stages.seed,
        write=run.is_writer,
        policy_version=run.state.global_update - run.state.update_in_stage,  # θ_old: the stage's start
        barrier=run.hosts.barrier,
        keep=quantized and run.trainer.replay is not None,
        for_loss=cfg.algo.needs_old_logprobs,  # icepop masks on π_old / β
    )
    if metrics:
        run.telemetry.logger.log(metrics, step=run.state.global_update)
    return old_logprobs


def store_summary(run: Run, store: RolloutStore, stage: int) -> dict[str, float]:
    """The stage's rollout metrics (from the store's manifest, so a resumed run reports the same)."""
    return stage_store_metrics(store.store_dir) | {STAGE: float(stage)} | timers(run)
