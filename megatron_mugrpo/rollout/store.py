"""The on-disk rollout dataset D_k of one stage: Parquet shards, a checksummed manifest, a seeded reader.

Layout of a store directory::

    manifest.json          format, stage, policy version, engine, sampling params, counts,
                           per-shard file name + sha256 + group/response counts + summary sums,
                           and the ``complete`` flag
    shard_00000.parquet    one row per prompt group (RolloutGroup), ``shard_groups`` rows per shard
    shard_00001.parquet    ...

Writing is shard by shard: each shard is validated, written under a temporary name and renamed,
then the manifest is rewritten atomically (temporary file + rename). ``complete`` becomes true only
after the last shard. A crash leaves a manifest listing exactly the finished shards, so
``RolloutStoreWriter.create_or_resume`` continues at ``next_shard_index`` without regenerating them,
and ``RolloutStore.open`` refuses a store that is not complete.

Reading verifies every shard's sha256. ``RolloutStore.minibatch(update_index, mini_groups, seed)``
returns the groups of one optimizer update from a seeded permutation of the stage's groups: random
access by update index, no iterator state, so a resumed run sees exactly the same data.

Behaviour log-probs are stored as float32 (the precision the trainer uses; engines produce float32),
token ids as int32, rewards and advantages as float64.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from megatron_mugrpo.errors import InputError
from megatron_mugrpo.records import RolloutGroup, RolloutSample

FORMAT = "megatron_mugrpo.rollout_store/1"
MANIFEST = "manifest.json"
SHARD_PATTERN = "shard_{:05d}.parquet"
FINISH_REASONS = ("stop", "length")
_HASH_CHUNK_BYTES = 1 << 20

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


class StoreError(InputError, RuntimeError):
    """The rollout store is invalid, incomplete or corrupted, or refuses invalid data.

    The message says how to fix it."""


@dataclass(kw_only=True)
class ShardInfo:
    """One finished shard as recorded in the manifest."""

    file: str
    sha256: str
    groups: int
    responses: int
    stats: dict[str, float] = field(default_factory=dict)
    """Summable statistics of the shard (see ``shard_stats``), so metrics never need a re-read."""


@dataclass(kw_only=True)
class StoreManifest:
    """Contents of manifest.json."""

    stage: int
    policy_version: int
    engine: str
    sampling: dict[str, Any]
    """Sampling parameters of the stage (temperature, max_new_tokens, seed, allocation, ...)."""
    num_groups: int
    """Prompt groups the complete store holds (B_train)."""
    shard_groups: int
    vocab_size: int
    prompts_sha256: str = ""
    """Fingerprint of the stage's prompts (see ``prompts_fingerprint``), so a resume with other
    prompts is refused instead of mixing two datasets."""
    shards: list[ShardInfo] = field(default_factory=list)
    complete: bool = False
    format: str = FORMAT

    @property
    def num_shards(self) -> int:
        return math.ceil(self.num_groups / self.shard_groups)

    @property
    def num_responses(self) -> int:
        return sum(s.responses for s in self.shards)

    def shard_range(self, index: int) -> range:
        """Indices (into the stage's prompt list) of the groups that shard ``index`` holds."""
        start = index * self.shard_groups
        return range(start, min(start + self.shard_groups, self.num_groups))

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["num_prompts"] = self.num_groups
        data["num_responses"] = self.num_responses
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any], where: Path) -> StoreManifest:
        if data.get("format") != FORMAT:
            raise StoreError(
                f"{where}: format {data.get('format')!r} is not {FORMAT!r}; delete the directory to regenerate"
            )
        fields = {k: v for k, v in data.items() if k not in ("num_prompts", "num_responses", "shards")}
        return cls(**fields, shards=[ShardInfo(**s) for s in data["shards"]])


# ---------------------------------------------------------------------------------------------------
# Validation (before anything is written)
# ---------------------------------------------------------------------------------------------------


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


def _check_ids(ids: Sequence[int], vocab_size: int, where: str) -> None:
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise StoreError(
            f"{where} holds token ids {bad[:5]} outside the vocabulary [0, {vocab_size}); "
            "the engine and the trainer disagree on the tokenizer/vocab size"
        )


