"""Headroom-Drift Replay (HDR): the pure parts. Scores, eligibility, the FIFO buffer and the selection walk.

HDR reuses earlier prompt groups next to the fresh on-policy ones (which it never replaces). It
splits reuse into two decisions over a FIFO of immutable **mixed-outcome** groups (neither all
correct nor all wrong; the others carry zero advantage):

* **Headroom** ranks: how much is left to learn from group g under the current policy π_θ,
  H(g) = mean over g's response tokens of h_t, with h_t = 1 − π_θ(y_t) on responses with A > 0,
  h_t = π_θ(y_t) on responses with A < 0 (and 0 where A = 0). Higher means more to learn.
* **Drift** gates: whether g is still compatible with π_θ,
  D(g) = mean over g's response tokens of (log π_θ(y_t) − log π_gen(y_t))²; g is admitted iff D(g) ≤ τ.

Per step (one stage of the loop): order the buffer by headroom, descending (a group never scored
goes first: its headroom is unknown), re-score the groups teacher-forced in that order and accept
those with D ≤ τ until K_rep are accepted or ``max_scored`` were scored. The step's own
candidates are pushed after its update, so a group is never replayed in the step that made it.

Everything here is plain Python and torch on CPU tensors: no I/O, no process groups. The
orchestration (re-scoring through the trainer, mini-batch assembly, checkpointing the buffer,
metrics) is ``megatron_mugrpo.loop.hdr``.

    buffer = ReplayBuffer(capacity=cfg.capacity_groups(train_groups))
    selection = select_groups(replay_policy("hdr").order(buffer), k=8, max_scored=32, tau=1e-3, score=score_fn)
    buffer.update_scores(selection.scores)
    ...  # update on fresh + [buffer.get(key).group for key in selection.accepted]
    buffer.push(candidate_entries(groups_of_this_step))
"""

from __future__ import annotations

import copy
import math
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from megatron_mugrpo.algorithms.advantages import CORRECT_REWARD, INCORRECT_REWARD
from megatron_mugrpo.errors import require
from megatron_mugrpo.records import RolloutGroup

GroupKey = tuple[int, int]
"""Identity of a group: (stage that generated it, its index in that stage's rollout dataset D_k)."""

DEFAULT_TAU = 1e-3
"""Drift gate for single-turn math (the published setting)."""
DEFAULT_GROUPS_FRACTION = 0.25
"""K_rep = 25% of the fresh groups per step."""
DEFAULT_CAPACITY_STEPS = 8
"""Default FIFO capacity: 8 steps' worth of fresh groups."""
DEFAULT_SCORED_PER_ACCEPTED = 4
"""Default re-scoring budget per step: 4 × K_rep groups (a bounded cost when drift rejects many)."""
REPLAY_POLICIES = ("hdr", "recent")
"""Kept in step with the policy registry below (the config validates against it)."""


# ---------------------------------------------------------------------------------------- config


