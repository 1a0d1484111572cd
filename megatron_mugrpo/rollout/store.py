"""The on-disk rollout dataset D_k of one stage: Arrow shards written by many engine hosts, a
checksummed manifest sealed by one, read memory-mapped.

Layout of a store directory::

    manifest.json        format, stage, policy version, engine, sampling params, counts, prompts
                         fingerprint; once sealed also every shard's record and ``complete: true``
    shard_00000.arrow    Arrow IPC file (uncompressed), one row per prompt group (RolloutGroup)
    shard_00000.json     the shard's record: checksum, group/response counts, summable statistics
    shard_00000.claim    while a host generates shard 0: which host took it (removed when sealed)
    old_logprobs_00000.arrow  the trainer's log π_old of shard 0's responses (the stage reference,
                         ``training.stage_reference``), once computed; listed in the manifest's
                         ``old_logprobs`` with its checksum and the checksum of the shard it scored
    routes_00000.arrow   only when the engine recorded routes (``moe.routing_replay=rollout``): the
                         experts that routed every input token of shard 0's responses, written with
                         the shard and named, with its checksum, in the shard's record

Shard i holds the stage's groups [i·S, (i+1)·S) (S = shard_groups) and is sampled with seeds that
derive from (run seed, stage, i) only, so its bytes do not depend on which host, or how many hosts,
produced it.

Writing, by every engine host at once (``rollout/generate.py`` drives it):

1. The coordinator (global rank 0) calls ``prepare_store``. It creates the manifest, or checks that
   the existing one describes the same stage; verifies every shard already written (checksum,
   streamed); deletes what is damaged (a bad or missing shard of a complete store is dropped and the
   manifest marked incomplete, so the shard is generated again, bitwise equal on CPU); and deletes
   every claim and temporary file left behind. The returned plan lists the shards to generate.
2. After a barrier, each host takes shards with ``ShardWriter.claim``, an exclusive create
   (``O_CREAT | O_EXCL``), so a faster host simply takes more, and writes each with
   ``ShardWriter.write_shard``: the shard file, then its record, each under a temporary name,
   fsynced and renamed (``durable``): a record never names a shard that a power loss could take.
3. After a second barrier the coordinator calls ``seal_store``: it verifies every recorded shard and
   rewrites the manifest with the records and ``complete: true`` (temporary file + rename).

The manifest and the records it lists are ``rollout.manifest``; the rows' format and their
validation are ``rollout.shards``. This module is the protocol: who may write which file when, and
what a reader may trust.

Why every claim found in step 1 is stale: claims are only taken between the barriers of steps 1
and 3 of one generation, a run directory serves one run at a time, and the coordinator reaches
step 1 only after every rank of its own run has passed the previous store's step 3. A claim it
finds was therefore left by a process that is gone (a crash or SIGKILL mid-shard). A crash anywhere
leaves temporary files and stale claims, never a half-written shard under its final name.

Reading: ``RolloutStore.open`` refuses an unsealed store and maps every shard with
``pyarrow.memory_map``; the tables point into the page cache and a rank materialises only the rows
of the minibatches it asks for, so its memory does not grow with D_k (``verify=True`` also streams
every shard through its checksum). ``RolloutStore.minibatch(update_index, mini_groups, seed)`` returns the
groups of one optimizer update from a seeded permutation: random access by update index, no
iterator state, so a resumed run sees exactly the same data.

Routes per shard: the file format is ``rollout.routes`` (``shard_routes`` checks them before anything
is written, ``write_routes`` writes, ``group_routes`` reads a row back as views of the mapped file). A
store without routes (dense models) has no such files and records without a ``routes`` key.

log π_old per shard (one process, the coordinator, after the store is sealed): ``clear_old_logprobs``
unlists any earlier listing (manifest rewritten first, so no record ever names a file being
replaced), ``write_old_logprobs`` writes each shard's file durably, ``list_old_logprobs`` rewrites
the manifest naming them (the order rule of ``durable``). ``old_logprobs_listing`` re-reads the
manifest (another rank may have listed them after this one opened the store) and checks every file's
checksum, streamed, and its binding to the shard it was computed on; ``old_logprobs_table`` maps one
file. A store unsealed for repair drops the listing and the files: regenerated shards need new ones.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from megatron_mugrpo import durable
from megatron_mugrpo.records import RolloutGroup
from megatron_mugrpo.rollout.manifest import (
    MANIFEST,
    LogprobShardInfo,
    OldLogprobsListing,
    ShardInfo,
    StoreManifest,
    is_complete,
    read_manifest,
    save_manifest,
    shard_stats,
    store_identity,
)
from megatron_mugrpo.rollout.routes import group_routes, routes_schema, shard_routes, write_routes
from megatron_mugrpo.rollout.shards import (
    StoreError,
    holds_trajectories,
    map_logprob_shard,
    map_shard,
    row_to_group,
    shard_schema,
    validate_group,
    write_logprob_shard,
    write_shard,
)

SHARD_PATTERN = "shard_{:05d}.arrow"
RECORD_PATTERN = "shard_{:05d}.json"
CLAIM_PATTERN = "shard_{:05d}.claim"
OLD_LOGPROBS_PATTERN = "old_logprobs_{:05d}.arrow"
ROUTES_PATTERN = "routes_{:05d}.arrow"


def _read_record(store_dir: Path, index: int) -> ShardInfo | None:
    """Shard ``index``'s record, or None when it has none (never written, or dropped)."""
    path = store_dir / RECORD_PATTERN.format(index)
    try:
        return ShardInfo.from_json(json.loads(path.read_text()))
    except FileNotFoundError:
        return None
    except (json.JSONDecodeError, TypeError, durable.ChecksumError):
        return None  # a record is renamed into place whole; an unreadable one is treated as absent


