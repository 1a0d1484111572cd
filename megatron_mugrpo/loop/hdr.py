"""Headroom-Drift Replay in the staged loop: re-scoring through the trainer, the stage's decision, buffer I/O.

One HDR "step" is one stage k of the loop: its rollout batch D_k and the μ updates on it. With
``replay.enabled`` the loop calls, per stage:

* ``replayed_groups(run, k)`` (B, C): order the buffer (``replay.policy``: by headroom, or the naive
  most-recent order), re-score groups teacher-forced with the current policy through
  ``stage_reference.teacher_forced_logprobs`` (the stage reference's scoring: a collective no-grad
  pass with the run's ``ScoreSettings``; every rank gets the same log-probs, and rank 0's scores are
  broadcast over ``run.hosts`` so every rank takes the same decisions) and accept those that pass
  the drift gate. Logs ``replay/*`` (step = the stage's first update). Returns the accepted groups,
  which ``loop.data.StageData`` spreads over the stage's updates (D); the registry loss (grpo,
  mu_grpo, m2po, ...) needs no change.
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
from typing import TYPE_CHECKING, Any, Protocol

import pyarrow.parquet as pq

from megatron_mugrpo import durable
from megatron_mugrpo.algorithms.replay import (
    GroupKey,
    GroupScore,
    ReplayBuffer,
    candidate_entries,
    group_headroom_drift,
    replay_policy,
    select_groups,
    selection_metrics,
)
from megatron_mugrpo.records import RolloutGroup, collate
from megatron_mugrpo.rollout.shards import SCHEMA, groups_to_table, row_to_group
from megatron_mugrpo.rollout.store import RolloutStore
from megatron_mugrpo.training.checkpoint import CheckpointError
from megatron_mugrpo.training.stage_reference import ScoreSettings, teacher_forced_logprobs

if TYPE_CHECKING:
    from megatron_mugrpo.algorithms.replay import ReplayConfig
    from megatron_mugrpo.metrics import MetricsLogger
    from megatron_mugrpo.rollout.placement import HostGroup
    from megatron_mugrpo.state import TrainerState
    from megatron_mugrpo.training.setup import Policy

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
    """What a run carries between stages (and through checkpoints), with the settings it runs by."""

    config: ReplayConfig
    """The run's ``replay`` section."""
    train_groups: int
    """B_train (stages.train_groups): K_rep, the scoring budget and the capacity are sized by it."""
    buffer: ReplayBuffer
    plan: StagePlan | None = None
    """The current stage's decision; None between stages."""
    stores: dict[int, RolloutStore] = field(default_factory=dict)
    """Opened earlier stores, for ``replay.cross_stage`` references (not saved)."""


class ReplayRun(Protocol):
    """What HDR uses of a run (``loop.setup.Run`` has all of it; tests pass a namespace)."""

    replay: ReplayState | None
    state: TrainerState
    policy: Policy
    scoring: ScoreSettings
    hosts: HostGroup
    logger: MetricsLogger

    def rollout_dir(self, stage: int) -> Path: ...


# -------------------------------------------------------------------------------- per stage


def replayed_groups(run: ReplayRun, stage: int) -> list[RolloutGroup]:
    """B–C: the groups the stage replays, by its decision (made now, or restored from the checkpoint).

    Collective when it scores. Without replay: none.
    """
    state = run.replay
    if state is None:
        return []
    if state.plan is None or state.plan.stage != stage:
        state.plan = plan_stage(run, state, stage)
    return [resolve_group(run, state, key) for key in state.plan.accepted]


def plan_stage(run: ReplayRun, state: ReplayState, stage: int) -> StagePlan:
    """Rank, re-score and gate the buffer with the current policy; log the replay/* metrics."""
    cfg, train_groups = state.config, state.train_groups
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


def end_stage(run: ReplayRun, stage: int, store: RolloutStore) -> None:
    """E: the stage's mixed-outcome groups enter the FIFO (after its updates: never replayed in their own stage)."""
    state = run.replay
    if state is None:
        return
    copy_groups = not state.config.cross_stage
    for start in range(0, store.num_groups, CANDIDATE_READ_GROUPS):
        indices = range(start, min(start + CANDIDATE_READ_GROUPS, store.num_groups))
        entries = candidate_entries(zip(indices, store.groups(indices)), copy_groups=copy_groups)
        state.buffer.push(e for e in entries if e.key not in state.buffer)  # a stage redone by `mugrpo optimize`
    state.plan = None
    live = {buffered_stage for buffered_stage, _ in state.buffer}
    state.stores = {k: v for k, v in state.stores.items() if k in live}  # release stores with nothing left buffered


def resolve_group(run: ReplayRun, state: ReplayState, key: GroupKey) -> RolloutGroup:
    """A buffered group's record: its copy, or (``replay.cross_stage``) read from D_stage on disk."""
    entry = state.buffer.get(key)
    if entry.group is not None:
        return entry.group
    stage, index = key
    if stage not in state.stores:
        state.stores[stage] = RolloutStore.open(run.rollout_dir(stage))
    return state.stores[stage].groups([index])[0]


def score_headroom_drift(run: ReplayRun, groups: list[RolloutGroup]) -> tuple[list[float], list[float]]:
    """Teacher-forced headroom and drift of ``groups`` under the current policy (collective)."""
    batch = collate(groups, pad_id=run.scoring.pad_id)
    logprobs = teacher_forced_logprobs(run.policy, batch, run.scoring)
    headroom, drift = group_headroom_drift(
        logprobs, batch.behaviour_logprobs, batch.advantages, batch.response_mask, batch.group_index, len(groups)
    )
    return headroom.tolist(), drift.tolist()


def _score_keys(run: ReplayRun, state: ReplayState, keys: list[GroupKey]) -> list[GroupScore]:
    headroom, drift = score_headroom_drift(run, [resolve_group(run, state, key) for key in keys])
    version = run.state.global_update
    scores = [GroupScore(headroom=h, drift=d, scored_at=version) for h, d in zip(headroom, drift)]
    # Every rank computed the same log-probs; rank 0's scores make the identical decisions certain.
    return run.hosts.broadcast(scores)


# -------------------------------------------------------------------------------- persistence


def open_replay(config: ReplayConfig, train_groups: int, step_dir: Path | None) -> ReplayState | None:
    """The run's replay state: None when replay is off, restored from ``step_dir`` when it has one, else empty."""
    if not config.enabled:
        return None
    capacity = config.capacity_groups(train_groups)
    buffer, plan = ReplayBuffer(capacity), None
    if step_dir is not None and (step_dir / REPLAY_DIR).is_dir():
        buffer, plan = load_replay(step_dir / REPLAY_DIR, capacity)
    return ReplayState(config=config, train_groups=train_groups, buffer=buffer, plan=plan)


def checkpoint_writer(state: ReplayState | None) -> Callable[[Path], None] | None:
    """What ``save_checkpoint`` calls (rank 0) to put the buffer into the step directory before it is published."""
    if state is None:
        return None
    return partial(save_replay, state)


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


def load_replay(replay_dir: Path, capacity: int) -> tuple[ReplayBuffer, StagePlan | None]:
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
    if plan is None:
        return buffer, None
    return buffer, StagePlan(stage=plan["stage"], accepted=[tuple(k) for k in plan["accepted"]])


def _groups_checksum(record: dict[str, Any]) -> durable.Checksum | None:
    """The copies' checksum in state.json (None: the buffer held no copies)."""
    if record.get("groups_checksum") is not None:
        return durable.Checksum.from_json(record["groups_checksum"])
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
