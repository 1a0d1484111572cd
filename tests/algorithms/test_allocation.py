"""VIGOR allocation: exact budget, extra rollouts only to the highest-variance prompts, α = 0 is fixed G."""

import random

import pytest

from megatron_mugrpo.algorithms.allocation import (
    AllocationError,
    VigorConfig,
    group_variance,
    initial_allocation,
    next_allocation,
    num_rounds,
    num_selected,
    rank_by_variance,
    total_budget,
)
from megatron_mugrpo.rollout.config import RolloutConfig


def vigor_cfg(**vigor) -> RolloutConfig:
    return RolloutConfig(allocation="vigor", group_size=8, shard_groups=8, vigor=VigorConfig(**vigor))


def run_vigor(
    cfg: RolloutConfig, reward_of, num_prompts: int, seen: list[list[list[float]]] | None = None
) -> tuple[list[int], list[list[int]]]:
    """Drive the allocation as rollout.generate does; reward_of(prompt, k) gives the k-th reward.

    ``seen`` (optional) collects a copy of the rewards each round's allocation was computed from.
    """
    budget = total_budget(num_prompts, cfg)
    rewards = [[reward_of(p, k) for k in range(n)] for p, n in enumerate(initial_allocation(num_prompts, cfg))]
    extras = []
    for r in range(1, num_rounds(cfg) + 1):
        spent = sum(map(len, rewards))
        extra = next_allocation(rewards, spent, cfg, budget, last_round=r == num_rounds(cfg))
        if not any(extra):
            break
        extras.append(extra)
        if seen is not None:
            seen.append([list(group) for group in rewards])
        for p, n in enumerate(extra):
            rewards[p] += [reward_of(p, len(rewards[p]) + k) for k in range(n)]
    return [len(r) for r in rewards], extras


def test_group_variance_and_ranking():
    assert group_variance([1.0, 0.0]) == pytest.approx(0.25)
    assert group_variance([1.0, 1.0, 1.0]) == 0.0
    assert group_variance([1.0]) == 0.0
    # Prompts 1 and 3 tie at the top (variance 0.25): lower index first; zero-variance prompts are not ranked.
    assert rank_by_variance([[0, 0], [0, 1], [1, 1, 1, 0], [1, 0, 1, 0]]) == [1, 3, 2]


def test_num_selected_rounds_up_without_float_noise():
    assert num_selected(30, 0.1) == 3
    assert num_selected(8, 0.25) == 2
    assert num_selected(8, 0.01) == 1
    assert num_selected(8, 0.0) == 0
    assert num_selected(8, 1.0) == 8


def test_alpha_zero_is_fixed_group_size():
    cfg = vigor_cfg(alpha=0.0)
    counts, extras = run_vigor(cfg, lambda p, k: float(k % 2), num_prompts=8)
    assert counts == [8] * 8
    assert extras == []
    fixed = RolloutConfig(allocation="fixed", group_size=8)
    assert initial_allocation(8, fixed) == [8] * 8
    assert next_allocation([[0.0, 1.0]] * 8, 64, fixed, 64) == [0] * 8


def test_budget_is_pro_rated_for_a_partial_batch():
    assert total_budget(4, vigor_cfg(budget=30)) == 15  # 30 rollouts per batch of 8 prompts
    assert total_budget(3, vigor_cfg()) == 24  # budget 0: group_size per prompt


def test_alpha_zero_with_uneven_budget_spends_it_exactly():
    cfg = vigor_cfg(alpha=0.0, budget=30)  # 30 rollouts for a batch of 8 prompts
    assert initial_allocation(8, cfg) == [4, 4, 4, 4, 4, 4, 3, 3]


def test_vigor_spends_exact_budget_only_on_high_variance_prompts():
    cfg = vigor_cfg(n0=4, alpha=0.25, increment=4, rounds=2)
    # Prompts 2 and 5 are mixed (variance > 0); the rest always solve or always fail.
    mixed = {2, 5}
    counts, extras = run_vigor(cfg, lambda p, k: float(k % 2) if p in mixed else float(p % 2), num_prompts=8)
    assert sum(counts) == total_budget(8, cfg) == 64
    assert all(counts[p] == 4 for p in range(8) if p not in mixed)
    # Round 1 gives one increment each; round 2 (the last) spends the remaining 24 evenly.
    assert extras[0] == [0, 0, 4, 0, 0, 4, 0, 0]
    assert counts[2] == counts[5] == 4 + 4 + 12