def _write_record(store_dir: Path, info: ShardInfo) -> None:
    durable.atomic_write_json(store_dir / RECORD_PATTERN.format(info.index), info.to_json())


def _shard_problem(store_dir: Path, info: ShardInfo, expected_groups: int) -> str:
    """'' when the shard file exists with the recorded checksum and size, else what is wrong."""
    path = store_dir / info.file
    if not path.is_file():
        return f"shard {path} is missing"
    if info.groups != expected_groups:
        return f"shard {path} records {info.groups} groups, the stage's shard {info.index} has {expected_groups}"
    try:
        info.checksum.verify_file(path, "shard")
        if info.routes is not None:
            info.routes.checksum.verify_file(store_dir / info.routes.file, "routes file")
    except FileNotFoundError:
        return f"routes file {store_dir / info.routes.file} of shard {path} is missing"
    except durable.ChecksumError as exc:
        return str(exc)
    return ""


def _drop_shard(store_dir: Path, index: int) -> None:
    for pattern in (SHARD_PATTERN, RECORD_PATTERN, CLAIM_PATTERN, OLD_LOGPROBS_PATTERN, ROUTES_PATTERN):
        (store_dir / pattern.format(index)).unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------------
# Writing: prepare (coordinator) → claim + write (every host) → seal (coordinator)
# ---------------------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class StorePlan:
    """What ``prepare_store`` found: the store's manifest and the shards still to generate."""

    manifest: StoreManifest
    missing: list[int]
    """Shards to generate, in index order (empty: the store is complete and intact)."""
    dropped: dict[int, str] = field(default_factory=dict)
    """Shards a sealed store listed but that were damaged or gone: index → what was wrong."""


