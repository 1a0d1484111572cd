"""Rollout allocation: a fixed G per prompt, or VIGOR (variance-guided rollout allocation).

VIGOR spends a fixed rollout budget over a batch of prompts in rounds:

1. every prompt gets ``n0`` rollouts;
2. in each of the rounds 1 … R−1 (R = max(rounds, 1)), the top-α fraction of prompts ranked by
   group reward variance (ties: lower prompt index first) gets ``increment`` more rollouts each, in
   rank order, until the budget is spent; the round that reaches the budget gives partial
   increments (the last selected prompts may get fewer, or none);
3. round R, the last, spends whatever budget is left on the top-α prompts of that round, spread
   as evenly as possible (earlier ranks take the odd rollouts): rounds ran out before the budget.

Only prompts whose group reward variance is > 0 are ranked: a group that is all correct or all wrong
has zero advantages, so more of the same samples would add no gradient (ranking such ties by index
once sent 20 rollouts to an all-wrong prompt). Fewer informative prompts than α·P simply means fewer
selected ones. When no prompt is informative there is nothing to guide the allocation, and the rest
of the budget is spread evenly over all prompts at once (as the fixed allocation would).

The total is therefore always exactly the budget. With α = 0 the allocation is the fixed one:
``budget // prompts`` per prompt, the first ``budget % prompts`` prompts taking one more.

Pure functions over Python lists, no I/O; the orchestration (calling the engine, scoring rewards)
lives in ``rollout.generate``:

    counts = initial_allocation(P, cfg)          ... generate, score ...
    for r in range(1, num_rounds(cfg) + 1):
        extra = next_allocation(rewards, spent, cfg, budget, last_round=r == num_rounds(cfg))
        if not any(extra): break
        ... generate extra[p] more responses for prompt p, append their rewards ...
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from megatron_mugrpo.errors import InputError, require

ALLOCATIONS = ("fixed", "vigor")
"""rollout.allocation: G responses per prompt, or VIGOR rounds."""

ALPHA_ROUNDING_SLACK = 1e-9
"""⌈α·P⌉ is taken of α·P minus this slack so that float noise (0.1 × 30 = 3.0000000000000004) does not
select one prompt too many."""


class AllocationError(InputError, ValueError):
    """The rollout budget cannot be allocated with these settings; the message says what to change."""


@dataclass(kw_only=True)
class VigorConfig:
    """``rollout.vigor.*``: variance-guided rollout allocation (used when rollout.allocation == 'vigor')."""

    n0: int = 4
    """Initial rollouts per prompt."""
    alpha: float = 0.25
    """Fraction of prompts (highest group reward variance) that receive extra rollouts each round."""
    increment: int = 4
    """Extra rollouts per selected prompt per round."""
    rounds: int = 2
    """Maximum allocation rounds after the initial one."""
    budget: int = 0
    """Total rollouts per shard of rollout.shard_groups prompts; 0 means shard_groups × rollout.group_size."""

    def __post_init__(self) -> None:
        require(self.n0 >= 2, f"rollout.vigor.n0={self.n0} must be >= 2 (a variance needs two samples)")
        require(0.0 <= self.alpha <= 1.0, f"rollout.vigor.alpha={self.alpha} must be in [0, 1]")
        require(self.increment >= 1, f"rollout.vigor.increment={self.increment} must be >= 1")
        require(self.rounds >= 0, f"rollout.vigor.rounds={self.rounds} must be >= 0")
        require(self.budget >= 0, f"rollout.vigor.budget={self.budget} must be >= 0")


class AllocationSettings(Protocol):
    """What the allocation reads of the ``rollout`` section (``rollout.config.RolloutConfig`` has it)."""

    allocation: str
    """'fixed' or 'vigor' (ALLOCATIONS)."""
    group_size: int
    """G: responses per prompt of the fixed allocation (and VIGOR's default budget)."""
    shard_groups: int
    """Prompts per shard: the unit ``vigor.budget`` counts rollouts for."""
    vigor: VigorConfig


def total_budget(num_prompts: int, cfg: AllocationSettings) -> int:
    """Rollouts to spend on ``num_prompts`` prompts.

    ``rollout.vigor.budget`` counts rollouts for a full shard of ``rollout.shard_groups`` prompts (the
    unit VIGOR allocates over); a partial shard gets the pro-rated share (rounded down). 0 means
    ``group_size`` per prompt.
    """
    _check_prompts(num_prompts)
    if cfg.allocation == "fixed" or cfg.vigor.budget == 0:
        return num_prompts * cfg.group_size
    return cfg.vigor.budget * num_prompts // cfg.shard_groups


def initial_allocation(num_prompts: int, cfg: AllocationSettings) -> list[int]:
    """Rollouts per prompt before any variance is known: ``n0`` each (VIGOR), or the fixed split.

    Returns a list of ``num_prompts`` counts. Raises AllocationError when the budget cannot give every
    prompt ``n0`` rollouts (VIGOR) or two rollouts (fixed: a group advantage needs two samples).
    """
    budget = total_budget(num_prompts, cfg)
    if _is_fixed(cfg):
        if budget < 2 * num_prompts:
            raise AllocationError(
                f"a budget of {budget} rollouts gives fewer than 2 per prompt to {num_prompts} prompts; "
                "raise rollout.vigor.budget (or rollout.group_size)"
            )
        share, remainder = divmod(budget, num_prompts)
        return [share + (1 if p < remainder else 0) for p in range(num_prompts)]
    n0 = cfg.vigor.n0
    if budget < n0 * num_prompts:
        raise AllocationError(
            f"rollout.vigor.budget gives {budget} rollouts to {num_prompts} prompts, fewer than "
            f"rollout.vigor.n0={n0} each; raise the budget or lower n0"
        )
    return [n0] * num_prompts


def next_allocation(
    rewards_per_prompt: list[list[float]],
    spent: int,
    cfg: AllocationSettings,
    budget: int,
    *,
    last_round: bool = False,
) -> list[int]:
    """Extra rollouts per prompt for the next VIGOR round.

    Args:
        rewards_per_prompt: rewards of every response generated so far, one list per prompt.
        spent: rollouts generated so far (the sum of the list lengths).
        cfg: the rollout config (``cfg.vigor`` holds α and the increment).
        budget: total rollouts for these prompts (``total_budget``).
        last_round: spend the whole remainder now (rounds have run out).

    Returns:
        One count per prompt (all zero when the budget is spent or the allocation is fixed).
    """
    remaining = budget - spent
    if remaining < 0:
        raise AllocationError(f"spent {spent} rollouts, more than the budget of {budget}")
    extra = [0] * len(rewards_per_prompt)
    if remaining == 0 or _is_fixed(cfg):
        return extra
    selected = rank_by_variance(rewards_per_prompt)[: num_selected(len(rewards_per_prompt), cfg.vigor.alpha)]
    if not selected:  # no informative prompt: spread the rest evenly over all of them
        return spread_evenly(remaining, list(range(len(rewards_per_prompt))), len(rewards_per_prompt))
    if last_round:
        return spread_evenly(remaining, selected, len(rewards_per_prompt))
    for prompt in selected:
        extra[prompt] = min(cfg.vigor.increment, remaining)
        remaining -= extra[prompt]
    return extra


def num_rounds(cfg: AllocationSettings) -> int:
    """Allocation rounds after the initial one: R = max(rollout.vigor.rounds, 1) for VIGOR, 0 when fixed.

    At least one round, because the last round is the one that spends the budget exactly.
    """
    return 0 if _is_fixed(cfg) else max(cfg.vigor.rounds, 1)


def spread_evenly(total: int, prompts: list[int], num_prompts: int) -> list[int]:
    """``total`` rollouts over ``prompts`` as evenly as possible (earlier ones take the odd rollouts).

    Returns one count per prompt of the batch (``num_prompts`` entries; zero for those not listed).
    """
    extra = [0] * num_prompts
    share, odd = divmod(total, len(prompts))
    for rank, prompt in enumerate(prompts):
        extra[prompt] = share + (1 if rank < odd else 0)
    return extra


def rank_by_variance(rewards_per_prompt: list[list[float]]) -> list[int]:
    """Indices of the prompts with group reward variance > 0, by decreasing variance; ties by index.

    Zero-variance prompts (all rewards equal) are left out: they are never candidates for more rollouts.
    """
    variances = [group_variance(r) for r in rewards_per_prompt]
    informative = [p for p, v in enumerate(variances) if v > 0.0]
    return sorted(informative, key=lambda p: (-variances[p], p))


def group_variance(rewards: list[float]) -> float:
    """Population variance of one group's rewards (0 for fewer than two rewards)."""
    if len(rewards) < 2:
        return 0.0
    mean = sum(rewards) / len(rewards)
    return sum((r - mean) ** 2 for r in rewards) / len(rewards)


def num_selected(num_prompts: int, alpha: float) -> int:
    """Prompts that receive extra rollouts per round: ⌈α·P⌉ (at least one when α > 0)."""
    return min(num_prompts, max(1, math.ceil(alpha * num_prompts - ALPHA_ROUNDING_SLACK))) if alpha > 0 else 0


def _is_fixed(cfg: AllocationSettings) -> bool:
    return cfg.allocation == "fixed" or cfg.vigor.alpha == 0


def _check_prompts(num_prompts: int) -> None:
    if num_prompts < 1:
        raise AllocationError(f"cannot allocate rollouts to {num_prompts} prompts; pass at least one prompt")
