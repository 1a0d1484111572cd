"""Arrow shards of prompt groups: the one file format of the rollout store, the async rollout queue and
the replay buffer's copies; and the per-shard log π_old files that sit next to a store's shards.

A shard is an uncompressed Arrow IPC file with one row per prompt group (``SCHEMA``). ``write_shard``
writes it durably (temporary name, fsync, rename, fsync of the directory) and returns its checksum, so
the caller's record, written afterwards, never names a shard that a crash could lose.
``map_shard`` maps one back read-only: the table points into the page cache and rows become
``RolloutGroup`` objects only through ``row_to_group``.

Behaviour log-probs are stored as float32 (the precision the trainer uses; engines produce float32),
token ids as int32, rewards and advantages as float64.

A log-prob shard (``LOGPROB_SCHEMA``, ``write_logprob_shard`` / ``map_logprob_shard``) holds one row per
group of the rollout shard it belongs to: [response][token] float32 log-probs (the stage reference's
log π_old). The replay buffer's copies may carry them too (``groups_to_table(..., old_logprobs=True)``).

Multi-turn trajectories (``env.enabled``) add three columns (``TRAJECTORY_FIELDS``, ``shard_schema``):
every response's policy mask (int8, 1 where the policy sampled the token), its turns as flat
[start, end, start, end, ...] int32 offsets, and its environment calls' seconds (float64). A shard holds
them for all its responses or for none; they sit inside the shard file, under its checksum.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa

from megatron_mugrpo import durable
from megatron_mugrpo.errors import InputError
from megatron_mugrpo.records import RolloutGroup, RolloutSample
from megatron_mugrpo.rollout.engine import FINISH_REASONS

SCHEMA = pa.schema(
    [
        ("prompt_id", pa.string()),
        ("prompt_ids", pa.list_(pa.int32())),
        ("answer", pa.string()),
        ("stage", pa.int32()),
        ("policy_version", pa.int64()),
        ("response_ids", pa.list_(pa.list_(pa.int32()))),
        ("behaviour_logprobs", pa.list_(pa.list_(pa.float32()))),
        ("reward", pa.list_(pa.float64())),
        ("reward_reason", pa.list_(pa.string())),
        ("advantage", pa.list_(pa.float64())),
        ("finish_reason", pa.list_(pa.string())),
    ]
)

OLD_LOGPROBS_FIELD = pa.field("old_logprobs", pa.list_(pa.list_(pa.float32())))
SCHEMA_WITH_OLD = SCHEMA.append(OLD_LOGPROBS_FIELD)
"""A shard of groups that also carry log π_old (the replay buffer's copies of a quantized stage)."""
LOGPROB_SCHEMA = pa.schema([OLD_LOGPROBS_FIELD])
"""One row per group: its responses' log-probs, [response][token]."""
TRAJECTORY_FIELDS = (
    pa.field("policy_mask", pa.list_(pa.list_(pa.int8()))),
    pa.field("turns", pa.list_(pa.list_(pa.int32()))),
    pa.field("env_seconds", pa.list_(pa.list_(pa.float64()))),
)
"""[response][token] policy mask, [response][2·turn] turn offsets, [response][call] environment seconds."""


def shard_schema(*, trajectories: bool = False, old_logprobs: bool = False) -> pa.Schema:
    """The columns of a shard: SCHEMA, plus log π_old (the replay buffer's copies), plus the trajectory
    columns (multi-turn rollouts)."""
    schema = SCHEMA_WITH_OLD if old_logprobs else SCHEMA
    for extra in TRAJECTORY_FIELDS if trajectories else ():
        schema = schema.append(extra)
    return schema


def holds_trajectories(groups: Sequence[RolloutGroup]) -> bool:
    """Whether the groups' responses are multi-turn trajectories; StoreError when only some are."""
    flags = [s.policy_mask is not None for g in groups for s in g.samples]
    if any(flags) and not all(flags):
        raise StoreError(
            f"{flags.count(False)} of {len(flags)} responses are single-turn among multi-turn trajectories; a "
            "shard holds trajectories for every response or for none"
        )
    return bool(flags) and all(flags)


_SAMPLE_COLUMNS = (
    ("response_ids", "response_ids"),
    ("behaviour_logprobs", "behaviour_logprobs"),
    ("reward", "reward"),
    ("reward_reason", "reward_reason"),
    ("advantage", "advantage"),
    ("finish_reason", "finish_reason"),
)


class StoreError(InputError, RuntimeError):
    """Rollout data on disk (store, queue, shard) is invalid, incomplete or corrupted, or refuses
    invalid data.

    The message says how to fix it."""


def groups_to_table(groups: Sequence[RolloutGroup], *, old_logprobs: bool = False) -> pa.Table:
    """One Arrow row per group (see SCHEMA); with ``old_logprobs`` also their log π_old (SCHEMA_WITH_OLD,
    null for a group whose responses carry none); multi-turn trajectories also get their columns
    (``TRAJECTORY_FIELDS``)."""
    trajectories = holds_trajectories(groups)
    schema = shard_schema(trajectories=trajectories, old_logprobs=old_logprobs)
    columns: dict[str, list[Any]] = {name: [] for name in schema.names}
    for g in groups:
        columns["prompt_id"].append(g.prompt_id)
        columns["prompt_ids"].append(g.prompt_ids)
        columns["answer"].append(g.answer)
        columns["stage"].append(g.stage)
        columns["policy_version"].append(g.policy_version)
        for name, attr in _SAMPLE_COLUMNS:
            columns[name].append([getattr(s, attr) for s in g.samples])
        if old_logprobs:
            carried = all(s.old_logprobs is not None for s in g.samples)
            columns["old_logprobs"].append([s.old_logprobs for s in g.samples] if carried else None)
        if trajectories:
            columns["policy_mask"].append([s.policy_mask for s in g.samples])
            columns["turns"].append([[o for turn in s.turns or [] for o in turn] for s in g.samples])
            columns["env_seconds"].append([s.env_seconds or [] for s in g.samples])
    return pa.Table.from_pydict(columns, schema=schema)


def row_to_group(row: dict[str, Any]) -> RolloutGroup:
    """Inverse of one row of ``groups_to_table``."""
    responses = len(row["response_ids"])
    old = row.get("old_logprobs") or [None] * responses
    samples = [
        RolloutSample(
            response_ids=ids,
            behaviour_logprobs=lps,
            finish_reason=finish,
            reward=reward,
            reward_reason=reason,
            advantage=adv,
            old_logprobs=old_lps,
            **trajectory,
        )
        for ids, lps, reward, reason, adv, finish, old_lps, trajectory in zip(
            *(row[name] for name, _ in _SAMPLE_COLUMNS), old, _trajectory_fields(row, responses)
        )
    ]
    return RolloutGroup(
        prompt_id=row["prompt_id"],
        prompt_ids=row["prompt_ids"],
        answer=row["answer"],
        samples=samples,
        stage=row["stage"],
        policy_version=row["policy_version"],
    )


def _trajectory_fields(row: dict[str, Any], responses: int) -> list[dict[str, Any]]:
    """Each response's policy mask, turns and environment seconds (empty dicts for single-turn rows)."""
    if "policy_mask" not in row:
        return [{}] * responses
    return [
        {"policy_mask": mask, "turns": list(zip(offsets[::2], offsets[1::2])), "env_seconds": seconds}
        for mask, offsets, seconds in zip(row["policy_mask"], row["turns"], row["env_seconds"])
    ]


def write_table(path: Path, table: pa.Table) -> durable.Checksum:
    """Write ``table`` as the Arrow IPC file ``path``, durably; returns the file's checksum.

    Only complete, fsynced bytes ever appear under ``path``; a crash leaves at most ``path.tmp``."""
    with (
        durable.atomic_path(path) as tmp,
        pa.OSFile(str(tmp), "wb") as sink,
        pa.ipc.new_file(sink, table.schema) as ipc,
    ):
        ipc.write_table(table)
    return durable.Checksum.of_file(path)


def write_shard(path: Path, groups: Sequence[RolloutGroup]) -> durable.Checksum:
    """Write ``groups`` as the Arrow shard ``path``, durably; returns the file's checksum."""
    return write_table(path, groups_to_table(groups))


def write_logprob_shard(path: Path, per_group: Sequence[Sequence[Sequence[float]]]) -> durable.Checksum:
    """Write one rollout shard's log-probs ([group][response][token]) as ``path``, durably; returns its checksum."""
    return write_table(path, pa.Table.from_pydict({"old_logprobs": list(per_group)}, schema=LOGPROB_SCHEMA))


def map_logprob_shard(path: Path, *, groups: int, checksum: durable.Checksum | None = None) -> pa.Table:
    """A log-prob shard's table, memory-mapped (as ``map_shard``)."""
    return map_shard(path, groups=groups, checksum=checksum, schema=LOGPROB_SCHEMA)


def map_shard(
    path: Path, *, groups: int, checksum: durable.Checksum | None = None, schema: pa.Schema = SCHEMA
) -> pa.Table:
    """The shard's table backed by a read-only memory map (no copy: pages load when rows are read).

    StoreError when the file is missing, not Arrow, of another schema than ``schema``, holds other than
    ``groups`` rows, or (when ``checksum`` is given) does not match it."""
    if not path.is_file():
        raise StoreError(f"shard {path} is missing although its record exists")
    if checksum is not None:
        try:
            checksum.verify_file(path, "shard")
        except durable.ChecksumError as exc:
            raise StoreError(str(exc)) from exc
    try:
        reader = pa.ipc.open_file(pa.memory_map(str(path), "r"))
        if not reader.schema.equals(schema):
            raise StoreError(f"{path} has columns {reader.schema.names}, not the expected {schema.names}")
        table = reader.read_all()
    except pa.ArrowInvalid as exc:
        raise StoreError(f"{path} is not a readable Arrow file ({exc})") from exc
    if table.num_rows != groups:
        raise StoreError(f"shard {path} holds {table.num_rows} groups, its record {groups}")
    return table


# Validation, before anything is written: a row the trainer must not see never reaches a shard.


def validate_group(group: RolloutGroup, vocab_size: int) -> None:
    """Raise StoreError when a group holds data the trainer must not see.

    Checks: at least one response; prompt and response ids in [0, vocab_size); one finite log-prob
    <= 0 per response token; non-empty responses; finite reward and advantage; a known finish reason.
    """
    where = f"prompt {group.prompt_id!r}"
    if not group.samples:
        raise StoreError(f"{where} has no responses; every stored group needs at least one")
    _check_ids(group.prompt_ids, vocab_size, f"{where}: prompt")
    for j, sample in enumerate(group.samples):
        _validate_sample(sample, vocab_size, f"{where} response {j}")


def _validate_sample(sample: RolloutSample, vocab_size: int, where: str) -> None:
    if not sample.response_ids:
        raise StoreError(f"{where} is empty; the engine must return at least one token (EOS included)")
    if len(sample.response_ids) != len(sample.behaviour_logprobs):
        raise StoreError(
            f"{where}: {len(sample.response_ids)} tokens but {len(sample.behaviour_logprobs)} behaviour log-probs"
        )
    _check_ids(sample.response_ids, vocab_size, where)
    bad = [(t, lp) for t, lp in enumerate(sample.behaviour_logprobs) if not (math.isfinite(lp) and lp <= 0.0)]
    if bad:
        raise StoreError(
            f"{where}: behaviour log-probs (position, value) {bad[:3]} are not finite numbers <= 0; "
            "the engine's log-probs are broken (check dtype/temperature), nothing was written"
        )
    if not (math.isfinite(sample.reward) and math.isfinite(sample.advantage)):
        raise StoreError(f"{where}: reward {sample.reward} / advantage {sample.advantage} must be finite")
    if sample.finish_reason not in FINISH_REASONS:
        raise StoreError(f"{where}: finish_reason {sample.finish_reason!r} is not one of {FINISH_REASONS}")
    if sample.policy_mask is not None and not (sample.policy_mask[0] == 1 == sample.policy_mask[-1]):
        raise StoreError(f"{where}: a trajectory starts and ends with a policy turn (policy_mask 1)")


def _check_ids(ids: Sequence[int], vocab_size: int, where: str) -> None:
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise StoreError(
            f"{where} holds token ids {bad[:5]} outside the vocabulary [0, {vocab_size}); "
            "the engine and the trainer disagree on the tokenizer/vocab size"
        )
