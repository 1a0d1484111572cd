"""The trainer's loop in async mode, ``train_async``: the twin of ``loop.staged.train``, and as short.

    publish π → evaluate → per update: take B_mini fresh groups from the rollout queue (waiting for
    them is the trainer's idle time) → one optimizer update → publish every async.sync_every updates
    → log → at stage ends: rollout summary, evaluation, checkpoint (the queue cursor with it)

The run makes ``stages.num_stages × μ`` updates; a "stage" is only the evaluation and checkpoint
period here, since nothing is generated in bulk. Rank 0 reports its progress in its heartbeat (every
update, publication, evaluation step and look at the queue while it waits: ``liveness.advance``), so
the workers tell a hung trainer from a busy one. The mechanics live in ``Feed`` (the trainer's end
of the queue, the weight publications and the heartbeats) and in the modules it uses.

    mugrpo train --config configs/demo_async_cpu.yaml ...   under torchrun, on the trainer ranks
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from megatron_mugrpo.asynchronous.config import AsyncConfig, partial_rollout_problem
from megatron_mugrpo.asynchronous.files import AsyncPaths
from megatron_mugrpo.asynchronous.liveness import Peer, RankFailedError, advance, own_nonce
from megatron_mugrpo.asynchronous.publish import Publication, publication_digests, publish_policy, send_policy
from megatron_mugrpo.asynchronous.roles import ProcessRole
from megatron_mugrpo.asynchronous.transport import Sender, host_group
from megatron_mugrpo.envs.episodes import env_metrics
from megatron_mugrpo.errors import ConfigError
from megatron_mugrpo.evaluation import AVG_KEY
from megatron_mugrpo.faults import crash_point
from megatron_mugrpo.loop import preemption
from megatron_mugrpo.loop.actions import (
    check_first_update,
    evaluate_and_checkpoint,
    progress_range,
    run_evaluation,
    stop_if_preempted,
    summary,
    train_on_groups,
)
from megatron_mugrpo.loop.export import export_final
from megatron_mugrpo.loop.run import Run
from megatron_mugrpo.metric_names import (
    DROPPED_GROUPS,
    DROPPED_GROUPS_TOTAL,
    LAG_MAX,
    LAG_MEAN,
    PAUSED_BATCHES,
    PAUSED_BATCHES_TOTAL,
    QUEUE_BACKLOG,
    QUEUE_POSITION,
    ROLLOUT_IDLE_RATIO,
    SAMPLE_WAIT_S,
    STAGE,
    T_OPTIMIZE,
    T_ROLLOUT,
    TOKEN_LAG_MAX,
    TOKEN_LAG_MEAN,
    TRAINER_IDLE_RATIO,
    WEIGHT_SYNC_MIB,
    WEIGHT_SYNC_S,
)
from megatron_mugrpo.rollout.manifest import shard_stats, store_metrics
from megatron_mugrpo.rollout.placement import HostGroup
from megatron_mugrpo.rollout.queue import QueueCursor, QueueReader, ShardRecord, Taken
from megatron_mugrpo.rollout.shards import StoreError

POLL_S = 0.02
"""Seconds between two looks at the queue while the trainer waits for groups."""


def train_async(run: Run, role: ProcessRole) -> dict[str, float]:
    """Run (or continue) an async run on this trainer rank; returns the end-of-run summary."""
    cfg, state = run.cfg, run.state
    feed = Feed.open(run, role)  # rank 0: the queue reader, the workers' heartbeats
    feed.publish(run)  # the workers' first policy (or, resumed, the checkpoint's)
    if state.global_update == 0 and state.acc_before is None:
        advance("evaluating the initial policy")
        state.acc_before = run_evaluation(run).get(AVG_KEY, float("nan"))
    # Resumed: its checkpoint is there. At update 0 the base model is the checkpoint: a resume without one
    # starts from the same state, and an optimizer that made no step has no state a checkpoint could load.
    saved_at = state.global_update
    for _ in progress_range(run, run.state.global_update, cfg.stages.total_updates, "async updates"):
        advance(f"assembling update {run.state.global_update + 1}")
        started = time.perf_counter()
        with run.telemetry.timer(T_ROLLOUT):  # idle: waiting for and assembling samples
            taken = feed.next_groups(run)
        if taken is None:  # signalled while waiting for groups: stop at this boundary, not after the next update
            stop_if_preempted(run, checkpointed=saved_at == run.state.global_update)
            raise RuntimeError("the trainer was told of a preemption that no trainer rank agreed on")
        with run.telemetry.timer(T_OPTIMIZE):
            advance(f"making update {run.state.global_update + 1}")
            metrics = async_update(run, taken)
            if run.state.global_update % cfg.async_.sync_every == 0:
                metrics |= feed.publish(run)
        run.telemetry.logger.log(metrics | feed.update_metrics(taken, started), step=run.state.global_update)
        crash_point(f"update:{run.state.global_update}")
        saved = end_of_update(run, feed)  # stage end: rollout summary, evaluation; checkpoint when due
        saved_at = run.state.global_update if saved else saved_at
        stop_if_preempted(run, checkpointed=saved)  # SIGTERM / SIGUSR1: checkpoint now, exit
    feed.close()  # the workers' receivers stop waiting for publications
    export_final(run)
    return summary(run) | feed.summary()


def async_update(run: Run, taken: Taken) -> dict[str, float]:
    """One optimizer update on the groups taken from the queue; the state's cursor advances with it."""
    metrics, _ = train_on_groups(run, taken.groups)
    state, mu = run.state, run.cfg.stages.updates_per_stage
    if all(v == state.global_update for v in taken.versions) and str(state.stage) not in state.first_update_gap:
        check_first_update(run, metrics, state.stage)  # fresh weights: π_θ = β, ratios must be 1
    state.global_update += 1
    state.stage, state.update_in_stage = divmod(state.global_update, mu)
    state.data_cursor = state.update_in_stage * run.cfg.stages.mini_groups
    return metrics


