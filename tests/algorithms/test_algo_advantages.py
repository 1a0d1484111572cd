"""Group-normalised advantages: hand values, zero-variance groups, unequal group sizes."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_mugrpo.algorithms.advantages import assign_advantages, group_advantages
from megatron_mugrpo.records import RolloutGroup, RolloutSample

EPS = 1e-6


def _group(rewards: list[float], prompt_id: str = "p") -> RolloutGroup:
    samples = [
        RolloutSample(response_ids=[1, 2], behaviour_logprobs=[-0.1, -0.2], finish_reason="stop", reward=r)
        for r in rewards
    ]
    return RolloutGroup(prompt_id=prompt_id, prompt_ids=[7], answer="1", samples=samples)


def test_hand_values_with_unbiased_std() -> None:
    two_of_four = _group([1.0, 0.0, 0.0, 1.0])
    one_of_three = _group([1.0, 0.0, 0.0])
    assign_advantages([two_of_four, one_of_three], eps=EPS)
    # [1, 0, 0, 1]: mean 0.5, std = sqrt(4 · 0.25 / 3) = sqrt(1/3).
    s = math.sqrt(1 / 3)
    a = 0.5 / (s + EPS)
    assert [x.advantage for x in two_of_four.samples] == pytest.approx([a, -a, -a, a], rel=1e-12)
    # [1, 0, 0]: mean 1/3, std = sqrt(((2/3)² + 2 (1/3)²) / 2) = sqrt(1/3).
    assert [x.advantage for x in one_of_three.samples] == pytest.approx(
        [(2 / 3) / (s + EPS), -(1 / 3) / (s + EPS), -(1 / 3) / (s + EPS)], rel=1e-12
    )
    assert sum(x.advantage for x in one_of_three.samples) == pytest.approx(0.0, abs=1e-12)


def test_zero_variance_groups_are_zero_and_counted() -> None:
    groups = [
        _group([1.0, 1.0]),  # solve_all
        _group([0.0] * 5),  # solve_none
        _group([0.5, 0.5, 0.5]),  # zero variance, neither
        _group([1.0]),  # a single response: no spread, counted as solve_all
        _group([0.0, 1.0, 1.0, 0.0, 1.0, 1.0]),  # informative
        RolloutGroup(prompt_id="empty", prompt_ids=[7], answer="1"),  # skipped
    ]
    stats = assign_advantages(groups, eps=EPS)
    for group in groups[:4]:
        assert all(s.advantage == 0.0 for s in group.samples)
    assert all(s.advantage != 0.0 for s in groups[4].samples)
    assert stats["num_groups"] == 5 and stats["num_samples"] == 17
    assert stats["zero_variance_groups"] == 4 and stats["zero_variance_frac"] == pytest.approx(4 / 5)
    assert stats["solve_all_groups"] == 2 and stats["solve_all_frac"] == pytest.approx(2 / 5)
    assert stats["solve_none_groups"] == 1 and stats["solve_none_frac"] == pytest.approx(1 / 5)
    assert stats["reward_mean"] == pytest.approx((2 + 1.5 + 1 + 4) / 17)


def test_vectorised_matches_per_group_loop_with_unsorted_ids() -> None:
    g = torch.Generator().manual_seed(0)
    rewards = torch.randint(0, 2, (40,), generator=g).double()
    index = torch.randint(0, 9, (40,), generator=g) * 3 + 100  # sparse, unsorted ids
    advantages, zero_var = group_advantages(rewards, index, EPS)
    for gid in index.unique():
        members = index == gid
        r = rewards[members]
        if r.numel() < 2 or r.max() == r.min():
            assert zero_var[members].all() and (advantages[members] == 0).all()
        else:
            expected = (r - r.mean()) / (r.std() + EPS)
            torch.testing.assert_close(advantages[members], expected)


def test_no_samples_and_bad_input() -> None:
    assert assign_advantages([], eps=EPS)["num_groups"] == 0
    with pytest.raises(ValueError, match="must both be"):
        group_advantages(torch.zeros(3), torch.zeros(2, dtype=torch.long), EPS)
    with pytest.raises(ValueError, match=r"algo\.adv_eps"):
        group_advantages(torch.zeros(3), torch.zeros(3, dtype=torch.long), 0.0)
