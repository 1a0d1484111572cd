"""Group-normalised advantages (GRPO): A_i = (R_i − mean R) / (std R + ε) within a prompt group.

Every token of response i shares A_i. A group whose rewards are all equal carries no learning
signal: its advantages are exactly 0 and it is counted ("solve_all" when every response is correct,
"solve_none" when none is). The standard deviation is the unbiased sample one (ddof = 1), as in the
GRPO reference implementations (verl ``compute_grpo_outcome_advantage``, TRL); a group with a single
response has no spread and gets A = 0.

    stats = assign_advantages(groups, eps=cfg.algo.adv_eps)   # fills sample.advantage in place
    stats["solve_none_frac"]
"""

from __future__ import annotations

import torch
from torch import Tensor

from megatron_mugrpo.records import RolloutGroup

CORRECT_REWARD = 1.0
"""Reward at or above which a response counts as solved (the math verifier gives 1.0 / 0.0)."""
INCORRECT_REWARD = 0.0
"""Reward at or below which a response counts as unsolved."""


def group_advantages(rewards: Tensor, group_index: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """Vectorised group normalisation.

    Args:
        rewards: [N] rewards of all responses.
        group_index: [N] int64 group id of each response (ids need not be contiguous or sorted).
        eps: ε added to the group's standard deviation.

    Returns:
        advantages: [N] float64; exactly 0 in zero-variance groups (and groups of one response).
        zero_variance: [N] bool, True for responses of a zero-variance group.
    """
    if rewards.shape != group_index.shape or rewards.dim() != 1:
        raise ValueError(f"rewards {tuple(rewards.shape)} and group_index {tuple(group_index.shape)} must both be [N]")
    if eps <= 0:
        raise ValueError(f"advantage eps={eps} must be > 0 (config: algo.adv_eps)")
    r = rewards.to(torch.float64)
    _, dense = torch.unique(group_index, return_inverse=True)
    num_groups = int(dense.max()) + 1 if dense.numel() else 0
    count = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, dense, torch.ones_like(r))
    mean = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, dense, r) / count
    centred = r - mean[dense]
    sq = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, dense, centred.square())
    std = (sq / (count - 1).clamp_min(1)).sqrt()
    r_max = torch.full((num_groups,), -torch.inf, dtype=torch.float64).index_reduce_(0, dense, r, "amax")
    r_min = torch.full((num_groups,), torch.inf, dtype=torch.float64).index_reduce_(0, dense, r, "amin")
    zero_variance = (r_max == r_min)[dense]
    # Exact zeros for equal rewards: (R − mean) can be a rounding residue, not a signal.
    advantages = torch.where(zero_variance, 0.0, centred / (std[dense] + eps))
    return advantages, zero_variance


def assign_advantages(groups: list[RolloutGroup], eps: float) -> dict[str, float]:
    """Fill ``sample.advantage`` of every sample of every group, in place.

    Groups may differ in size (VIGOR allocation); empty groups are skipped and not counted.

    Returns:
        Counts and fractions (no prefix; the caller adds ``rollout/``): ``num_groups``,
        ``num_samples``, ``zero_variance_groups`` / ``_frac``, ``solve_all_groups`` / ``_frac``,
        ``solve_none_groups`` / ``_frac``, ``reward_mean``, ``advantage_abs_mean``.
    """
    filled = [g for g in groups if g.samples]
    rewards = torch.tensor([s.reward for g in filled for s in g.samples], dtype=torch.float64)
    index = torch.tensor([i for i, g in enumerate(filled) for _ in g.samples], dtype=torch.long)
    if rewards.numel() == 0:
        return _group_stats(groups=0, samples=0, zero_var=0, solve_all=0, solve_none=0)
    advantages, zero_variance = group_advantages(rewards, index, eps)
    for sample, adv in zip((s for g in filled for s in g.samples), advantages.tolist()):
        sample.advantage = adv

    group_zero_var = torch.zeros(len(filled), dtype=torch.bool).index_fill_(0, index[zero_variance], True)
    first = [g.samples[0].reward for g in filled]
    solve_all = sum(1 for zv, r in zip(group_zero_var.tolist(), first) if zv and r >= CORRECT_REWARD)
    solve_none = sum(1 for zv, r in zip(group_zero_var.tolist(), first) if zv and r <= INCORRECT_REWARD)
    stats = _group_stats(
        groups=len(filled),
        samples=rewards.numel(),
        zero_var=int(group_zero_var.sum()),
        solve_all=solve_all,
        solve_none=solve_none,
    )
    stats["reward_mean"] = float(rewards.mean())
    stats["advantage_abs_mean"] = float(advantages.abs().mean())
    return stats


def _group_stats(*, groups: int, samples: int, zero_var: int, solve_all: int, solve_none: int) -> dict[str, float]:
    denominator = max(groups, 1)
    return {
        "num_groups": float(groups),
        "num_samples": float(samples),
        "zero_variance_groups": float(zero_var),
        "zero_variance_frac": zero_var / denominator,
        "solve_all_groups": float(solve_all),
        "solve_all_frac": solve_all / denominator,
        "solve_none_groups": float(solve_none),
        "solve_none_frac": solve_none / denominator,
        "reward_mean": 0.0,
        "advantage_abs_mean": 0.0,
    }
