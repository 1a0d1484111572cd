"""π_train(θ_old) on a stage's rollouts: the mismatch metrics and the rollout correction's log π_old.

Before a stage's first optimizer update the trainer still holds θ_old, the weights the rollout
engine's behaviour policy β was made from. ``prepare_stage_reference`` scores the stage's stored
responses teacher forced with the trainer itself (``forward_logprobs``; every rank takes part, as
in a training step) and returns:

* ``rollout/mismatch_kl``, ``rollout/mismatch_logprob_abs_mean``, ``rollout/mismatch_logprob_abs_max``
  (``algorithms.rollout_correction.mismatch_metrics``) over a seeded subsample of
  ``algo.rollout_correction.mismatch_groups`` groups, or over all groups when a correction is on;
* with a correction on, ``OldLogprobs``: log π_old of every response token of D_k. θ moves after
  the first update, so π_old cannot be recomputed later: rank 0 writes it next to the store
  (``old_logprobs.parquet``, temporary name + rename, bound to the store by its shards'
  checksums), and a run resumed in the middle of the stage reads it back. Without it such a run
  stops with an error rather than train on log-probs of the wrong weights.

Cost: with a correction on, one forward pass without backward over D_k per stage (about a third
of what the stage's updates cost); with only the metrics, one over ``mismatch_groups`` groups.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from megatron_mugrpo import durable
from megatron_mugrpo.algorithms.rollout_correction import RolloutCorrectionConfig, mismatch_metrics
from megatron_mugrpo.errors import InputError
from megatron_mugrpo.kernels.config import DEFAULT_LOGITS_BUDGET_MIB
from megatron_mugrpo.records import RolloutGroup, TrainBatch, collate
from megatron_mugrpo.rollout.store import RolloutStore

if TYPE_CHECKING:
    from megatron_mugrpo.training.setup import Policy

OLD_LOGPROBS_FILE = "old_logprobs.parquet"
_FINGERPRINT_KEY = b"store_fingerprint"
_SCHEMA = pa.schema([("old_logprobs", pa.list_(pa.list_(pa.float32())))])

GroupLogprobs = list[list[list[float]]]
"""[group][response][token] log-probs in store order."""


class StageReferenceError(InputError, RuntimeError):
    """The stored log π_old of a stage is missing or belongs to another rollout dataset."""


@dataclass(kw_only=True)
class ScoreSettings:
    """How the trainer scores stored responses (the same settings as its training step)."""

    temperature: float
    micro_batch_size: int
    impl: str
    pad_id: int
    chunk_groups: int
    """Groups per ``forward_logprobs`` call (bounds memory like one update's minibatch)."""
    logits_budget_mib: float = DEFAULT_LOGITS_BUDGET_MIB
    """``kernels.logits_budget_mib``: with ``impl='auto'`` it decides fused vs unfused per micro-batch."""


@dataclass
class OldLogprobs:
    """log π_old of every response token of one stage's rollout dataset, in store order."""

    per_group: GroupLogprobs

    def attach(self, groups: list[RolloutGroup], indices: list[int]) -> list[RolloutGroup]:
        """Copies of ``groups`` (the store's groups at ``indices``) whose samples carry old_logprobs."""
        return [
            replace(group, samples=[replace(s, old_logprobs=lp) for s, lp in zip(group.samples, self.per_group[i])])
            for group, i in zip(groups, indices)
        ]


def minibatch(
    store: RolloutStore, update: int, mini_groups: int, seed: int, old: OldLogprobs | None
) -> list[RolloutGroup]:
    """``store.minibatch(update, mini_groups, seed)``, with log π_old attached when ``old`` is given."""
    indices = store.minibatch_indices(update, mini_groups, seed)
    groups = store.groups(indices)
    return old.attach(groups, indices) if old is not None else groups


# ------------------------------------------------------------------------------------- scoring


def teacher_forced_logprobs(policy: Policy, batch: TrainBatch, settings: ScoreSettings) -> torch.Tensor:
    """The trainer's log-probs [B, T] of ``batch``'s targets, teacher forced, no grad (collective).

    The one place stored responses are scored with the training step's settings: the stage's
    reference (``score_groups``) and HDR's headroom and drift (``loop.hdr``) both go through it.
    """
    from megatron_mugrpo.training.train_step import forward_logprobs

    return forward_logprobs(
        policy,
        batch,
        temperature=settings.temperature,
        micro_batch_size=settings.micro_batch_size,
        impl=settings.impl,
        logits_budget_mib=settings.logits_budget_mib,
    )


def score_groups(policy: Policy, groups: list[RolloutGroup], settings: ScoreSettings) -> GroupLogprobs:
    """The trainer's log-probs of every response token of ``groups`` (teacher forced, no grad)."""
    out: GroupLogprobs = []
    for start in range(0, len(groups), settings.chunk_groups):
        chunk = groups[start : start + settings.chunk_groups]
        scores = teacher_forced_logprobs(policy, collate(chunk, pad_id=settings.pad_id), settings)
        row = 0
        for group in chunk:
            per_sample = []
            for sample in group.samples:
                begin = len(group.prompt_ids) - 1  # targets[t] predicts tokens[t + 1] (records.collate)
                per_sample.append(scores[row, begin : begin + len(sample.response_ids)].tolist())
                row += 1
            out.append(per_sample)
    return out


def group_mismatch_metrics(groups: list[RolloutGroup], reference: GroupLogprobs) -> dict[str, float]:
    """``rollout/mismatch_*`` of the groups' behaviour log-probs against the trainer's ``reference``."""
    behaviour = [lp for g in groups for s in g.samples for lp in s.behaviour_logprobs]
    trainer = [lp for per_sample in reference for lps in per_sample for lp in lps]
    b, p = torch.tensor([behaviour], dtype=torch.float64), torch.tensor([trainer], dtype=torch.float64)
    metrics = mismatch_metrics(b, p, torch.ones_like(b, dtype=torch.bool))
    return {f"rollout/{name}": value for name, value in metrics.items()}


def mismatch_sample(num_groups: int, count: int, seed: int, stage: int) -> list[int]:
    """Store indices of the groups scored for the metrics: a seeded subset, in store order."""
    if count >= num_groups:
        return list(range(num_groups))
    chosen = np.random.default_rng([seed, stage, 0x6D69]).choice(num_groups, size=count, replace=False)
    return sorted(int(i) for i in chosen)


# ----------------------------------------------------------------------------------- the file


def store_fingerprint(store: RolloutStore) -> str:
    """sha256 over the store's shard checksums (their hex digests, whatever the algorithm, so stores
    written with SHA-256 records keep their fingerprint): which rollout dataset a log π_old file belongs to."""
    digest = hashlib.sha256()
    for info in store.manifest.shards:
        digest.update(info.checksum.hexdigest.encode())
    return digest.hexdigest()


def write_old_logprobs(path: Path, per_group: GroupLogprobs, fingerprint: str) -> None:
    """Write log π_old (one row per group) durably: temporary name, fsync, rename."""
    table = pa.table({"old_logprobs": per_group}, schema=_SCHEMA.with_metadata({_FINGERPRINT_KEY: fingerprint}))
    with durable.atomic_path(path) as tmp:
        pq.write_table(table, tmp)


def read_old_logprobs(store: RolloutStore) -> OldLogprobs:
    """The stage's stored log π_old, checked against the store it was computed on."""
    path = store.store_dir / OLD_LOGPROBS_FILE
    if not path.is_file():
        raise StageReferenceError(
            f"{path} is missing: the run resumes stage {store.stage} after its first update with "
            "algo.rollout_correction on, and log π_old (computed before that update) was never stored. "
            "Resume from a checkpoint at the start of the stage, or turn the correction off"
        )
    table = pq.read_table(path)
    found = (table.schema.metadata or {}).get(_FINGERPRINT_KEY, b"").decode()
    if found != store_fingerprint(store) or table.num_rows != store.num_groups:
        raise StageReferenceError(
            f"{path} was computed on another rollout dataset than {store.store_dir}; delete it and resume "
            "from a checkpoint at the start of the stage"
        )
    return OldLogprobs(table.column("old_logprobs").to_pylist())


# ------------------------------------------------------------------------------------ the pass


def prepare_stage_reference(
    policy: Policy,
    store: RolloutStore,
    *,
    correction: RolloutCorrectionConfig,
    measure: bool,
    first_update: bool,
    settings: ScoreSettings,
    seed: int,
    write: bool,
) -> tuple[OldLogprobs | None, dict[str, float]]:
    """The stage's log π_old (correction on) and ``rollout/mismatch_*`` metrics (module docstring).

    Args:
        measure: compute the metrics (e.g. rollout.quantization is on) on ``correction.mismatch_groups``
            groups; with a correction on they cover every group instead.
        first_update: the policy still holds θ_old (no update of the stage is made yet). Otherwise
            nothing is scored: log π_old is read from the file and no metrics are returned.
        write: this rank writes the file (rank 0); all ranks compute the same values.
    """
    if not correction.enabled:
        if not (measure and first_update and correction.mismatch_groups > 0):
            return None, {}
        indices = mismatch_sample(store.num_groups, correction.mismatch_groups, seed, store.stage)
        groups = store.groups(indices)
        return None, group_mismatch_metrics(groups, score_groups(policy, groups, settings))
    if not first_update:
        return read_old_logprobs(store), {}
    groups = store.groups()
    per_group = score_groups(policy, groups, settings)
    if write:
        write_old_logprobs(store.store_dir / OLD_LOGPROBS_FILE, per_group, store_fingerprint(store))
    return OldLogprobs(per_group), group_mismatch_metrics(groups, per_group)