@dataclass(kw_only=True)
class ReplayConfig:
    """``replay.*``: Headroom-Drift Replay. Off by default: the stages are then purely on-policy."""

    enabled: bool = False
    """Replay buffered mixed-outcome groups of earlier stages next to each stage's fresh groups. Not with
    algo.rollout_correction (a replayed group carries no log π_old of the stage that generated it)."""
    policy: str = "hdr"
    """'hdr': headroom ranking, teacher-forced re-scoring and the drift gate (the method).
    'recent': the naive baseline, the most recently pushed groups, no scoring and no gate."""
    tau: float = DEFAULT_TAU
    """Drift gate τ: a group is admitted iff the mean over its response tokens of
    (log π_θ − log π_gen)² is ≤ τ. 1e-3 for single-turn math."""
    groups_per_step: int = 0
    """K_rep: groups accepted for replay per stage at most. 0: use ``groups_fraction``."""
    groups_fraction: float = DEFAULT_GROUPS_FRACTION
    """K_rep as a fraction of the fresh groups per stage (stages.train_groups), when groups_per_step is 0;
    at least 1 group."""
    capacity: int = 0
    """FIFO capacity in groups (the oldest are evicted). 0: 8 stages' worth, 8 × stages.train_groups."""
    max_scored_per_step: int = 0
    """Groups re-scored per stage at most (each costs a teacher-forced forward pass of its G responses).
    0: 4 × K_rep."""
    cross_stage: bool = False
    """Staged μ-GRPO extension (ours, not in the published method). Off: the FIFO holds copies of the
    groups, written into every checkpoint. On: it holds references (stage, index) to the mixed-outcome
    groups of earlier stages' stored datasets D_j and reads them back from the checksummed rollout
    stores, so stages of tens of thousands of groups can be replayed without copying them; ranking,
    re-scoring and the drift gate are unchanged. Needs the run's rollouts/ directory to be kept."""

    def __post_init__(self) -> None:
        require(
            self.policy in REPLAY_POLICIES,
            f"replay.policy={self.policy!r} is unknown; choose one of {REPLAY_POLICIES}",
        )
        require(
            self.tau >= 0 and not math.isnan(self.tau),
            f"replay.tau={self.tau} must be >= 0 (the drift gate; 1e-3 for single-turn math)",
        )
        require(self.groups_per_step >= 0, f"replay.groups_per_step={self.groups_per_step} must be >= 0 (0: fraction)")
        require(
            0 < self.groups_fraction <= 1,
            f"replay.groups_fraction={self.groups_fraction} must be in (0, 1] (share of the fresh groups per stage)",
        )
        require(self.capacity >= 0, f"replay.capacity={self.capacity} must be >= 0 (0: 8 stages of groups)")
        require(
            self.max_scored_per_step >= 0,
            f"replay.max_scored_per_step={self.max_scored_per_step} must be >= 0 (0: 4 × K_rep)",
        )

    def groups_for(self, train_groups: int) -> int:
        """K_rep for stages of ``train_groups`` fresh groups."""
        return self.groups_per_step or max(1, round(self.groups_fraction * train_groups))

    def capacity_groups(self, train_groups: int) -> int:
        """FIFO capacity in groups."""
        return self.capacity or DEFAULT_CAPACITY_STEPS * train_groups

    def max_scored(self, train_groups: int) -> int:
        """Re-scoring budget per stage."""
        return self.max_scored_per_step or DEFAULT_SCORED_PER_ACCEPTED * self.groups_for(train_groups)


# ------------------------------------------------------------------------------------ token math


def token_headroom(logprobs: Tensor, advantages: Tensor, response_mask: Tensor) -> Tensor:
    """Per-token headroom h_t: 1 − π_θ(y_t) where A > 0, π_θ(y_t) where A < 0, 0 where A = 0 or off the response.

    Args:
        logprobs: [N, T] log π_θ(y_t) aligned with the targets.
        advantages: [N] one advantage per response.
        response_mask: [N, T] bool or 0/1.

    Returns:
        [N, T] float64.
    """
    p = logprobs.to(torch.float64).exp()
    adv = advantages.to(torch.float64)[:, None].expand_as(p)
    h = torch.where(adv > 0, 1.0 - p, torch.where(adv < 0, p, torch.zeros_like(p)))
    return torch.where(response_mask.bool(), h, 0.0)


def token_drift(logprobs: Tensor, behaviour_logprobs: Tensor, response_mask: Tensor) -> Tensor:
    """Per-token drift (log π_θ(y_t) − log π_gen(y_t))², 0 off the response. [N, T] inputs → [N, T] float64."""
    diff = logprobs.to(torch.float64) - behaviour_logprobs.to(torch.float64)
    return torch.where(response_mask.bool(), diff.square(), 0.0)


def group_token_mean(values: Tensor, response_mask: Tensor, group_index: Tensor, num_groups: int) -> Tensor:
    """Mean of per-token ``values`` over all response tokens of each group.

    Args:
        values: [N, T] (0 off the response).
        response_mask: [N, T].
        group_index: [N] int64 in [0, num_groups): the group of each response.

    Returns:
        [num_groups] float64; NaN for a group without response tokens.
    """
    mask = response_mask.bool()
    sums = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, group_index, values.to(torch.float64).sum(-1))
    counts = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, group_index, mask.sum(-1).to(torch.float64))
    return sums / counts


