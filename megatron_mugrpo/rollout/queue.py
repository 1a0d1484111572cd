"""The rollout queue of async mode: append-only, checksummed shards from the rollout workers, read by
the trainer in arrival order through a cursor that the checkpoints carry.

Layout of the queue directory (``RUN_DIR/rollouts/queue``)::

    w000_b0000012.arrow    batch 12 of worker 0: its prompt groups, one row each (the rollout store's
                           shard format, ``shards.shard_schema``, as an Arrow IPC file: with env.enabled
                           the trajectory columns, policy mask, turns and environment seconds; with
                           async.partial_rollout one more column, every token's policy version:
                           VERSIONS_FIELD)
    w000_b0000012.routes.arrow   only under moe.routing_replay=rollout: every response's routes, the
                           rollout store's routes format (``rollout.routes.write_routes``: one row per
                           group, the engine's dtype), checksummed in the record
    w000_b0000012.json     the shard's record, written last: checksum, groups, behaviour policy version,
                           summable statistics, the worker's idle / weight-load / generation seconds, and
                           with env.enabled the batch's environment counts (``envs.episodes.EnvTally``)
    cursor.json            the trainer's progress: groups consumed so far (the workers' queue bound)

A worker validates a batch with the rollout store's checks (routes included: all responses carry them
or none, each [prompt + response - 1, moe_layers, k]), writes the shard (and its routes) and then its record,
each under a temporary name, fsynced and renamed into place (``durable``): a shard exists for readers
exactly when its record does, also after a power loss. A worker killed mid-write leaves temporaries
or a shard without a record; when it restarts it deletes them and continues at its next batch index,
so nothing half-written is ever read. Workers pause while ``written − consumed`` groups reach ``async.queue_groups``,
and before a batch whose groups would be too old when the trainer reaches them (``paused_s``).

A group's policy version is its oldest token's (with partial rollouts a response may span several
publications; ``RolloutSample.versions`` holds each token's). The trainer's drops and the lag figures
use it; ``token_lags`` measures the lag of every token.

The trainer (``QueueReader``, trainer rank 0) admits recorded shards in the order their records
appeared (the record's modification time, then its name) and appends their names to the cursor;
``position`` counts the groups of that sequence consumed so far, each one either trained on or
dropped because its policy was more than ``max_lag`` updates old when its turn came (``scan``). The
cursor is saved with every checkpoint (``TrainerState.queue``): a resumed trainer consumes again
exactly the groups whose updates were lost, never one twice and never one less.

    reader = QueueReader(queue_dir, cursor=QueueCursor.from_dict(state.queue))
    reader.admit()                                   # shards that arrived, in arrival order
    taken = reader.take(update=u, count=B_mini, max_lag=4)   # None: not enough fresh groups yet
"""

from __future__ import annotations

import copy
import dataclasses
import os
import re
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from megatron_mugrpo import durable
from megatron_mugrpo.faults import crash_point
from megatron_mugrpo.records import RolloutGroup
from megatron_mugrpo.rollout.manifest import shard_stats
from megatron_mugrpo.rollout.routes import RoutesInfo, group_routes, routes_schema, shard_routes, write_routes
from megatron_mugrpo.rollout.shards import (
    StoreError,
    groups_to_table,
    holds_trajectories,
    map_shard,
    row_to_group,
    shard_schema,
    validate_group,
    write_table,
)

FORMAT = "megatron_mugrpo.rollout_queue/1"
CURSOR_FILE = "cursor.json"
SHARD_SUFFIX, RECORD_SUFFIX = ".arrow", ".json"
ROUTES_SUFFIX = ".routes.arrow"
_NAME = re.compile(r"^w(\d{3,})_b(\d{7,})$")
VERSIONS_FIELD = pa.field("token_versions", pa.list_(pa.list_(pa.int64())))
"""Every token's policy version, [response][token] (async.partial_rollout)."""


def queue_schema(*, trajectories: bool, token_versions: bool) -> pa.Schema:
    """The columns of a queue shard: the rollout store's (``shards.shard_schema``: the trajectory columns
    with env.enabled), then every token's policy version with async.partial_rollout."""
    schema = shard_schema(trajectories=trajectories)
    return schema.append(VERSIONS_FIELD) if token_versions else schema


def shard_name(worker: int, batch: int) -> str:
    """File stem of worker ``worker``'s batch ``batch``."""
    return f"w{worker:03d}_b{batch:07d}"


