"""Headroom-Drift Replay in the staged loop: re-scoring through the trainer, mini-batch assembly, buffer I/O.

One HDR "step" is one stage k of the loop: its rollout batch D_k and the μ updates on it. With
``replay.enabled`` the loop calls, per stage:

* ``stage_data(run, k, store)`` (B, C): order the buffer (``replay.policy``: by headroom, or the
  naive most-recent order), re-score groups teacher-forced with the current policy through
  ``forward_logprobs`` (a collective no-grad pass; every rank gets the same log-probs, and rank 0's
  scores are broadcast so every rank takes the same decisions) and accept those that pass the drift
  gate. Logs ``replay/*`` (step = the stage's first update). Returns the stage's data source.
* ``StageData.minibatch(u, ...)`` (D): update u's B_mini fresh groups of D_k, preceded by its share
  of the accepted groups (``algorithms.replay.replay_slots``: none at update 0, where π_θ = β must
  hold exactly, then spread evenly over updates 1 … μ−1). A replayed group enters the batch exactly
  as stored: its generation-time log-probs are the ratio's denominator and its advantages are the
  ones computed when it was generated, so the registry loss (grpo, mu_grpo, m2po, ...) needs no change.
* ``end_stage(run, k, store)`` (E): D_k's mixed-outcome groups enter the FIFO.

The buffer and the stage's decision (so a run resumed mid-stage replays the same groups, although
the policy has moved since they were scored) are written into every checkpoint step directory by
``checkpoint_writer``, as ``replay/state.json`` plus ``replay/groups.parquet`` (the copied groups,
the rollout store's row format). A run killed and resumed equals an uninterrupted one.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow.parquet as pq
import torch.distributed as dist

from megatron_mugrpo import durable
from megatron_mugrpo.algorithms.replay import (
    GroupKey,
    GroupScore,
    ReplayBuffer,
    candidate_entries,
    group_headroom_drift,
    replay_policy,
    replay_slots,
    select_groups,
    selection_metrics,
)
from megatron_mugrpo.config import RunConfig
from megatron_mugrpo.records import RolloutGroup, collate
from megatron_mugrpo.rollout.shards import SCHEMA, groups_to_table, row_to_group
from megatron_mugrpo.rollout.store import RolloutStore
from megatron_mugrpo.training.checkpoint import CheckpointError
from megatron_mugrpo.training.stage_reference import OldLogprobs
from megatron_mugrpo.training.stage_reference import minibatch as fresh_minibatch

if TYPE_CHECKING:
    from megatron_mugrpo.runtime import Run

FORMAT = "megatron_mugrpo.replay/1"
REPLAY_DIR = "replay"
"""Sub-directory of a checkpoint step directory holding the buffer."""
STATE_FILE = "state.json"
GROUPS_FILE = "groups.parquet"
METRIC_PREFIX = "replay/"
CANDIDATE_READ_GROUPS = 1024
"""Groups of D_k read at a time when collecting candidates (bounds memory on large stages)."""


@dataclass(kw_only=True)
class StagePlan:
    """The replay decision of one stage, made once at its start."""

    stage: int
    accepted: list[GroupKey]
    """Buffered groups replayed this stage, highest priority first."""


@dataclass(kw_only=True)
class ReplayState:
    """What a run carries between stages (and through checkpoints)."""

    buffer: ReplayBuffer
    plan: StagePlan | None = None
    """The current stage's decision; None between stages."""
    stores: dict[int, RolloutStore] = field(default_factory=dict)
    """Opened earlier stores, for ``replay.cross_stage`` references (not saved)."""


@dataclass(kw_only=True)
class StageData:
    """The data of one stage's updates: fresh D_k plus the accepted replayed groups (none without replay)."""

    store: RolloutStore
    replayed: list[RolloutGroup]
    """Accepted groups, as stored (generation-time log-probs and advantages)."""
    updates: int
    """μ: the stage's updates, over which the replayed groups are spread."""

    def minibatch(
        self, update_index: int, mini_groups: int, seed: int, old_logprobs: OldLogprobs | None = None
    ) -> list[RolloutGroup]:
        """Update ``update_index``'s groups: its share of replayed groups first, then its fresh ones
        (``store.minibatch``, with log π_old attached when the rollout correction is on)."""
        share = replay_slots(len(self.replayed), self.updates)[update_index] if update_index < self.updates else []
        fresh = fresh_minibatch(self.store, update_index, mini_groups, seed, old_logprobs)
        return [self.replayed[i] for i in share] + fresh