def prepare_store(store_dir: str | Path, wanted: StoreManifest, *, keep_policy_version: bool = False) -> StorePlan:
    """Coordinator, before any host writes: create or check the store, verify it, clear leftovers.

    An existing manifest must describe the same stage (stage, engine, sampling, counts, prompts,
    and policy version unless ``keep_policy_version``: then the stored version is kept and the caller
    must generate with that policy). Every recorded shard is re-verified; a damaged or missing one is
    deleted and listed in the plan (in ``dropped`` when the store had been sealed, which is then
    unsealed). Claims, temporary files and shard files without a record are deleted: they were left
    by processes that are gone (see the module docstring).
    """
    store_dir = Path(store_dir)
    store_dir.mkdir(parents=True, exist_ok=True)
    existing = read_manifest(store_dir)
    manifest = wanted
    if existing is not None:
        _check_same_identity(existing, wanted, store_dir, skip=("policy_version",) if keep_policy_version else ())
        manifest = existing
    recorded = _recorded_shards(store_dir, manifest)
    dropped: dict[int, str] = {}
    for index in range(manifest.num_shards):
        info = recorded.get(index)
        problem = (
            _shard_problem(store_dir, info, len(manifest.shard_range(index)))
            if info is not None
            else (f"shard {store_dir / SHARD_PATTERN.format(index)} is not recorded" if manifest.complete else "")
        )
        if problem:
            _drop_shard(store_dir, index)
            recorded.pop(index, None)
            if manifest.complete:
                dropped[index] = problem
    missing = [i for i in range(manifest.num_shards) if i not in recorded]
    if existing is None or (missing and manifest.complete):
        for info in recorded.values():  # a sealed store's records become the source of truth again
            _write_record(store_dir, info)
        manifest.complete, manifest.shards, manifest.old_logprobs = False, [], None
        save_manifest(store_dir, manifest)
    listed = {info.file for info in manifest.old_logprobs.shards} if manifest.old_logprobs is not None else set()
    _remove_leftovers(store_dir, keep=set(recorded), keep_files=listed)
    if not missing and not manifest.complete:  # every shard written and verified, the seal lost with the process
        manifest = seal_store(store_dir)  # that wrote them (killed between its last shard and the seal)
    return StorePlan(manifest=manifest, missing=missing, dropped=dropped)


def _recorded_shards(store_dir: Path, manifest: StoreManifest) -> dict[int, ShardInfo]:
    """Shards known to be finished: the sealed manifest's list, else the record files."""
    if manifest.complete:
        return {info.index: info for info in manifest.shards}
    records = (_read_record(store_dir, index) for index in range(manifest.num_shards))
    return {info.index: info for info in records if info is not None}


def _remove_leftovers(store_dir: Path, keep: set[int], keep_files: set[str]) -> None:
    """Delete claims, temporary files, shard files or records of shards that are not kept, and log π_old
    files the manifest does not list (``keep_files``)."""
    for path in store_dir.iterdir():
        name = path.name
        if name.endswith((durable.TMP_SUFFIX, ".claim")) or (
            name.startswith("old_logprobs_") and name not in keep_files
        ):
            path.unlink(missing_ok=True)
        elif name.startswith(("shard_", "routes_")) and name.endswith((".arrow", ".json")):
            index = name.split("_", 1)[1].split(".")[0]
            if not index.isdigit() or int(index) not in keep:
                path.unlink(missing_ok=True)


def _check_same_identity(
    existing: StoreManifest, wanted: StoreManifest, store_dir: Path, skip: tuple[str, ...] = ()
) -> None:
    names = ("stage", "policy_version", "engine", "sampling", "num_groups", "shard_groups", "vocab_size")
    for name in (*names, "prompts_sha256"):
        old, new = getattr(existing, name), getattr(wanted, name)
        if name not in skip and old != new:
            raise StoreError(
                f"{store_dir} holds a rollout store with {name}={old!r}, but this run asks for {new!r}; "
                "delete the directory to regenerate it, or point the run at another directory"
            )


def holds_env(manifest: StoreManifest) -> bool:
    """Whether the store's responses are multi-turn trajectories (its sampling record names the environment,
    ``rollout.generate.stage_identity``): their shards carry the trajectory columns (``rollout.shards``)."""
    return manifest.sampling.get("env") is not None