@dataclass(kw_only=True)
class ShardRecord:
    """One queued shard, as its record file describes it."""

    name: str
    worker: int
    batch: int
    groups: int
    responses: int
    checksum: durable.Checksum
    """Of the shard file (records written before checksums named their algorithm hold ``sha256``)."""
    policy_version: int
    """Trainer updates behind the weights that generated the shard's oldest token (without partial
    rollouts: every token of the shard)."""
    stats: dict[str, float] = field(default_factory=dict)
    """Summable statistics of the groups (``rollout.manifest.shard_stats``)."""
    idle_s: float = 0.0
    """Seconds the worker waited before this batch (queue full, no weights yet, or ``paused_s``)."""
    paused_s: float = 0.0
    """Of those, seconds it paused because the batch's groups would have been dropped for their lag
    (``asynchronous.batches.lag_pause``); 0: no such pause."""
    load_s: float = 0.0
    """Seconds it spent loading newly published weights before this batch."""
    generate_s: float = 0.0
    """Seconds it spent sampling and scoring this batch."""
    publication: str = ""
    """Name of the weight publication the worker sampled with (``asynchronous.publish``)."""
    weights_digest: str = ""
    """``publish.weights_digest`` of the weights the worker had loaded (async.verify_weights), else ''."""
    token_versions: bool = False
    """The shard stores every token's policy version (VERSIONS_FIELD; async.partial_rollout)."""
    trajectories: bool = False
    """The shard's responses are multi-turn trajectories (env.enabled): it has the trajectory columns
    (``shards.TRAJECTORY_FIELDS``)."""
    env: dict[str, float] | None = None
    """With env.enabled, the batch's environment counts (``envs.episodes.EnvTally.counts``: trajectories,
    turns, tool calls, environment seconds, failed trajectories, tokens by writer, and as ``sampling_s`` the
    batch's ``generate_s``: decoding, environment calls and scoring),
    which the trainer turns into the ``rollout/`` env metrics of the update that admits the shard."""
    routes: RoutesInfo | None = None
    """The shard's routes file (``ROUTES_SUFFIX``), when the engine recorded routes (moe.routing_replay=rollout)."""
    format: str = FORMAT

    def to_json(self) -> dict[str, Any]:
        """The record; without ``routes`` / ``trajectories`` / ``env`` keys when there are none (records of
        dense single-turn runs are unchanged)."""
        data = dataclasses.asdict(self)
        for key, default in (("routes", None), ("trajectories", False), ("env", None)):
            if data[key] == default:
                del data[key]
        return data


@dataclass(kw_only=True)
class QueueCursor:
    """How far the trainer has consumed the queue; saved in checkpoints (``TrainerState.queue``)."""

    shards: list[str] = field(default_factory=list)
    """Admitted shard names in admission (arrival) order."""
    position: int = 0
    """Groups of that sequence consumed so far: trained on, or dropped for their lag."""
    dropped: int = 0
    """Of those, how many were dropped."""
    paused: int = 0
    """Admitted shards whose worker paused before generating them, lest they be dropped for their lag."""
    window: dict[str, float] = field(default_factory=dict)
    """Summed ``shard_stats`` of the groups trained on since the last stage end (its rollout summary)."""

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> QueueCursor:
        """Inverse of ``to_dict``."""
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        """The JSON value a checkpoint keeps (``TrainerState.queue``); a deep copy."""
        return dataclasses.asdict(self)


@dataclass(kw_only=True)
class Taken:
    """One update's groups and what assembling them consumed."""

    groups: list[RolloutGroup]
    versions: list[int]
    """Each group's behaviour policy version."""
    lags: list[int]
    """Updates between each group's behaviour policy (its oldest token's) and the policy being updated (>= 0)."""
    dropped: int
    """Groups dropped as too old while assembling this update."""
    token_lag_mean: float = 0.0
    """Mean over the response tokens of the update of their lag (``token_lags``)."""
    token_lag_max: int = 0
    """Largest token lag of the update."""


def group_lag(update: int, policy_version: int) -> int:
    """Updates between the behaviour policy (published after ``policy_version`` updates) and the policy
    about to make update ``update + 1``.

    A group can be *newer* than the trainer after a resume: a worker sampled it with weights published
    after the checkpoint the trainer restarted from. Its behaviour log-probs are exact, so it is a valid
    off-policy sample; its lag counts as 0.
    """
    return max(update - policy_version, 0)


def token_lags(group: RolloutGroup, update: int) -> list[int]:
    """The lag (``group_lag``) of every response token of ``group`` for update ``update + 1``: each token's
    own version where the samples carry them (partial rollouts), else the group's."""
    lags = []
    for sample in group.samples:
        versions = sample.versions or [group.policy_version] * len(sample.response_ids)
        lags.extend(group_lag(update, version) for version in versions)
    return lags