# -------------------------------------------------------------------------------- per stage


def stage_data(run: Run, stage: int, store: RolloutStore) -> StageData:
    """B–C: the stage's replay decision (made now, or restored from the checkpoint); the data of its updates.

    Collective when it scores. Without replay: D_k alone.
    """
    state = run.replay
    if state is None:
        return StageData(store=store, replayed=[], updates=run.cfg.stages.updates_per_stage)
    if state.plan is None or state.plan.stage != stage:
        state.plan = plan_stage(run, state, stage)
    replayed = [resolve_group(run, state, key) for key in state.plan.accepted]
    return StageData(store=store, replayed=replayed, updates=run.cfg.stages.updates_per_stage)


def plan_stage(run: Run, state: ReplayState, stage: int) -> StagePlan:
    """Rank, re-score and gate the buffer with the current policy; log the replay/* metrics."""
    cfg, train_groups = run.cfg.replay, run.cfg.stages.train_groups
    policy = replay_policy(cfg.policy)
    # Only earlier stages: E pushes a stage's groups after its updates, so this matters only when
    # `mugrpo optimize` redoes a stage whose groups (or later ones) are already buffered.
    order = [key for key in policy.order(state.buffer) if key[0] < stage]
    started = time.perf_counter()
    selection = select_groups(
        order,
        k=cfg.groups_for(train_groups),
        max_scored=cfg.max_scored(train_groups),
        tau=cfg.tau,
        score=partial(_score_keys, run, state) if policy.gated else None,
    )
    state.buffer.update_scores(selection.scores)
    metrics = {
        METRIC_PREFIX + k: v for k, v in selection_metrics(selection, state.buffer, run.state.global_update).items()
    }
    metrics["perf/replay_select_s"] = time.perf_counter() - started
    # Logged at the stage's first update: a resume from an earlier checkpoint drops and redoes it with that update.
    run.logger.log(metrics, step=run.state.global_update + 1)
    return StagePlan(stage=stage, accepted=selection.accepted)


def end_stage(run: Run, stage: int, store: RolloutStore) -> None:
    """E: the stage's mixed-outcome groups enter the FIFO (after its updates: never replayed in their own stage)."""
    state = run.replay
    if state is None:
        return
    copy_groups = not run.cfg.replay.cross_stage
    for start in range(0, store.num_groups, CANDIDATE_READ_GROUPS):
        indices = range(start, min(start + CANDIDATE_READ_GROUPS, store.num_groups))
        entries = candidate_entries(zip(indices, store.groups(indices)), copy_groups=copy_groups)
        state.buffer.push(e for e in entries if e.key not in state.buffer)  # a stage redone by `mugrpo optimize`
    state.plan = None
    live = {buffered_stage for buffered_stage, _ in state.buffer}
    state.stores = {k: v for k, v in state.stores.items() if k in live}  # release stores with nothing left buffered


def resolve_group(run: Run, state: ReplayState, key: GroupKey) -> RolloutGroup:
    """A buffered group's record: its copy, or (``replay.cross_stage``) read from D_stage on disk."""
    entry = state.buffer.get(key)
    if entry.group is not None:
        return entry.group
    stage, index = key
    if stage not in state.stores:
        state.stores[stage] = RolloutStore.open(run.rollout_dir(stage))
    return state.stores[stage].groups([index])[0]


def score_groups(run: Run, groups: list[RolloutGroup]) -> tuple[list[float], list[float]]:
    """Teacher-forced headroom and drift of ``groups`` under the current policy (collective)."""
    from megatron_mugrpo.training.train_step import forward_logprobs

    cfg = run.cfg
    batch = collate(groups, pad_id=run.tokenizer.pad_token_id or 0)
    logprobs = forward_logprobs(
        run.policy,
        batch,
        temperature=cfg.rollout.temperature,
        micro_batch_size=cfg.parallel.micro_batch_size,
        impl=cfg.kernels.logprob_impl,
    )
    headroom, drift = group_headroom_drift(
        logprobs, batch.behaviour_logprobs, batch.advantages, batch.response_mask, batch.group_index, len(groups)
    )
    return headroom.tolist(), drift.tolist()