def shard_stats(groups: Sequence[RolloutGroup]) -> dict[str, float]:
    """Summable statistics of some groups: sums and counts, combined across shards by addition."""
    samples = [s for g in groups for s in g.samples]
    stats = {
        "groups": float(len(groups)),
        "responses": float(len(samples)),
        "reward_sum": sum(s.reward for s in samples),
        "response_tokens": float(sum(len(s.response_ids) for s in samples)),
        "finish_length": float(sum(s.finish_reason == "length" for s in samples)),
        "solve_all": float(sum(1 for g in groups if all(r >= 1.0 for r in g.rewards))),
        "solve_none": float(sum(1 for g in groups if all(r <= 0.0 for r in g.rewards))),
    }
    for sample in samples:
        key = f"reason_{sample.reward_reason or 'unknown'}"
        stats[key] = stats.get(key, 0.0) + 1.0
    return stats


# ---------------------------------------------------------------------------------------------------
# Row conversion
# ---------------------------------------------------------------------------------------------------


def groups_to_table(groups: Sequence[RolloutGroup]) -> pa.Table:
    """One Arrow row per group (see SCHEMA)."""
    columns: dict[str, list[Any]] = {name: [] for name in SCHEMA.names}
    for g in groups:
        columns["prompt_id"].append(g.prompt_id)
        columns["prompt_ids"].append(g.prompt_ids)
        columns["answer"].append(g.answer)
        columns["stage"].append(g.stage)
        columns["policy_version"].append(g.policy_version)
        for name, attr in _SAMPLE_COLUMNS:
            columns[name].append([getattr(s, attr) for s in g.samples])
    return pa.Table.from_pydict(columns, schema=SCHEMA)


_SAMPLE_COLUMNS = (
    ("response_ids", "response_ids"),
    ("behaviour_logprobs", "behaviour_logprobs"),
    ("reward", "reward"),
    ("reward_reason", "reward_reason"),
    ("advantage", "advantage"),
    ("finish_reason", "finish_reason"),
)


def row_to_group(row: dict[str, Any]) -> RolloutGroup:
    """Inverse of one row of ``groups_to_table``."""
    samples = [
        RolloutSample(
            response_ids=ids,
            behaviour_logprobs=lps,
            finish_reason=finish,
            reward=reward,
            reward_reason=reason,
            advantage=adv,
        )
        for ids, lps, reward, reason, adv, finish in zip(*(row[name] for name, _ in _SAMPLE_COLUMNS))
    ]
    return RolloutGroup(
        prompt_id=row["prompt_id"],
        prompt_ids=row["prompt_ids"],
        answer=row["answer"],
        samples=samples,
        stage=row["stage"],
        policy_version=row["policy_version"],
    )


# ---------------------------------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------------------------------


def prompts_fingerprint(prompts: Iterable[tuple[str, Sequence[int], str]]) -> str:
    """sha256 over (prompt id, prompt token ids, reference answer) of every prompt, in order."""
    digest = hashlib.sha256()
    for prompt_id, prompt_ids, answer in prompts:
        digest.update(json.dumps([prompt_id, list(prompt_ids), answer]).encode())
    return digest.hexdigest()


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def _write_atomic_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_manifest(store_dir: str | Path) -> StoreManifest | None:
    """The store's manifest, or None when the directory has none yet."""
    path = Path(store_dir) / MANIFEST
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise StoreError(f"{path} is not valid JSON ({exc}); delete {store_dir} to regenerate the stage") from exc
    return StoreManifest.from_json(data, path)


def is_complete(store_dir: str | Path) -> bool:
    """True when the store's manifest says every shard was written (checksums are checked on open)."""
    manifest = read_manifest(store_dir)
    return manifest is not None and manifest.complete


def _shard_problem(store_dir: Path, info: ShardInfo) -> str:
    """'' when the shard file exists with the recorded checksum, else what is wrong."""
    path = store_dir / info.file
    if not path.is_file():
        return f"shard {path} is missing"
    if file_sha256(path) != info.sha256:
        return f"shard {path} does not match its sha256 in {MANIFEST} (corrupted or modified)"
    return ""


# ---------------------------------------------------------------------------------------------------
# Writer
# ---------------------------------------------------------------------------------------------------