def scan(versions: Sequence[int], *, update: int, need: int, max_lag: int) -> tuple[list[int], list[int]]:
    """Walk queued groups (their policy versions, in arrival order) for update ``update + 1``.

    A group whose lag exceeds ``max_lag`` is dropped, any other is taken, until ``need`` are taken.
    Returns (taken, dropped) index lists; together they are exactly the scanned prefix.
    """
    taken: list[int] = []
    dropped: list[int] = []
    for index, version in enumerate(versions):
        if len(taken) == need:
            break
        (dropped if group_lag(update, version) > max_lag else taken).append(index)
    return taken, dropped


# ---------------------------------------------------------------------------------------------------
# Records on disk
# ---------------------------------------------------------------------------------------------------


class RecordIndex:
    """The queue's shard records, read once each (records never change after they are written)."""

    def __init__(self, queue_dir: Path):
        self.queue_dir = queue_dir
        self.records: dict[str, ShardRecord] = {}
        self._arrival: dict[str, tuple[int, str]] = {}

    def refresh(self) -> list[ShardRecord]:
        """Read the records that appeared since the last call; returns them in arrival order."""
        new = []
        with os.scandir(self.queue_dir) as entries:
            for entry in entries:
                stem, suffix = os.path.splitext(entry.name)
                if suffix != RECORD_SUFFIX or stem in self.records or not _NAME.match(stem):
                    continue
                values = durable.read_json(entry.path)
                if values is None:  # deleted between the listing and the read: a restarted worker's leftover
                    continue
                self.records[stem] = _record(values, Path(entry.path))
                self._arrival[stem] = (entry.stat().st_mtime_ns, stem)
                new.append(stem)
        return [self.records[name] for name in sorted(new, key=self._arrival.__getitem__)]

    @property
    def total_groups(self) -> int:
        return sum(record.groups for record in self.records.values())


def _record(values: dict[str, Any], path: Path) -> ShardRecord:
    if values.get("format") != FORMAT:
        raise StoreError(f"{path}: format {values.get('format')!r} is not {FORMAT!r}; not a rollout queue record")
    checksum, rest = durable.Checksum.split_record(values)
    routes = rest.pop("routes", None)
    return ShardRecord(**rest, checksum=checksum, routes=RoutesInfo.from_json(routes) if routes is not None else None)


def read_shard(queue_dir: Path, record: ShardRecord) -> list[RolloutGroup]:
    """The groups of a recorded shard, after checking its checksum."""
    path = queue_dir / (record.name + SHARD_SUFFIX)
    schema = queue_schema(trajectories=record.trajectories, token_versions=record.token_versions)
    try:
        table = map_shard(path, groups=record.groups, checksum=record.checksum, schema=schema)
    except StoreError as exc:
        raise StoreError(f"rollout queue: {exc}; the queue directory was modified or damaged") from exc
    groups = []
    for row in table.to_pylist():
        group = row_to_group(row)
        for sample, versions in zip(group.samples, row.get(VERSIONS_FIELD.name) or []):
            sample.versions = versions
        groups.append(group)
    if record.routes is not None:
        _attach_routes(queue_dir, record, groups)
    return groups


def _attach_routes(queue_dir: Path, record: ShardRecord, groups: list[RolloutGroup]) -> None:
    """Give every response of ``groups`` (the shard's, in order) its routes from the shard's routes file,
    after checking its checksum and that each response's routes fit its tokens; StoreError otherwise."""
    info = record.routes
    assert info is not None
    path = queue_dir / (record.name + ROUTES_SUFFIX)
    schema = routes_schema(info.dtype, info.moe_layers * info.topk)
    try:
        table = map_shard(path, groups=record.groups, checksum=info.checksum, schema=schema)
        for row, group in enumerate(groups):
            routes = group_routes(table, row, info)
            if len(routes) != len(group.samples):
                raise StoreError(f"{path} row {row} holds routes of {len(routes)} responses, not {len(group.samples)}")
            for sample, sample_routes in zip(group.samples, routes):
                sample.routes = np.array(sample_routes)  # owned: the trainer ranks receive the groups pickled
        shard_routes(groups, where=str(path))  # each response's rows against its prompt + response tokens
    except StoreError as exc:
        raise StoreError(f"rollout queue: {exc}; the queue directory was modified or damaged") from exc