class ShardWriter:
    """One host's writer: claims shards and writes each (shard file, then its record, both durably)."""

    def __init__(self, store_dir: str | Path, manifest: StoreManifest):
        self.store_dir, self.manifest = Path(store_dir), manifest

    @property
    def num_shards(self) -> int:
        return self.manifest.num_shards

    def claim(self, index: int) -> bool:
        """Take shard ``index`` for this host: True when no other host has (an exclusive create)."""
        path = self.store_dir / CLAIM_PATTERN.format(index)
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:  # who took it, for a person reading the directory
            json.dump({"host": socket.gethostname(), "pid": os.getpid(), "time": time.time()}, f)
        return True

    def release(self, index: int) -> None:
        """Give shard ``index`` back (this host failed on it; a SIGKILLed host leaves its claim to
        the next ``prepare_store``)."""
        (self.store_dir / CLAIM_PATTERN.format(index)).unlink(missing_ok=True)

    def write_shard(self, index: int, groups: Sequence[RolloutGroup]) -> ShardInfo:
        """Validate and write shard ``index``: the Arrow file, then its record (the shard counts as
        written once its record exists)."""
        if not 0 <= index < self.num_shards:
            raise StoreError(f"shard {index} is outside the {self.num_shards} shards of {self.store_dir}")
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
        if holds_trajectories(groups) != holds_env(self.manifest):
            raise StoreError(
                f"shard {index} of {self.store_dir}: the store was planned "
                f"{'with' if holds_env(self.manifest) else 'without'} an environment (its sampling record's "
                "'env'), and its shards must hold multi-turn trajectories exactly when it was"
            )
        routes = shard_routes(groups, where=f"shard {index} of {self.store_dir}")
        name = SHARD_PATTERN.format(index)
        info = ShardInfo(
            index=index,
            file=name,
            checksum=write_shard(self.store_dir / name, groups),
            groups=len(groups),
            responses=sum(len(g.samples) for g in groups),
            stats=shard_stats(groups),
            routes=write_routes(self.store_dir / ROUTES_PATTERN.format(index), routes) if routes else None,
        )
        _write_record(self.store_dir, info)  # last: a record names only durable files
        return info


def seal_store(store_dir: str | Path) -> StoreManifest:
    """Coordinator, after every host finished: verify every shard and mark the store complete."""
    store_dir = Path(store_dir)
    manifest = read_manifest(store_dir)
    if manifest is None:
        raise StoreError(f"{store_dir} has no {MANIFEST}: prepare_store() must run before seal_store()")
    shards = []
    for index in range(manifest.num_shards):
        info = _read_record(store_dir, index)
        problem = (
            _shard_problem(store_dir, info, len(manifest.shard_range(index)))
            if info is not None
            else f"shard {index} was never written"
        )
        if problem:
            raise StoreError(
                f"{store_dir}: {problem}; the store stays incomplete. Rerun the stage (`mugrpo train --resume` "
                "or `mugrpo generate --stage K`): only missing or damaged shards are generated"
            )
        shards.append(info)
    manifest.shards, manifest.complete = shards, True
    save_manifest(store_dir, manifest)
    for claim in store_dir.glob("*.claim"):
        claim.unlink(missing_ok=True)
    return manifest


# ---------------------------------------------------------------------------------------------------
# Reader
# ---------------------------------------------------------------------------------------------------


def write_store(
    store_dir: str | Path,
    groups: Sequence[RolloutGroup],
    *,
    stage: int,
    policy_version: int,
    engine: str,
    sampling: dict[str, Any],
    shard_groups: int,
    vocab_size: int,
) -> RolloutStore:
    """Write a whole store from one process (tools, tests, benchmarks): prepare, every shard, seal, open."""
    wanted = store_identity(
        stage=stage,
        policy_version=policy_version,
        engine=engine,
        sampling=sampling,
        num_groups=len(groups),
        shard_groups=shard_groups,
        vocab_size=vocab_size,
    )
    plan = prepare_store(store_dir, wanted)
    writer = ShardWriter(store_dir, plan.manifest)
    for shard in plan.missing:
        if not writer.claim(shard):
            raise StoreError(f"shard {shard} of {store_dir} is claimed by another writer")
        writer.write_shard(shard, [groups[i] for i in plan.manifest.shard_range(shard)])
    seal_store(store_dir)
    return RolloutStore.open(store_dir)