def group_headroom_drift(
    logprobs: Tensor,
    behaviour_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    group_index: Tensor,
    num_groups: int,
) -> tuple[Tensor, Tensor]:
    """H(g) and D(g) of every group of a collated batch (see the module docstring).

    Shapes: logprobs, behaviour_logprobs, response_mask [N, T]; advantages, group_index [N].
    Returns (headroom [G], drift [G]), float64.
    """
    headroom = group_token_mean(
        token_headroom(logprobs, advantages, response_mask), response_mask, group_index, num_groups
    )
    drift = group_token_mean(
        token_drift(logprobs, behaviour_logprobs, response_mask), response_mask, group_index, num_groups
    )
    return headroom, drift


def passes_drift_gate(drift: float, tau: float) -> bool:
    """D(g) ≤ τ (the boundary is admitted; NaN is not)."""
    return drift <= tau


# ------------------------------------------------------------------------------------ eligibility


def is_mixed_outcome(rewards: Sequence[float]) -> bool:
    """Neither all correct nor all wrong, and not all equal (equal rewards give every response A = 0).

    With the verifier's 1/0 rewards this is exactly "at least one correct and one wrong response".
    """
    if len(rewards) < 2 or min(rewards) == max(rewards):
        return False
    all_correct = all(r >= CORRECT_REWARD for r in rewards)
    all_wrong = all(r <= INCORRECT_REWARD for r in rewards)
    return not (all_correct or all_wrong)


# ---------------------------------------------------------------------------------------- buffer


@dataclass(frozen=True, kw_only=True)
class ReplayEntry:
    """One buffered group. Immutable: scores live in the buffer, not here."""

    key: GroupKey
    policy_version: int
    """Optimizer updates the behaviour policy had seen when it generated the group (for its age)."""
    group: RolloutGroup | None
    """The group's own copy (prompt and response ids, generation-time log-probs, advantages), or None
    when it is a reference into a stored rollout dataset (``replay.cross_stage``)."""


@dataclass(frozen=True, kw_only=True)
class GroupScore:
    """The last teacher-forced scoring of a buffered group."""

    headroom: float
    drift: float
    scored_at: int
    """Policy version (optimizer updates) of the scoring policy."""


def candidate_entries(groups: Iterable[tuple[int, RolloutGroup]], *, copy_groups: bool = True) -> list[ReplayEntry]:
    """The mixed-outcome groups among ``(index in D_k, group)`` pairs as buffer entries, in the given order.

    With ``copy_groups`` each entry holds a deep copy (later changes to the caller's objects cannot
    reach the buffer); otherwise only the reference (stage, index).
    """
    return [
        ReplayEntry(
            key=(group.stage, index),
            policy_version=group.policy_version,
            group=copy.deepcopy(group) if copy_groups else None,
        )
        for index, group in groups
        if is_mixed_outcome(group.rewards)
    ]