def _write_queue_shard(path: Path, groups: Sequence[RolloutGroup], *, token_versions: bool) -> durable.Checksum:
    """The groups as the rollout store writes a shard (``shards.groups_to_table``: trajectory columns
    included), plus the tokens' versions when ``token_versions`` (``queue_schema``), as durably."""
    table = groups_to_table(groups)
    if token_versions:
        versions = pa.array([[s.versions for s in g.samples] for g in groups], type=VERSIONS_FIELD.type)
        table = table.append_column(VERSIONS_FIELD, versions)
    return write_table(path, table)


def consumed_groups(queue_dir: Path) -> int:
    """Groups the trainer has consumed (its cursor.json; 0 before it wrote one)."""
    return trainer_progress(queue_dir)[0]


def trainer_progress(queue_dir: Path) -> tuple[int, int]:
    """(groups consumed, updates made) as the trainer last published them (cursor.json; zeros before)."""
    values = durable.read_json(queue_dir / CURSOR_FILE)
    return (int(values["position"]), int(values.get("global_update", 0))) if values else (0, 0)


# ---------------------------------------------------------------------------------------------------
# Worker side
# ---------------------------------------------------------------------------------------------------


class QueueWriter:
    """Appends one worker's batches to the queue."""

    def __init__(self, queue_dir: Path, *, worker: int, vocab_size: int):
        self.queue_dir, self.worker, self.vocab_size = queue_dir, worker, vocab_size
        queue_dir.mkdir(parents=True, exist_ok=True)
        self.index = RecordIndex(queue_dir)
        self.appended = 0
        """Shards this writer (this process) has written."""

    def resume_batch(self) -> int:
        """Delete this worker's half-written leftovers; return the first batch index it has not recorded."""
        prefix = f"w{self.worker:03d}_b"
        self.index.refresh()
        done = [r.batch for r in self.index.records.values() if r.worker == self.worker]
        for path in self.queue_dir.glob(prefix + "*"):
            stem = path.name.split(".")[0]
            if path.name.endswith(durable.TMP_SUFFIX) or stem not in self.index.records:
                path.unlink(missing_ok=True)
        return max(done, default=-1) + 1

    def unconsumed(self) -> int:
        """Groups written by every worker and not yet consumed by the trainer."""
        return self.backlog()[0]

    def backlog(self) -> tuple[int, int]:
        """(groups written by every worker and not yet consumed, updates the trainer has made)."""
        self.index.refresh()
        consumed, update = trainer_progress(self.queue_dir)
        return self.index.total_groups - consumed, update

    def append(self, batch: int, groups: Sequence[RolloutGroup], **record: Any) -> ShardRecord:
        """Validate and write one batch (shard, then record); ``record`` fills ShardRecord's timing fields."""
        if not groups:
            raise StoreError(f"worker {self.worker} batch {batch}: a queue shard needs at least one group")
        for group in groups:
            validate_group(group, self.vocab_size)
        tagged = _check_token_versions(groups, f"worker {self.worker} batch {batch}")
        try:
            trajectories = holds_trajectories(groups)
        except StoreError as exc:
            raise StoreError(f"worker {self.worker} batch {batch}: {exc}") from exc
        versions = {g.policy_version for g in groups}
        if len(versions) != 1 and not tagged:
            raise StoreError(f"worker {self.worker} batch {batch} mixes policy versions {sorted(versions)}")
        routes = shard_routes(groups, where=f"worker {self.worker} batch {batch}")  # checked before writing
        name = shard_name(self.worker, batch)
        path = self.queue_dir / (name + SHARD_SUFFIX)
        checksum = _write_queue_shard(path, groups, token_versions=tagged)
        routes_info = write_routes(self.queue_dir / (name + ROUTES_SUFFIX), routes) if routes else None
        info = ShardRecord(
            name=name,
            worker=self.worker,
            batch=batch,
            groups=len(groups),
            responses=sum(len(g.samples) for g in groups),
            checksum=checksum,
            policy_version=min(versions),
            stats=shard_stats(groups),
            token_versions=tagged,
            trajectories=trajectories,
            routes=routes_info,
            **record,
        )
        self.appended += 1
        crash_point(f"worker:{self.worker}:shard:{self.appended}")  # shard in place, record not yet
        durable.atomic_write_json(self.queue_dir / (name + RECORD_SUFFIX), info.to_json(), sort_keys=True)
        return info


def _check_token_versions(groups: Sequence[RolloutGroup], where: str) -> bool:
    """Whether the groups carry per-token versions (all of them or none), each group's version being its
    oldest token's; StoreError otherwise."""
    tagged = [s.versions is not None for g in groups for s in g.samples]
    if not any(tagged):
        return False
    if not all(tagged):
        raise StoreError(f"{where}: {tagged.count(False)} responses carry no token versions, the others do")
    for group in groups:
        oldest = min((v for s in group.samples for v in s.versions), default=group.policy_version)
        if oldest != group.policy_version:
            raise StoreError(
                f"{where}: group {group.prompt_id} has policy version {group.policy_version} but its oldest "
                f"token was sampled by version {oldest}"
            )
    return True