def test_vigor_partial_increment_when_budget_runs_out_mid_round():
    cfg = RolloutConfig(
        allocation="vigor", shard_groups=4, vigor=VigorConfig(n0=2, alpha=0.5, increment=4, rounds=5, budget=10)
    )
    variances = {0: [0.0, 1.0], 1: [0.0, 0.0], 2: [1.0, 0.0], 3: [1.0, 1.0]}
    rewards = [variances[p] for p in range(4)]
    assert total_budget(4, cfg) == 10
    extra = next_allocation(rewards, 8, cfg, 10)
    assert extra == [2, 0, 0, 0]  # prompt 0 ranks first; the budget leaves only 2


def test_vigor_random_rewards_always_spend_budget():
    rng = random.Random(0)
    for trial in range(50):
        cfg = vigor_cfg(
            n0=rng.randint(2, 4),
            alpha=rng.choice([0.1, 0.25, 0.5, 1.0]),
            increment=rng.randint(1, 5),
            rounds=rng.randint(0, 4),
            budget=rng.randint(40, 120),
        )
        num_prompts = rng.randint(1, 8)
        if total_budget(num_prompts, cfg) < cfg.vigor.n0 * num_prompts:
            with pytest.raises(AllocationError, match="n0"):
                initial_allocation(num_prompts, cfg)
            continue
        solve_rate = rng.choice([0.0, 0.1, 0.5, 1.0])  # 0 and 1: no prompt is ever informative
        table = [[float(rng.random() < solve_rate) for _ in range(200)] for _ in range(num_prompts)]
        seen: list[list[list[float]]] = []
        counts, extras = run_vigor(cfg, lambda p, k, t=table: t[p][k], num_prompts, seen)
        assert sum(counts) == total_budget(num_prompts, cfg), f"trial {trial}"
        limit = num_selected(num_prompts, cfg.vigor.alpha)
        for extra, rewards in zip(extras, seen):
            informative = {p for p, r in enumerate(rewards) if group_variance(r) > 0}
            receivers = {p for p, n in enumerate(extra) if n}
            if informative:  # only prompts with variance > 0, at most ⌈α·P⌉ of them
                assert receivers <= informative and len(receivers) <= limit, f"trial {trial}"
            else:  # nothing informative: the rest spread evenly over every prompt
                assert max(extra) - min(extra) <= 1, f"trial {trial}"


def test_extra_rollouts_follow_variance_each_round():
    cfg = vigor_cfg(n0=2, alpha=0.25, increment=2, rounds=3)
    rewards = [[0.0, 0.0], [0.0, 1.0], [1.0, 1.0], [1.0, 1.0, 0.0, 0.0], [0.0, 0.0]] + [[1.0, 1.0]] * 3
    extra = next_allocation(rewards, sum(map(len, rewards)), cfg, 64)
    assert extra == [0, 2, 0, 2, 0, 0, 0, 0]


def test_zero_variance_prompts_never_get_extra_rollouts():
    """One mixed prompt among all-fail ones: only it grows; ties at variance 0 are not ranked by index."""
    cfg = vigor_cfg(n0=4, alpha=0.25, increment=4, rounds=2)
    counts, extras = run_vigor(cfg, lambda p, k: float(k % 2) if p == 5 else 0.0, num_prompts=8)
    assert sum(counts) == 64
    # Round 1: ⌈0.25 × 8⌉ = 2 slots but one prompt with variance > 0; the last round gives it the rest.
    assert extras[0] == [0, 0, 0, 0, 0, 4, 0, 0]
    assert counts == [4, 4, 4, 4, 4, 36, 4, 4]


def test_no_informative_prompt_spreads_the_budget_evenly():
    """Every group all-correct or all-wrong: nothing to guide VIGOR, so the rest is spread evenly at once."""
    cfg = vigor_cfg(n0=4, alpha=0.25, increment=4, rounds=2, budget=70)
    rewards = [[float(p % 2)] * 4 for p in range(8)]
    assert next_allocation(rewards, 32, cfg, 70) == [5, 5, 5, 5, 5, 5, 4, 4]
    assert next_allocation(rewards, 32, cfg, 70, last_round=True) == [5, 5, 5, 5, 5, 5, 4, 4]
    counts, extras = run_vigor(cfg, lambda p, k: float(p % 2), num_prompts=8)
    assert counts == [9, 9, 9, 9, 9, 9, 8, 8] and len(extras) == 1


def test_errors_name_the_knob():
    with pytest.raises(AllocationError, match=r"rollout\.vigor\.n0"):
        initial_allocation(8, vigor_cfg(n0=4, budget=16))
    with pytest.raises(AllocationError, match="more than the budget"):
        next_allocation([[0.0, 1.0]], 5, vigor_cfg(), 4)
    with pytest.raises(AllocationError, match="at least one prompt"):
        total_budget(0, vigor_cfg())