class ReplayBuffer:
    """FIFO of at most ``capacity`` entries (oldest evicted first) plus each entry's last score."""

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"replay buffer capacity={capacity} must be >= 1 (config: replay.capacity)")
        self.capacity = capacity
        self._entries: OrderedDict[GroupKey, ReplayEntry] = OrderedDict()
        self._scores: dict[GroupKey, GroupScore] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __iter__(self) -> Iterator[GroupKey]:
        """Keys, oldest first."""
        return iter(self._entries)

    def keys(self) -> list[GroupKey]:
        """Oldest first."""
        return list(self._entries)

    def entries(self) -> list[ReplayEntry]:
        """Oldest first."""
        return list(self._entries.values())

    def get(self, key: GroupKey) -> ReplayEntry:
        return self._entries[key]

    def score(self, key: GroupKey) -> GroupScore | None:
        return self._scores.get(key)

    def push(self, entries: Iterable[ReplayEntry]) -> list[GroupKey]:
        """Append entries (newest last), evicting the oldest beyond capacity; returns the evicted keys."""
        evicted = []
        for entry in entries:
            if entry.key in self._entries:
                raise ValueError(f"group {entry.key} is already in the replay buffer; entries are pushed once")
            self._entries[entry.key] = entry
            while len(self._entries) > self.capacity:
                old, _ = self._entries.popitem(last=False)
                self._scores.pop(old, None)
                evicted.append(old)
        return evicted

    def update_scores(self, scores: dict[GroupKey, GroupScore]) -> None:
        for key, score in scores.items():
            if key not in self._entries:
                raise KeyError(f"scored group {key} is not in the replay buffer")
            self._scores[key] = score

    def state_dict(self) -> dict[str, Any]:
        """JSON-able state without the groups' contents (the caller stores those)."""
        return {
            "capacity": self.capacity,
            "entries": [
                {"key": list(e.key), "policy_version": e.policy_version, "has_group": e.group is not None}
                | ({"score": _score_dict(self._scores[e.key])} if e.key in self._scores else {})
                for e in self._entries.values()
            ],
        }

    @classmethod
    def from_state_dict(
        cls, state: dict[str, Any], groups: Sequence[RolloutGroup], capacity: int | None = None
    ) -> ReplayBuffer:
        """Inverse of ``state_dict``; ``groups`` are the copied groups in entry order (oldest first)."""
        buffer = cls(capacity or state["capacity"])
        copies = iter(groups)
        for item in state["entries"]:
            key = (int(item["key"][0]), int(item["key"][1]))
            group = next(copies) if item["has_group"] else None
            buffer.push([ReplayEntry(key=key, policy_version=int(item["policy_version"]), group=group)])
            if "score" in item and key in buffer:
                buffer._scores[key] = GroupScore(**item["score"])
        return buffer


def _score_dict(score: GroupScore) -> dict[str, float]:
    return {"headroom": score.headroom, "drift": score.drift, "scored_at": score.scored_at}


# ---------------------------------------------------------------------------------- policies


def headroom_order(buffer: ReplayBuffer) -> list[GroupKey]:
    """Never-scored groups first (newest first), then by last headroom, descending (ties: newest first)."""
    position = {key: i for i, key in enumerate(buffer.keys())}

    def rank(key: GroupKey) -> tuple[int, float, int]:
        score = buffer.score(key)
        if score is None:
            return (0, 0.0, -position[key])
        return (1, -score.headroom, -position[key])

    return sorted(buffer.keys(), key=rank)


def recent_order(buffer: ReplayBuffer) -> list[GroupKey]:
    """Newest first."""
    return buffer.keys()[::-1]


@dataclass(frozen=True)
class ReplayPolicy:
    """How a step picks its replayed groups."""

    order: Callable[[ReplayBuffer], list[GroupKey]]
    """The order in which buffered groups are considered."""
    gated: bool
    """Re-score each considered group and admit it only through the drift gate; False takes the
    first K_rep groups of the order as they are (no forward pass)."""


_POLICIES: dict[str, ReplayPolicy] = {
    "hdr": ReplayPolicy(order=headroom_order, gated=True),
    "recent": ReplayPolicy(order=recent_order, gated=False),
}
assert tuple(_POLICIES) == REPLAY_POLICIES


def replay_policy(name: str) -> ReplayPolicy:
    if name not in _POLICIES:
        raise ValueError(f"unknown replay policy {name!r}; choose one of {tuple(_POLICIES)} (config: replay.policy)")
    return _POLICIES[name]


# ------------------------------------------------------------------------------------ selection


ScoreFn = Callable[[list[GroupKey]], list[GroupScore]]
"""Re-scores buffered groups with the current policy (in the trainer: a collective forward pass)."""


@dataclass(kw_only=True)
class Selection:
    """Outcome of one step's walk over the buffer."""

    accepted: list[GroupKey]
    """Groups to replay this step, in the order they were accepted (highest priority first)."""
    rejected: list[GroupKey]
    """Groups scored this step that failed the drift gate."""
    scores: dict[GroupKey, GroupScore]
    """Every score this step produced (accepted and rejected)."""