# ---------------------------------------------------------------------------------------------------
# Trainer side
# ---------------------------------------------------------------------------------------------------


@dataclass
class _Queued:
    group: RolloutGroup
    shard: ShardRecord


class QueueReader:
    """The trainer's view of the queue: admitted groups not yet consumed, and the cursor."""

    def __init__(self, queue_dir: Path, cursor: QueueCursor | None = None):
        self.queue_dir = queue_dir
        queue_dir.mkdir(parents=True, exist_ok=True)
        self.cursor = copy.deepcopy(cursor) if cursor is not None else QueueCursor()
        self.index = RecordIndex(queue_dir)
        self._buffer: deque[_Queued] = deque()
        self._pending: list[tuple[_Queued, int]] = []
        self._token_lags: list[int] = []  # of the groups in _pending
        self._dropped_now = 0
        self._arrived: list[ShardRecord] = []  # recorded, not yet admitted
        self._published = -1  # the position last written to cursor.json
        self._restore()

    def _restore(self) -> None:
        """Re-read the admitted shards that still hold unconsumed groups (after a resume)."""
        admitted = set(self.cursor.shards)
        self._arrived = [record for record in self.index.refresh() if record.name not in admitted]
        skip = self.cursor.position
        for name in self.cursor.shards:
            record = self.index.records.get(name)
            if record is None:
                raise StoreError(
                    f"the checkpoint's queue cursor admitted shard {name}, but {self.queue_dir} has no record of it; "
                    "the queue directory was modified or belongs to another run"
                )
            if skip >= record.groups:
                skip -= record.groups
                continue
            groups = read_shard(self.queue_dir, record)
            self._buffer.extend(_Queued(g, record) for g in groups[skip:])
            skip = 0
        if skip:
            raise StoreError(f"the queue cursor's position {self.cursor.position} lies beyond its admitted shards")

    def admit(self) -> list[ShardRecord]:
        """Append newly recorded shards, in arrival order, to the cursor and the unconsumed groups."""
        new, self._arrived = self._arrived + self.index.refresh(), []
        for record in new:
            self._buffer.extend(_Queued(g, record) for g in read_shard(self.queue_dir, record))
            self.cursor.shards.append(record.name)
            self.cursor.paused += record.paused_s > 0
        return new

    def take(self, *, update: int, count: int, max_lag: int) -> Taken | None:
        """Consume groups in arrival order until ``count`` fresh ones are held for update ``update + 1``.

        Groups too old are dropped as they are reached. What has been scanned stays consumed when fewer
        than ``count`` are available (None is returned, call again after ``admit``): the update's
        groups are assembled across calls, and the workers see the room freed at once.
        """
        versions = [queued.group.policy_version for queued in self._buffer]
        taken, dropped = scan(versions, update=update, need=count - len(self._pending), max_lag=max_lag)
        scanned = len(taken) + len(dropped)
        chosen = set(taken)
        for index in range(scanned):
            queued = self._buffer.popleft()
            if index in chosen:
                self._pending.append((queued, group_lag(update, queued.group.policy_version)))
                self._token_lags.extend(token_lags(queued.group, update))
        self.cursor.position += scanned
        self.cursor.dropped += len(dropped)
        self._dropped_now += len(dropped)
        if len(self._pending) < count:
            return None
        lags = self._token_lags or [0]
        result = Taken(
            groups=[queued.group for queued, _ in self._pending],
            versions=[queued.group.policy_version for queued, _ in self._pending],
            lags=[lag for _, lag in self._pending],
            dropped=self._dropped_now,
            token_lag_mean=sum(lags) / len(lags),
            token_lag_max=max(lags),
        )
        self._pending, self._dropped_now, self._token_lags = [], 0, []
        return result

    @property
    def unconsumed(self) -> int:
        """Admitted groups not yet consumed."""
        return len(self._buffer)

    def publish_cursor(self, global_update: int) -> None:
        """Tell the workers how far the trainer has consumed (their queue bound reads it); a no-op when
        nothing was consumed since the last call (the trainer calls it at every look at the queue)."""
        if self.cursor.position == self._published:
            return
        cursor = {"position": self.cursor.position, "global_update": global_update}
        durable.atomic_write_json(self.queue_dir / CURSOR_FILE, cursor, sort_keys=True)
        self._published = self.cursor.position