def _score_keys(run: Run, state: ReplayState, keys: list[GroupKey]) -> list[GroupScore]:
    headroom, drift = score_groups(run, [resolve_group(run, state, key) for key in keys])
    version = run.state.global_update
    scores = [GroupScore(headroom=h, drift=d, scored_at=version) for h, d in zip(headroom, drift)]
    # Every rank computed the same log-probs; rank 0's scores make the identical decisions certain.
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [scores]
        dist.broadcast_object_list(box, src=0)
        scores = box[0]
    return scores


# -------------------------------------------------------------------------------- persistence


def open_replay(cfg: RunConfig, step_dir: Path | None) -> ReplayState | None:
    """The run's replay state: None when replay is off, restored from ``step_dir`` when it has one, else empty."""
    if not cfg.replay.enabled:
        return None
    capacity = cfg.replay.capacity_groups(cfg.stages.train_groups)
    if step_dir is not None and (step_dir / REPLAY_DIR).is_dir():
        return load_replay(step_dir / REPLAY_DIR, capacity)
    return ReplayState(buffer=ReplayBuffer(capacity))


def checkpoint_writer(run: Run) -> Callable[[Path], None] | None:
    """What ``save_checkpoint`` calls (rank 0) to put the buffer into the step directory before it is published."""
    if run.replay is None:
        return None
    return partial(save_replay, run.replay)


def save_replay(state: ReplayState, step_dir: Path) -> None:
    """Write ``step_dir/replay/``: state.json (entries, scores, the stage's decision) and the copied groups."""
    out = step_dir / REPLAY_DIR
    out.mkdir(parents=True, exist_ok=True)
    copies = [e.group for e in state.buffer.entries() if e.group is not None]
    groups_checksum = None
    if copies:  # durable before state.json, which names it
        with durable.atomic_path(out / GROUPS_FILE) as tmp:
            pq.write_table(groups_to_table(copies), tmp)
        groups_checksum = asdict(durable.Checksum.of_file(out / GROUPS_FILE))
    plan = (
        None if state.plan is None else {"stage": state.plan.stage, "accepted": [list(k) for k in state.plan.accepted]}
    )
    record = {"format": FORMAT, "buffer": state.buffer.state_dict(), "plan": plan, "groups_checksum": groups_checksum}
    durable.atomic_write_json(out / STATE_FILE, record, indent=None)


def load_replay(replay_dir: Path, capacity: int) -> ReplayState:
    """Inverse of ``save_replay``; CheckpointError when the files are missing, altered or of another format."""
    record = _read_state(replay_dir)
    copies: list[RolloutGroup] = []
    checksum = _groups_checksum(record)
    if checksum is not None:
        path = replay_dir / GROUPS_FILE
        try:
            checksum.verify_file(path, "replay copies")
        except (OSError, durable.ChecksumError) as exc:
            raise CheckpointError(
                f"{path} is missing or does not match its checksum in {STATE_FILE} ({exc}); the checkpoint's "
                "replay buffer is corrupted: resume from an older checkpoint"
            ) from exc
        copies = [row_to_group(row) for row in pq.read_table(path, schema=SCHEMA).to_pylist()]
    buffer = ReplayBuffer.from_state_dict(record["buffer"], copies, capacity=capacity)
    plan = record["plan"]
    return ReplayState(
        buffer=buffer,
        plan=None if plan is None else StagePlan(stage=plan["stage"], accepted=[tuple(k) for k in plan["accepted"]]),
    )


def _groups_checksum(record: dict[str, Any]) -> durable.Checksum | None:
    """The copies' checksum in state.json (``groups_sha256``, a bare hex digest, in earlier checkpoints)."""
    if record.get("groups_checksum") is not None:
        return durable.Checksum.from_json(record["groups_checksum"])
    if record.get("groups_sha256") is not None:
        return durable.Checksum("sha256", record["groups_sha256"])
    return None


def _read_state(replay_dir: Path) -> dict[str, Any]:
    path = replay_dir / STATE_FILE
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(
            f"{path} is missing or unreadable ({exc}): the checkpoint's replay buffer is incomplete; "
            "resume from an older checkpoint"
        ) from exc
    if record.get("format") != FORMAT:
        raise CheckpointError(f"{path}: format {record.get('format')!r} is not {FORMAT!r}")
    return record