class RolloutStore:
    """A complete store, memory-mapped: rows become RolloutGroup objects only when asked for.

    Shards are mapped on first use. Mapped pages are clean page cache that the kernel reclaims under
    pressure; the process's own memory holds only the rows it converted."""

    def __init__(self, store_dir: Path, manifest: StoreManifest):
        self.store_dir, self.manifest = store_dir, manifest
        self._starts = np.cumsum([0] + [info.groups for info in manifest.shards])
        self._mapped: dict[int, pa.Table] = {}
        self._mapped_routes: dict[int, pa.Table] = {}

    @classmethod
    def open(cls, store_dir: str | Path, *, verify: bool = True) -> RolloutStore:
        """Open a sealed store; with ``verify`` every shard's checksum is checked (streamed) first."""
        store_dir = Path(store_dir)
        manifest = read_manifest(store_dir)
        if manifest is None:
            raise StoreError(f"{store_dir} has no {MANIFEST}: not a rollout store (or generation never started)")
        rerun = (
            "rerun the stage (`mugrpo train --resume RUN_DIR` or `mugrpo generate --run-dir RUN_DIR --stage K`): "
            "missing or damaged shards are regenerated, the others kept"
        )
        if not manifest.complete or len(manifest.shards) != manifest.num_shards:
            raise StoreError(
                f"{store_dir} is incomplete ({len(manifest.shards)}/{manifest.num_shards} shards sealed): "
                f"generation was interrupted; {rerun}"
            )
        for info in manifest.shards:
            problem = _shard_problem(store_dir, info, len(manifest.shard_range(info.index))) if verify else ""
            if problem:
                raise StoreError(f"{problem}; {rerun}")
        return cls(store_dir, manifest)

    is_complete = staticmethod(is_complete)

    @property
    def num_groups(self) -> int:
        return self.manifest.num_groups

    @property
    def stage(self) -> int:
        return self.manifest.stage

    def groups(self, indices: Iterable[int] | None = None) -> list[RolloutGroup]:
        """The groups at ``indices`` (store order), or all groups.

        Rows are sliced out of their shard's mapped table one by one: ``Table.take`` over many shards
        would first concatenate them, copying the whole store into memory."""
        if indices is None:
            indices = range(self.num_groups)
        out = []
        for index in indices:
            shard, row = self.shard_of(index)
            group = row_to_group(self._shard(shard).slice(row, 1).to_pylist()[0])
            routes = self.manifest.shards[shard].routes
            if routes is not None:
                for sample, sample_routes in zip(group.samples, group_routes(self._routes(shard), row, routes)):
                    sample.routes = sample_routes
            out.append(group)
        return out

    def _routes(self, position: int) -> pa.Table:
        """Shard ``position``'s routes table, mapped on first use."""
        if position not in self._mapped_routes:
            shard = self.manifest.shards[position]
            info = shard.routes
            try:
                self._mapped_routes[position] = map_shard(
                    self.store_dir / info.file,
                    groups=shard.groups,
                    schema=routes_schema(info.dtype, info.moe_layers * info.topk),
                )
            except StoreError as exc:
                raise StoreError(f"{exc}; rerun the stage to regenerate it") from exc
        return self._mapped_routes[position]

    def _shard(self, position: int) -> pa.Table:
        """Shard ``position``'s table, mapped on first use (opening a store touches no shard)."""
        if position not in self._mapped:
            info = self.manifest.shards[position]
            try:
                schema = shard_schema(trajectories=holds_env(self.manifest))
                self._mapped[position] = map_shard(self.store_dir / info.file, groups=info.groups, schema=schema)
            except StoreError as exc:
                raise StoreError(f"{exc}; rerun the stage to regenerate it") from exc
        return self._mapped[position]

    def shard_index_range(self, position: int) -> range:
        """Store indices of the groups of sealed shard ``position``."""
        return range(int(self._starts[position]), int(self._starts[position + 1]))

    def shard_of(self, index: int) -> tuple[int, int]:
        """(shard position, row within it) of group ``index``."""
        if not 0 <= index < self.num_groups:
            raise StoreError(f"group index {index} is outside [0, {self.num_groups}) of {self.store_dir}")
        shard = int(np.searchsorted(self._starts, index, side="right")) - 1
        return shard, index - int(self._starts[shard])

    # -------------------------------------------------------------------- log π_old (coordinator writes)

    def clear_old_logprobs(self) -> None:
        """Unlist and delete the store's log π_old files (before new ones are written over them)."""
        listing = self.manifest.old_logprobs
        if listing is None:
            return
        self.manifest.old_logprobs = None
        save_manifest(self.store_dir, self.manifest)  # unlisted first: no record names a file being replaced
        for info in listing.shards:
            (self.store_dir / info.file).unlink(missing_ok=True)

    def write_old_logprobs(self, position: int, per_group: Sequence[Sequence[Sequence[float]]]) -> LogprobShardInfo:
        """Write shard ``position``'s log π_old ([group][response][token]) durably; list it with
        ``list_old_logprobs`` once every shard's is written."""
        shard = self.manifest.shards[position]
        if len(per_group) != shard.groups:
            raise StoreError(
                f"shard {position} of {self.store_dir} has {shard.groups} groups, got {len(per_group)} rows"
            )
        name = OLD_LOGPROBS_PATTERN.format(shard.index)
        checksum = write_logprob_shard(self.store_dir / name, per_group)
        return LogprobShardInfo(
            index=shard.index,
            file=name,
            checksum=checksum,
            shard_checksum=shard.checksum.hexdigest,
            groups=shard.groups,
        )

    def list_old_logprobs(self, shards: Sequence[LogprobShardInfo], policy_version: int) -> None:
        """Name every shard's (durable) log π_old file in the manifest (rewritten atomically)."""
        if [info.index for info in shards] != [info.index for info in self.manifest.shards]:
            raise StoreError(
                f"log π_old of {len(shards)} shards given, {self.store_dir} has {len(self.manifest.shards)}"
            )
        self.manifest.old_logprobs = OldLogprobsListing(policy_version=policy_version, shards=list(shards))
        save_manifest(self.store_dir, self.manifest)

    # ---------------------------------------------------------------------- log π_old (every rank reads)

    def old_logprobs_listing(self, *, verify: bool = True) -> OldLogprobsListing | None:
        """The listing as the manifest on disk has it now (None: never computed), every file checked
        against the shard it belongs to and, with ``verify``, against its checksum (streamed).

        StoreError when a listed file is missing, altered, or belongs to other shard bytes."""
        manifest = read_manifest(self.store_dir)
        listing = manifest.old_logprobs if manifest is not None else None
        if listing is None:
            return None
        if [info.index for info in listing.shards] != [info.index for info in self.manifest.shards]:
            raise StoreError(f"{self.store_dir}: the log π_old listing does not cover the store's shards")
        for info, shard in zip(listing.shards, self.manifest.shards):
            path = self.store_dir / info.file
            if info.shard_checksum != shard.checksum.hexdigest or info.groups != shard.groups:
                raise StoreError(f"{path} was computed on other bytes than {self.store_dir / shard.file}")
            try:
                if verify:
                    info.checksum.verify_file(path, "log π_old file")
            except (OSError, durable.ChecksumError) as exc:
                raise StoreError(f"{path} is missing or does not match its checksum in the manifest ({exc})") from exc
        return listing

    def old_logprobs_table(self, listing: OldLogprobsListing, position: int) -> pa.Table:
        """Shard ``position``'s log π_old, memory-mapped (one row per group)."""
        info = listing.shards[position]
        return map_logprob_shard(self.store_dir / info.file, groups=info.groups)

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