class RolloutStoreWriter:
    """Writes one stage's store shard by shard; resumes an interrupted store with the same identity."""

    def __init__(self, store_dir: Path, manifest: StoreManifest):
        self.store_dir, self.manifest = store_dir, manifest

    @classmethod
    def create_or_resume(
        cls,
        store_dir: str | Path,
        *,
        stage: int,
        policy_version: int,
        engine: str,
        sampling: dict[str, Any],
        num_groups: int,
        shard_groups: int,
        vocab_size: int,
        prompts_sha256: str = "",
    ) -> RolloutStoreWriter:
        """Open ``store_dir`` for writing.

        An existing manifest must describe the same stage (same stage, policy version, engine,
        sampling, counts); its shards are re-verified and the first missing or corrupted one, and
        everything after it, will be rewritten. A different identity is an error: delete the
        directory to regenerate.
        """
        if num_groups < 1 or shard_groups < 1 or vocab_size < 1:
            raise StoreError(
                f"num_groups={num_groups}, shard_groups={shard_groups}, vocab_size={vocab_size} must be >= 1"
            )
        store_dir = Path(store_dir)
        store_dir.mkdir(parents=True, exist_ok=True)
        wanted = StoreManifest(
            stage=stage,
            policy_version=policy_version,
            engine=engine,
            sampling=json.loads(json.dumps(sampling)),
            num_groups=num_groups,
            shard_groups=shard_groups,
            vocab_size=vocab_size,
            prompts_sha256=prompts_sha256,
        )
        existing = read_manifest(store_dir)
        if existing is None:
            writer = cls(store_dir, wanted)
            writer._save_manifest()
            return writer
        _check_same_identity(existing, wanted, store_dir)
        writer = cls(store_dir, existing)
        writer._drop_bad_shards()
        return writer

    @property
    def next_shard_index(self) -> int:
        """The first shard not yet written (== num_shards when all are)."""
        return len(self.manifest.shards)

    @property
    def num_shards(self) -> int:
        return self.manifest.num_shards

    def write_shard(self, index: int, groups: Sequence[RolloutGroup]) -> ShardInfo:
        """Validate and write shard ``index`` (must be ``next_shard_index``), then update the manifest."""
        if index != self.next_shard_index:
            raise StoreError(
                f"shard {index} written out of order; the next shard of {self.store_dir} is {self.next_shard_index}"
            )
        expected = len(self.manifest.shard_range(index))
        if len(groups) != expected:
            raise StoreError(f"shard {index} of {self.store_dir} needs {expected} groups, got {len(groups)}")
        for group in groups:
            validate_group(group, self.manifest.vocab_size)
            if (group.stage, group.policy_version) != (self.manifest.stage, self.manifest.policy_version):
                raise StoreError(
                    f"prompt {group.prompt_id!r} was generated at stage {group.stage} / policy version "
                    f"{group.policy_version}, but {self.store_dir} holds stage {self.manifest.stage} / "
                    f"policy version {self.manifest.policy_version}"
                )
        name = SHARD_PATTERN.format(index)
        path = self.store_dir / name
        tmp = path.with_name(name + ".tmp")
        pq.write_table(groups_to_table(groups), tmp)
        os.replace(tmp, path)
        info = ShardInfo(
            file=name,
            sha256=file_sha256(path),
            groups=len(groups),
            responses=sum(len(g.samples) for g in groups),
            stats=shard_stats(groups),
        )
        self.manifest.shards.append(info)
        self.manifest.complete = self.next_shard_index == self.num_shards
        self._save_manifest()
        return info

    def _drop_bad_shards(self) -> None:
        for position, info in enumerate(self.manifest.shards):
            if _shard_problem(self.store_dir, info):
                del self.manifest.shards[position:]
                self.manifest.complete = False
                self._save_manifest()
                return

    def _save_manifest(self) -> None:
        _write_atomic_text(self.store_dir / MANIFEST, json.dumps(self.manifest.to_json(), indent=1))


def _check_same_identity(existing: StoreManifest, wanted: StoreManifest, store_dir: Path) -> None:
    names = ("stage", "policy_version", "engine", "sampling", "num_groups", "shard_groups", "vocab_size")
    for name in (*names, "prompts_sha256"):
        old, new = getattr(existing, name), getattr(wanted, name)
        if old != new:
            raise StoreError(
                f"{store_dir} holds a rollout store with {name}={old!r}, but this run asks for {new!r}; "
                "delete the directory to regenerate it, or point the run at another directory"
            )


# ---------------------------------------------------------------------------------------------------
# Reader
# ---------------------------------------------------------------------------------------------------