def end_of_update(run: Run, feed: Feed) -> bool:
    """At a stage end, the stage's rollout summary; then evaluation and checkpoint when ``run.trainer.cadence``
    says. Returns whether it checkpointed."""
    done = run.state.global_update
    run.trainer.checkpoints.poll()  # publish a background checkpoint once every rank has written it
    stage_end, last = run.state.update_in_stage == 0, done == run.cfg.stages.total_updates
    if stage_end:
        run.telemetry.logger.log(feed.stage_summary(run.state.stage - 1), step=done)
    run.state.queue = feed.cursor()  # a copy: a background save must not see the cursor move on
    advance(f"evaluating or checkpointing after update {done}")
    return evaluate_and_checkpoint(run, stage_end=stage_end, last=last)


@dataclass
class Feed:
    """The trainer's end of async mode. Rank 0 reads the queue and watches the workers' heartbeats
    (its own heartbeat is the CLI's, from start-up); every trainer rank publishes (collectively) and
    receives the groups."""

    paths: AsyncPaths
    is_writer: bool
    hosts: HostGroup
    """The trainer ranks' group: rank 0 sends every update's groups over it."""
    reader: QueueReader | None = None
    workers: list[Peer] = field(default_factory=list)
    max_lag: int = 0
    verify_weights: bool = False
    memory: bool = False
    """async.publish=memory."""
    digests: dict[str, str] = field(default_factory=dict)
    """Publication name → digest, to check what workers report they loaded (async.verify_weights)."""
    admitted: list[ShardRecord] = field(default_factory=list)
    """Shards admitted during the current update (their workers' idle time is logged with it)."""
    wait_s: float = 0.0
    sync_s: float = 0.0
    sender: Sender | None = None
    """Memory publication (async.publish=memory, rank 0): the trainer's end of the publication group."""
    published: int = 0
    """Publications made by this launch (its first always goes to disk: workers build engines from it)."""

    @classmethod
    def open(cls, run: Run, role: ProcessRole) -> Feed:
        cfg = run.cfg.async_
        problem = partial_rollout_problem(cfg, run.cfg.rollout.engine)
        if problem:  # the workers refuse it too; the trainer stops with the same message, not waiting for them
            raise ConfigError(problem)
        feed = cls(paths=AsyncPaths(run.run_dir), is_writer=run.is_writer, hosts=run.hosts, max_lag=cfg.max_lag)
        feed.verify_weights = cfg.verify_weights
        if run.is_writer:
            feed.paths.make()
            feed.workers = [
                Peer(
                    feed.paths.worker_heartbeat(i),
                    _worker_name(role, i),
                    timeout_s=cfg.worker_timeout_s,
                    startup_s=cfg.startup_timeout_s,
                    progress_timeout_s=cfg.progress_timeout_s,
                    launch=own_nonce(),  # a worker record echoing it was written after this launch began
                )
                for i in range(role.num_workers)
            ]
            saved = run.state.queue
            feed.reader = QueueReader(feed.paths.queue, QueueCursor.from_dict(saved) if saved is not None else None)
            feed.reader.publish_cursor(run.state.global_update)  # the workers' queue bound, as of this checkpoint
            feed.digests = publication_digests(feed.paths.weights)
            if cfg.publish == "memory":  # the store listens now; the group forms at the first memory publication
                feed.sender = _sender(feed.paths, role, cfg)
        feed.memory = cfg.publish == "memory"
        return feed

    # ------------------------------------------------------------------------------ weights

    def publish(self, run: Run) -> dict[str, float]:
        """Publish the current policy for the workers (collective over the trainer ranks): to disk the
        first time in a launch and with async.publish=disk, else broadcast from memory. The time is
        what the trainer is blocked: export and send (memory) or export and write (disk)."""
        started = time.perf_counter()
        version = run.state.global_update
        advance(f"publishing its weights after {version} updates")
        metrics = {}
        if self.memory and self.published > 0:
            sent = send_policy(
                run, self.sender, self.paths.weights, version=version, digest=self.verify_weights, watch=self._watch
            )
            if sent is not None:
                publication, stats = sent
                metrics[WEIGHT_SYNC_MIB] = stats.nbytes / 2**20
        else:
            publication = publish_policy(run, self.paths.weights, version=version, digest=self.verify_weights)
        if isinstance(publication, Publication):
            self.digests[publication.name] = publication.digest
        self.published += 1
        self.sync_s = time.perf_counter() - started
        return metrics | {WEIGHT_SYNC_S: self.sync_s}

    def _watch(self) -> None:
        for peer in self.workers:
            peer.check()

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()

    # ------------------------------------------------------------------------------ groups

    def next_groups(self, run: Run) -> Taken | None:
        """The next update's B_mini groups: assembled on rank 0 (waiting as needed), sent to every trainer rank.
        None: rank 0 was signalled to stop (``loop.preemption``) while it waited; nothing was taken."""
        started = time.perf_counter()
        payload: Taken | str | None
        if self.is_writer:
            try:
                payload = self._assemble(run.state.global_update, run.cfg.stages.mini_groups)
            except RankFailedError as exc:
                self.hosts.broadcast(str(exc))  # the other trainer ranks stop with the same message
                raise
        payload = self.hosts.broadcast(payload if self.is_writer else None)
        if isinstance(payload, str):
            raise RankFailedError(payload)
        self.wait_s = time.perf_counter() - started
        return payload

    def _assemble(self, update: int, count: int) -> Taken | None:
        reader = self.reader
        while True:
            self.admitted += self._checked(reader.admit())
            taken = reader.take(update=update, count=count, max_lag=self.max_lag)
            reader.publish_cursor(update)  # room freed by what was consumed, even before the update is made
            if taken is not None:
                return taken
            if preemption.requested() is not None:  # the groups may never come (a dead worker): stop now
                return None
            advance(f"waiting for groups for update {update + 1}")  # a look at the workers: progress
            for peer in self.workers:
                peer.check()
                if peer.done:
                    raise RankFailedError(f"{peer.name} exited while the trainer still needs groups")
            time.sleep(POLL_S)

    def _checked(self, records: list[ShardRecord]) -> list[ShardRecord]:
        """Records whose reported weights match the trainer's publication (when both were hashed)."""
        for record in records:
            published = self.digests.get(record.publication, "")
            if record.weights_digest and published and record.weights_digest != published:
                raise StoreError(
                    f"rollout worker {record.worker} sampled batch {record.batch} with weights that differ from "
                    f"publication {record.publication}: the weight pick-up is broken"
                )
        return records

    def cursor(self) -> dict[str, Any] | None:
        """A copy of the consumer cursor as of the last update, as a checkpoint keeps it (rank 0; None elsewhere)."""
        return self.reader.cursor.to_dict() if self.reader is not None else None

    # ------------------------------------------------------------------------------ metrics

    def update_metrics(self, taken: Taken, started: float) -> dict[str, float]:
        """Lag, drops, queue and idle figures of the update that just ended (rank 0 has them all); with
        env.enabled the env metrics (``envs.episodes.ENV_METRICS``) of the shards it admitted, like the
        workers' idle figures."""
        total = time.perf_counter() - started
        metrics = {
            TRAINER_IDLE_RATIO: self.wait_s / total if total > 0 else 0.0,
            SAMPLE_WAIT_S: self.wait_s,
            LAG_MEAN: sum(taken.lags) / len(taken.lags),
            LAG_MAX: float(max(taken.lags)),
            TOKEN_LAG_MEAN: taken.token_lag_mean,
            TOKEN_LAG_MAX: float(taken.token_lag_max),
            DROPPED_GROUPS: float(taken.dropped),
        }
        if self.reader is None:
            return metrics
        cursor = self.reader.cursor
        metrics |= {
            DROPPED_GROUPS_TOTAL: float(cursor.dropped),
            PAUSED_BATCHES_TOTAL: float(cursor.paused),
            QUEUE_POSITION: float(cursor.position),
            QUEUE_BACKLOG: float(self.reader.index.total_groups - cursor.position),
        }
        cursor.window = _summed(cursor.window, shard_stats(taken.groups))
        metrics[PAUSED_BATCHES] = float(sum(r.paused_s > 0 for r in self.admitted))
        if self.admitted:
            busy = sum(r.generate_s + r.load_s for r in self.admitted)
            idle = sum(r.idle_s for r in self.admitted)
            metrics[ROLLOUT_IDLE_RATIO] = idle / (idle + busy) if idle + busy > 0 else 0.0
            metrics |= env_metrics([r.env for r in self.admitted if r.env is not None])
            self.admitted = []
        return metrics

    def stage_summary(self, stage: int) -> dict[str, float]:
        """rollout/* of the groups trained on during ``stage`` (then the window restarts)."""
        if self.reader is None:
            return {}
        cursor = self.reader.cursor
        # store_metrics sums the ``stats`` of a manifest's shards; the window is one such sum.
        metrics = store_metrics(_Summed([_Stats(cursor.window)])) | {STAGE: float(stage)}
        cursor.window = {}
        return metrics

    def summary(self) -> dict[str, float]:
        """End-of-run queue figures: groups consumed, dropped, and left unconsumed in the queue."""
        if self.reader is None:
            return {}
        cursor = self.reader.cursor
        return {
            "consumed_groups": float(cursor.position),
            "dropped_groups": float(cursor.dropped),
            "paused_batches": float(cursor.paused),
            "left_in_queue": float(self.reader.index.total_groups - cursor.position),
        }


@dataclass
class _Stats:
    stats: dict[str, float]


@dataclass
class _Summed:
    shards: list[_Stats]


def _summed(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    return {key: a.get(key, 0.0) + b.get(key, 0.0) for key in a.keys() | b.keys()}


def _sender(paths: AsyncPaths, role: ProcessRole, cfg: AsyncConfig) -> Sender:
    """Rank 0's end of memory publication: the group's store up now, the weights' bytes over NCCL from
    this rank's GPU when it has one, else over gloo."""
    import torch

    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    group = host_group(
        paths.weights,
        world_size=1 + role.num_workers,
        timeout_s=cfg.publish_timeout_s,
        data_backend="nccl" if device.type == "cuda" else "gloo",
    )
    return Sender(group, bucket_bytes=max(1, int(cfg.bucket_mib * 2**20)), device=device)


def _worker_name(role: ProcessRole, index: int) -> str:
    return f"rollout worker {index} (rank {role.trainer_world + index})"
