"""The manifest of a rollout store and the records it lists: what a stage's D_k holds, in JSON.

``manifest.json`` names the stage, the behaviour policy's version, the engine, the sampling parameters,
the group and shard counts and a fingerprint of the prompts (``store_identity``: what a resumed store
must match); once sealed, every shard's record (``ShardInfo``: its file, checksum, counts, summable
statistics and, for MoE rollouts, its routes file) and ``complete: true``; once the stage reference
ran, the per-shard log π_old files (``OldLogprobsListing``). ``store_metrics`` turns the records'
statistics into rollout metrics without re-reading a shard.

The types only: the protocol that writes and seals a store (claims, records written after their
files, the seal) is ``rollout.store``; the shard rows are ``rollout.shards``; routes files are
``rollout.routes``. Checksums are xxHash3-128; records written with SHA-256 (the ``sha256`` field of
earlier versions) still verify.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from megatron_mugrpo import durable
from megatron_mugrpo.metric_names import REWARD, ROLLOUT_PREFIX, stat_name
from megatron_mugrpo.records import RolloutGroup
from megatron_mugrpo.rollout.routes import RoutesInfo
from megatron_mugrpo.rollout.shards import StoreError

FORMAT = "megatron_mugrpo.rollout_store/2"
"""Version 1 stored Parquet shards listed by one writer; such a store is refused (delete it to regenerate)."""
MANIFEST = "manifest.json"


@dataclass(kw_only=True)
class ShardInfo:
    """One finished shard: its record file, and its entry in the sealed manifest."""

    index: int
    file: str
    checksum: durable.Checksum
    groups: int
    responses: int
    stats: dict[str, float] = field(default_factory=dict)
    """Summable statistics of the shard (see ``shard_stats``), so metrics never need a re-read."""
    routes: RoutesInfo | None = None
    """The shard's routes file, when the engine recorded routes."""

    def to_json(self) -> dict[str, Any]:
        """The record; without a ``routes`` key when there are none (records of dense stores are unchanged)."""
        data = asdict(self)
        if self.routes is None:
            del data["routes"]
        return data

    @classmethod
    def from_json(cls, values: dict[str, Any]) -> ShardInfo:
        """A record as ``to_json`` wrote it; one of earlier versions holds a bare ``sha256``."""
        checksum, rest = durable.Checksum.split_record(values)
        routes = rest.pop("routes", None)
        return cls(**rest, checksum=checksum, routes=RoutesInfo.from_json(routes) if routes is not None else None)


@dataclass(kw_only=True)
class LogprobShardInfo:
    """One shard's log π_old file, as the manifest lists it."""

    index: int
    file: str
    checksum: durable.Checksum
    shard_checksum: str
    """Hex digest of the rollout shard the log-probs were computed on: binds the file to those bytes."""
    groups: int

    @classmethod
    def from_json(cls, values: dict[str, Any]) -> LogprobShardInfo:
        return cls(
            **{k: v for k, v in values.items() if k != "checksum"},
            checksum=durable.Checksum.from_json(values["checksum"]),
        )


@dataclass(kw_only=True)
class OldLogprobsListing:
    """The manifest's ``old_logprobs``: log π_old of every shard and the policy that computed it."""

    policy_version: int
    """Optimizer updates of the trainer weights θ_old that scored the store (the stage's start)."""
    shards: list[LogprobShardInfo]

    @classmethod
    def from_json(cls, values: dict[str, Any]) -> OldLogprobsListing:
        return cls(
            policy_version=int(values["policy_version"]),
            shards=[LogprobShardInfo.from_json(v) for v in values["shards"]],
        )


@dataclass(kw_only=True)
class StoreManifest:
    """Contents of manifest.json."""

    stage: int
    policy_version: int
    """Update count of the behaviour policy that generated the store (β_k)."""
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
    """Every shard's record, in order, once sealed (empty before)."""
    complete: bool = False
    old_logprobs: OldLogprobsListing | None = None
    """The per-shard log π_old files, once the stage reference listed them (sealed stores only)."""
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
        data["shards"] = [info.to_json() for info in self.shards]
        data["num_prompts"] = self.num_groups
        data["num_responses"] = self.num_responses
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any], where: Path) -> StoreManifest:
        if data.get("format") != FORMAT:
            raise StoreError(
                f"{where}: rollout store format {data.get('format')!r}, but this version reads {FORMAT!r} "
                f"(Arrow shards written by every engine host); delete {where.parent} and rerun the stage to "
                "regenerate it"
            )
        fields = {k: v for k, v in data.items() if k not in ("num_prompts", "num_responses", "shards", "old_logprobs")}
        listing = data.get("old_logprobs")
        return cls(
            **fields,
            shards=[ShardInfo.from_json(s) for s in data["shards"]],
            old_logprobs=OldLogprobsListing.from_json(listing) if listing is not None else None,
        )


def prompts_fingerprint(prompts: Iterable[tuple[str, Sequence[int], str]]) -> str:
    """sha256 over (prompt id, prompt token ids, reference answer) of every prompt, in order."""
    digest = hashlib.sha256()
    for prompt_id, prompt_ids, answer in prompts:
        digest.update(json.dumps([prompt_id, list(prompt_ids), answer]).encode())
    return digest.hexdigest()


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
    """True when the store's manifest is sealed (checksums are checked on open)."""
    manifest = read_manifest(store_dir)
    return manifest is not None and manifest.complete


def save_manifest(store_dir: Path, manifest: StoreManifest) -> None:
    durable.atomic_write_json(store_dir / MANIFEST, manifest.to_json())


def store_identity(
    *,
    stage: int,
    policy_version: int,
    engine: str,
    sampling: dict[str, Any],
    num_groups: int,
    shard_groups: int,
    vocab_size: int,
    prompts_sha256: str = "",
) -> StoreManifest:
    """The empty manifest of a stage's store (what a resumed store must match)."""
    if num_groups < 1 or shard_groups < 1 or vocab_size < 1:
        raise StoreError(f"num_groups={num_groups}, shard_groups={shard_groups}, vocab_size={vocab_size} must be >= 1")
    return StoreManifest(
        stage=stage,
        policy_version=policy_version,
        engine=engine,
        sampling=json.loads(json.dumps(sampling)),
        num_groups=num_groups,
        shard_groups=shard_groups,
        vocab_size=vocab_size,
        prompts_sha256=prompts_sha256,
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
    fractions = [s.pass_fraction for s in samples if s.pass_fraction is not None]
    if fractions:
        stats["test_pass_sum"], stats["test_pass_count"] = sum(fractions), float(len(fractions))
    return stats


def store_metrics(manifest: StoreManifest, prefix: str = ROLLOUT_PREFIX) -> dict[str, float]:
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
        f"{prefix}{stat_name(REWARD)}": total.get("reward_sum", 0.0) / responses,
        f"{prefix}response_len_mean": total.get("response_tokens", 0.0) / responses,
        f"{prefix}finish_length_frac": total.get("finish_length", 0.0) / responses,
        f"{prefix}solve_all_frac": total.get("solve_all", 0.0) / groups,
        f"{prefix}solve_none_frac": total.get("solve_none", 0.0) / groups,
    }
    if total.get("test_pass_count"):
        metrics[f"{prefix}test_pass_rate"] = total["test_pass_sum"] / total["test_pass_count"]
    for key, value in total.items():
        if key.startswith("reason_"):
            metrics[f"{prefix}{key}"] = value
    return metrics