class RolloutStore:
    """A complete, verified rollout store, read into compact Arrow tables.

    Rows become RolloutGroup objects only when a minibatch asks for them.
    """

    def __init__(self, store_dir: Path, manifest: StoreManifest, table: pa.Table):
        self.store_dir, self.manifest, self._table = store_dir, manifest, table

    @classmethod
    def open(cls, store_dir: str | Path, *, verify: bool = True) -> RolloutStore:
        """Open a complete store; with ``verify`` every shard's sha256 is checked against the manifest."""
        store_dir = Path(store_dir)
        manifest = read_manifest(store_dir)
        if manifest is None:
            raise StoreError(f"{store_dir} has no {MANIFEST}: not a rollout store (or generation never started)")
        if not manifest.complete or len(manifest.shards) != manifest.num_shards:
            raise StoreError(
                f"{store_dir} is incomplete ({len(manifest.shards)}/{manifest.num_shards} shards): "
                "generation was interrupted; rerun the stage to resume it"
            )
        tables = []
        for info in manifest.shards:
            problem = _shard_problem(store_dir, info) if verify else ""
            if problem:
                raise StoreError(f"{problem}; delete {store_dir / info.file} and rerun the stage to regenerate it")
            tables.append(pq.read_table(store_dir / info.file, schema=SCHEMA))
        table = pa.concat_tables(tables)
        if table.num_rows != manifest.num_groups:
            raise StoreError(f"{store_dir} holds {table.num_rows} groups but its manifest says {manifest.num_groups}")
        return cls(store_dir, manifest, table)

    is_complete = staticmethod(is_complete)

    @property
    def num_groups(self) -> int:
        return self.manifest.num_groups

    @property
    def stage(self) -> int:
        return self.manifest.stage

    def groups(self, indices: Iterable[int] | None = None) -> list[RolloutGroup]:
        """The groups at ``indices`` (store order), or all groups."""
        rows = self._table if indices is None else self._table.take(list(indices))
        return [row_to_group(row) for row in rows.to_pylist()]

    def updates_per_epoch(self, mini_groups: int) -> int:
        """Minibatches of ``mini_groups`` groups in one pass over the store (a remainder is skipped)."""
        if not 1 <= mini_groups <= self.num_groups:
            raise StoreError(f"mini_groups={mini_groups} must be in [1, {self.num_groups}] (the store's group count)")
        return self.num_groups // mini_groups

    def minibatch_indices(self, update_index: int, mini_groups: int, seed: int) -> list[int]:
        """Store indices of update ``update_index``'s groups.

        Epoch e = update_index // updates_per_epoch uses the permutation seeded by (seed, stage, e);
        the update takes its consecutive slice of that permutation.
        """
        if update_index < 0:
            raise StoreError(f"update_index={update_index} must be >= 0")
        per_epoch = self.updates_per_epoch(mini_groups)
        epoch, position = divmod(update_index, per_epoch)
        rng = np.random.default_rng([seed, self.stage, epoch])
        order = rng.permutation(self.num_groups)
        return order[position * mini_groups : (position + 1) * mini_groups].tolist()

    def minibatch(self, update_index: int, mini_groups: int, seed: int) -> list[RolloutGroup]:
        """The ``mini_groups`` groups of optimizer update ``update_index`` of this stage (deterministic)."""
        return self.groups(self.minibatch_indices(update_index, mini_groups, seed))


def store_metrics(manifest: StoreManifest, prefix: str = "rollout/") -> dict[str, float]:
    """Rollout metrics of a store, from the per-shard sums in its manifest."""
    total: dict[str, float] = {}
    for info in manifest.shards:
        for key, value in info.stats.items():
            total[key] = total.get(key, 0.0) + value
    groups, responses = max(total.get("groups", 0.0), 1.0), max(total.get("responses", 0.0), 1.0)
    metrics = {
        f"{prefix}groups": total.get("groups", 0.0),
        f"{prefix}responses": total.get("responses", 0.0),
        f"{prefix}group_size_mean": total.get("responses", 0.0) / groups,
        f"{prefix}reward_mean": total.get("reward_sum", 0.0) / responses,
        f"{prefix}response_len_mean": total.get("response_tokens", 0.0) / responses,
        f"{prefix}finish_length_frac": total.get("finish_length", 0.0) / responses,
        f"{prefix}solve_all_frac": total.get("solve_all", 0.0) / groups,
        f"{prefix}solve_none_frac": total.get("solve_none", 0.0) / groups,
    }
    for key, value in total.items():
        if key.startswith("reason_"):
            metrics[f"{prefix}{key}"] = value
    return metrics