def select_groups(
    order: Sequence[GroupKey], *, k: int, max_scored: int, tau: float, score: ScoreFn | None
) -> Selection:
    """Walk ``order`` and accept up to ``k`` groups.

    With ``score`` (HDR): each group is re-scored and accepted iff its new drift passes the gate,
    until ``k`` are accepted or ``max_scored`` were scored. Groups are scored in chunks of
    min(k − accepted, max_scored − scored), the most that cannot overshoot either bound, so the
    result is exactly the one-at-a-time walk at a fraction of the forward passes. Without
    ``score`` (naive replay): the first ``k`` groups of the order, ungated.
    """
    if score is None:
        return Selection(accepted=list(order[:k]), rejected=[], scores={})
    accepted: list[GroupKey] = []
    rejected: list[GroupKey] = []
    scores: dict[GroupKey, GroupScore] = {}
    position = 0
    while len(accepted) < k and len(scores) < max_scored and position < len(order):
        chunk = list(order[position : position + min(k - len(accepted), max_scored - len(scores))])
        position += len(chunk)
        for key, result in zip(chunk, score(chunk), strict=True):
            scores[key] = result
            (accepted if passes_drift_gate(result.drift, tau) else rejected).append(key)
    return Selection(accepted=accepted, rejected=rejected, scores=scores)


def selection_metrics(selection: Selection, buffer: ReplayBuffer, policy_version: int) -> dict[str, float]:
    """Metrics of one step's selection (no prefix; the caller adds ``replay/``).

    ``buffer_groups`` (before this step's push), ``scored``, ``accepted``, ``acceptance_rate``
    (accepted / groups considered), ``headroom_mean`` over the accepted groups and
    ``headroom_mean_rejected`` over the rejected ones, ``drift_mean`` over every group scored this
    step (``drift_mean_accepted`` / ``drift_mean_rejected`` split it), ``age_mean`` (updates between
    generation and now, accepted groups). NaN where a mean is empty.
    """
    considered = len(selection.accepted) + len(selection.rejected)

    def mean(keys: Sequence[GroupKey], field: str) -> float:
        values = [getattr(selection.scores[k], field) for k in keys if k in selection.scores]
        return sum(values) / len(values) if values else math.nan

    ages = [policy_version - buffer.get(k).policy_version for k in selection.accepted]
    scored = list(selection.scores)
    return {
        "buffer_groups": float(len(buffer)),
        "scored": float(len(scored)),
        "accepted": float(len(selection.accepted)),
        "acceptance_rate": len(selection.accepted) / considered if considered else math.nan,
        "headroom_mean": mean(selection.accepted, "headroom"),
        "headroom_mean_rejected": mean(selection.rejected, "headroom"),
        "drift_mean": mean(scored, "drift"),
        "drift_mean_accepted": mean(selection.accepted, "drift"),
        "drift_mean_rejected": mean(selection.rejected, "drift"),
        "age_mean": sum(ages) / len(ages) if ages else math.nan,
    }


# ---------------------------------------------------------------------------------- placement


def replay_slots(num_replayed: int, updates: int) -> list[range]:
    """Which of a stage's replayed groups (positions in acceptance order) each of its ``updates`` takes.

    The first update of a stage gets none when there are later ones: there π_θ equals the behaviour
    policy of the fresh groups, and the loop checks exactly that (trainer vs engine log-prob gap) on
    an all-fresh batch. The replayed groups are spread as evenly as possible over updates 1 … μ−1,
    higher-priority groups first. μ stays as configured and every update keeps its B_mini fresh
    groups; the replayed groups are placed before them. With μ = 1 they join the only update.
    """
    if updates < 1:
        raise ValueError(f"updates={updates} must be >= 1")
    if updates == 1:
        return [range(num_replayed)]
    receivers = updates - 1
    bounds = [-(-u * num_replayed // receivers) for u in range(receivers + 1)]
    return [range(0), *(range(bounds[u], bounds[u + 1]) for u in range(receivers))]
