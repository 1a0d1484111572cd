"""π_train(θ_old) on a stage's rollouts: the mismatch metrics and the rollout correction's log π_old.

Before a stage's first optimizer update the trainer still holds θ_old, the weights the rollout
engine's behaviour policy β was made from. ``prepare_stage_reference`` scores the stage's stored
responses teacher forced with the trainer itself (``forward_logprobs``; every rank takes part, as
in a training step) and returns:

* ``rollout/mismatch_kl``, ``rollout/mismatch_logprob_abs_mean``, ``rollout/mismatch_logprob_abs_max``
  (``algorithms.rollout_correction.mismatch_metrics``) over a seeded subsample of
  ``algo.rollout_correction.mismatch_groups`` groups, or over all groups when a correction is on;
* with a correction on, ``OldLogprobs``: log π_old of every response token of D_k. θ moves after
  the first update, so π_old cannot be recomputed later: rank 0 writes it next to the store, one
  file per shard (``old_logprobs_00000.arrow``, durable, listed in the store's manifest with its
  checksum, the checksum of the shard it scored and θ_old's update count; ``rollout.store``), and
  a run resumed in the middle of the stage reads it back. Without it such a run stops with an error
  rather than train on log-probs of the wrong weights.
* with ``keep`` (HDR on a quantized stage): the same files without a correction, so that the
  replay buffer measures a group's drift from the trainer's π_old instead of the quantized β.

Memory stays flat in D_k: the pass scores and writes one shard at a time, the metrics are running
sums, and ``OldLogprobs`` maps the files and turns only the rows a minibatch asks for into lists.

Cost: with a correction on (or ``keep``), one forward pass without backward over D_k per stage
(about a third of what the stage's updates cost); with only the metrics, one over
``mismatch_groups`` groups.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import torch

from megatron_mugrpo.algorithms.rollout_correction import RolloutCorrectionConfig, mismatch_metrics
from megatron_mugrpo.errors import InputError
from megatron_mugrpo.kernels.config import DEFAULT_LOGITS_BUDGET_MIB
from megatron_mugrpo.metric_names import (
    MISMATCH_KL,
    MISMATCH_LOGPROB_ABS_MAX,
    MISMATCH_LOGPROB_ABS_MEAN,
    MISMATCH_TOKENS,
    ROLLOUT_PREFIX,
)
from megatron_mugrpo.records import RolloutGroup, TrainBatch, collate
from megatron_mugrpo.rollout.manifest import OldLogprobsListing
from megatron_mugrpo.rollout.shards import StoreError
from megatron_mugrpo.rollout.store import OLD_LOGPROBS_PATTERN, RolloutStore

if TYPE_CHECKING:
    from megatron_mugrpo.training.setup import Policy

OLD_LOGPROBS_GLOB = OLD_LOGPROBS_PATTERN.replace("{:05d}", "*")
"""The per-shard log π_old files of a store directory."""

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
    micro_batch_tokens: int | None = None
    """``parallel.micro_batch_tokens``: token-budget micro-batches instead of ``micro_batch_size`` rows
    (the update's cut, so a scoring pass pads no more than an update does); None: fixed rows."""
    pack_sequences: bool = False
    """``parallel.pack_sequences``: several responses per row under ``micro_batch_tokens``."""


class OldLogprobs:
    """log π_old of every response token of one stage's rollout dataset, read from its per-shard files.

    Files are memory-mapped on first use; only the rows asked for become Python lists."""

    def __init__(self, store: RolloutStore, listing: OldLogprobsListing):
        self.store, self.listing = store, listing
        self._tables: dict[int, pa.Table] = {}

    @property
    def policy_version(self) -> int:
        """Optimizer updates of the weights θ_old that computed them."""
        return self.listing.policy_version

    def rows(self, indices: Iterable[int]) -> GroupLogprobs:
        """[group][response][token] log π_old of the store's groups at ``indices``."""
        out = []
        for index in indices:
            position, row = self.store.shard_of(index)
            if position not in self._tables:
                self._tables[position] = self.store.old_logprobs_table(self.listing, position)
            out.append(self._tables[position].slice(row, 1).column(0).to_pylist()[0])
        return out

    def attach(self, groups: list[RolloutGroup], indices: list[int]) -> list[RolloutGroup]:
        """Copies of ``groups`` (the store's groups at ``indices``) whose samples carry old_logprobs."""
        out = []
        for group, per_sample in zip(groups, self.rows(indices), strict=True):
            if [len(s.response_ids) for s in group.samples] != [len(lps) for lps in per_sample]:
                raise StageReferenceError(
                    f"log π_old of {group.prompt_id!r} in {self.store.store_dir} does not match its responses' "
                    "lengths; delete the old_logprobs_* files and resume from a checkpoint at the start of the stage"
                )
            out.append(
                replace(group, samples=[replace(s, old_logprobs=lp) for s, lp in zip(group.samples, per_sample)])
            )
        return out


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
        micro_batch_tokens=settings.micro_batch_tokens,
        pack_sequences=settings.pack_sequences,
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
    # A multi-turn response's observation tokens have no behaviour log-prob (0.0 stands in): left out.
    policy = [m for g in groups for s in g.samples for m in (s.policy_mask or [1] * len(s.response_ids))]
    b, p = torch.tensor([behaviour], dtype=torch.float64), torch.tensor([trainer], dtype=torch.float64)
    metrics = mismatch_metrics(b, p, torch.tensor([policy], dtype=torch.bool))
    return {f"{ROLLOUT_PREFIX}{name}": value for name, value in metrics.items()}


class MismatchSums:
    """``group_mismatch_metrics`` over many chunks without keeping them: token-weighted running sums."""

    def __init__(self) -> None:
        self.kl, self.abs, self.max, self.tokens = 0.0, 0.0, -math.inf, 0.0

    def add(self, groups: list[RolloutGroup], reference: GroupLogprobs) -> None:
        chunk = group_mismatch_metrics(groups, reference)
        tokens = chunk[MISMATCH_TOKENS]
        if tokens:
            self.kl += chunk[MISMATCH_KL] * tokens
            self.abs += chunk[MISMATCH_LOGPROB_ABS_MEAN] * tokens
            self.max = max(self.max, chunk[MISMATCH_LOGPROB_ABS_MAX])
            self.tokens += tokens

    def metrics(self) -> dict[str, float]:
        if not self.tokens:
            return group_mismatch_metrics([], [])
        return {
            MISMATCH_KL: self.kl / self.tokens,
            MISMATCH_LOGPROB_ABS_MEAN: self.abs / self.tokens,
            MISMATCH_LOGPROB_ABS_MAX: self.max,
            MISMATCH_TOKENS: self.tokens,
        }


def mismatch_sample(num_groups: int, count: int, seed: int, stage: int) -> list[int]:
    """Store indices of the groups scored for the metrics: a seeded subset, in store order."""
    if count >= num_groups:
        return list(range(num_groups))
    chosen = np.random.default_rng([seed, stage, 0x6D69]).choice(num_groups, size=count, replace=False)
    return sorted(int(i) for i in chosen)


# ---------------------------------------------------------------------------------- the files


def read_old_logprobs(store: RolloutStore, policy_version: int | None = None) -> OldLogprobs:
    """The stage's stored log π_old (every file checked against its checksum and its shard), and, when
    ``policy_version`` is given, computed by the weights of that many updates."""
    try:
        listing = store.old_logprobs_listing()
    except StoreError as exc:
        raise StageReferenceError(
            f"{exc}: log π_old of {store.store_dir} is damaged; resume from a checkpoint at the start of stage "
            f"{store.stage} (it is computed again there)"
        ) from exc
    if listing is None:
        raise StageReferenceError(
            f"{store.store_dir} has no log π_old (old_logprobs_*.arrow listed in its manifest): the run resumes "
            f"stage {store.stage} after its first update with algo.rollout_correction on or algo.loss=icepop (or "
            "replays a quantized stage), and log π_old (computed before that update) was never stored. Resume from "
            "a checkpoint at the start of the stage, or turn the correction off (icepop: use icepop_current)"
        )
    if policy_version is not None and listing.policy_version != policy_version:
        raise StageReferenceError(
            f"log π_old of {store.store_dir} was computed by the weights of update {listing.policy_version}, but "
            f"this stage started at update {policy_version}; resume from a checkpoint at the start of the stage"
        )
    return OldLogprobs(store, listing)


def write_stage_reference(
    policy: Policy, store: RolloutStore, settings: ScoreSettings, *, write: bool, policy_version: int
) -> dict[str, float]:
    """Score every group of ``store`` one shard at a time; rank 0 (``write``) writes each shard's log π_old
    and finally lists them in the manifest. Returns ``rollout/mismatch_*`` over every token."""
    if write:
        store.clear_old_logprobs()
    sums, written = MismatchSums(), []
    for position in range(len(store.manifest.shards)):
        groups = store.groups(store.shard_index_range(position))
        per_group = score_groups(policy, groups, settings)
        sums.add(groups, per_group)
        if write:
            written.append(store.write_old_logprobs(position, per_group))
    if write:
        store.list_old_logprobs(written, policy_version)
    return sums.metrics()


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
    policy_version: int,
    barrier: Callable[[], None],
    keep: bool = False,
    for_loss: bool = False,
) -> tuple[OldLogprobs | None, dict[str, float]]:
    """The stage's log π_old (correction on) and ``rollout/mismatch_*`` metrics (module docstring).

    Args:
        measure: compute the metrics (e.g. rollout.quantization is on) on ``correction.mismatch_groups``
            groups; with a correction on (or ``keep``) they cover every group instead.
        first_update: the policy still holds θ_old (no update of the stage is made yet). Otherwise
            nothing is scored: log π_old is read from the files and no metrics are returned.
        write: this rank writes the files (rank 0); all ranks compute the same values.
        policy_version: updates of θ_old (the stage's first update's count): stored with the files,
            checked when they are read back.
        barrier: waits for every rank (``HostGroup.barrier``): after it the files rank 0 wrote are listed.
        keep: store log π_old even without a correction (HDR measures a quantized stage's drift from it);
            only a correction (or ``for_loss``) returns it for the updates.
        for_loss: the loss itself reads log π_old (``icepop``: its mask is on π_old / β); treated as a
            correction is: every group scored, the files written, log π_old returned.
    """
    returned = correction.enabled or for_loss
    if not (returned or keep):
        if not (measure and first_update and correction.mismatch_groups > 0):
            return None, {}
        indices = mismatch_sample(store.num_groups, correction.mismatch_groups, seed, store.stage)
        groups = store.groups(indices)
        return None, group_mismatch_metrics(groups, score_groups(policy, groups, settings))
    metrics = {}
    if first_update:
        metrics = write_stage_reference(policy, store, settings, write=write, policy_version=policy_version)
        barrier()  # rank 0's files are listed before any rank reads them
    if not returned:
        return None, metrics
    return read_old_logprobs(store, policy_version), metrics
