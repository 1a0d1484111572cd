"""The paper's drift diagnostics (algorithms.diagnostics): float64 hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_mugrpo.algorithms.diagnostics import (
    DEFAULT_TRIGGER_THRESHOLD,
    DRIFT_METRICS,
    drift_stats,
    first_trigger,
    trigger_threshold,
    with_drift,
)
from megatron_mugrpo.algorithms.loss_core import LossStats
from megatron_mugrpo.algorithms.losses import policy_loss

L = math.log


def _k3(log_ratio: float) -> float:
    """(ρ − 1) − log ρ, written out."""
    return math.exp(log_ratio) - 1.0 - log_ratio


def _case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Three responses, [B=3, T=5], float64, β's log-probs all 0 so log ρ = the log-probs.

    row 0: A = −1, response cols 0-3, a trigger at col 1 (ρ = 1e-5 < 1e-4): κ = 1, T_y = 4.
    row 1: A = +1: ρ = 1e-6 at col 0 is no trigger (A > 0).
    row 2: A = −0.5, response cols 1, 3, 4 (col 2 an observation token with ρ = 1e-9: not counted),
           triggers at cols 3 and 4: κ = 1 (the second response token), T_y = 3.
    """
    log_ratio = torch.tensor(
        [
            [0.0, L(1e-5), 0.0, L(2.0), 0.0],
            [L(1e-6), 0.0, L(0.5), 0.0, 0.0],
            [5.0, 0.0, L(1e-9), L(1e-5), L(1e-6)],
        ],
        dtype=torch.float64,
    )
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0], [0, 1, 0, 1, 1]], dtype=torch.bool)
    advantages = torch.tensor([-1.0, 1.0, -0.5], dtype=torch.float64)
    return log_ratio, torch.zeros_like(log_ratio), advantages, mask


def test_drift_stats_by_hand() -> None:
    metrics = drift_stats(*_case(), threshold=1e-4).finish()
    assert set(metrics) == set(DRIFT_METRICS)
    assert metrics["trigger_count"] == 3.0
    assert metrics["triggered_responses"] == 2.0
    assert metrics["neg_adv_low_ratio_frac"] == pytest.approx(3 / 7, abs=1e-15)  # 4 + 3 tokens with A < 0
    assert metrics["trigger_pos_frac"] == pytest.approx((1 / 4 + 1 / 3) / 2, abs=1e-15)
    assert metrics["post_trigger_suffix_len"] == pytest.approx(((4 - 1 - 1) + (3 - 1 - 1)) / 2, abs=1e-15)
    k3 = _k3(L(1e-5)) + _k3(L(2.0)) + _k3(L(1e-6)) + _k3(L(0.5)) + _k3(L(1e-5)) + _k3(L(1e-6))
    assert metrics["kl_behaviour_k3"] == pytest.approx(k3 / 10, rel=1e-12)  # 4 + 3 + 3 response tokens


def test_threshold_moves_the_triggers() -> None:
    # τ_c = 1e-3: the same triggers (1e-5, 1e-6 < 1e-3); τ_c = 1e-5: only row 2's 1e-6 (1e-5 is not < 1e-5).
    assert drift_stats(*_case(), threshold=1e-3).finish()["trigger_count"] == 3.0
    strict = drift_stats(*_case(), threshold=1e-5).finish()
    assert strict["trigger_count"] == 1.0 and strict["triggered_responses"] == 1.0
    assert strict["trigger_pos_frac"] == pytest.approx(2 / 3) and strict["post_trigger_suffix_len"] == 0.0


def test_no_trigger_gives_nan_positions_and_zero_kl_on_policy() -> None:
    log_ratio, behaviour, advantages, mask = _case()
    metrics = drift_stats(torch.zeros_like(log_ratio), behaviour, advantages, mask).finish()
    assert metrics["trigger_count"] == 0.0 and metrics["kl_behaviour_k3"] == 0.0
    assert math.isnan(metrics["trigger_pos_frac"]) and math.isnan(metrics["post_trigger_suffix_len"])


def test_micro_batch_split_is_exact() -> None:
    log_ratio, behaviour, advantages, mask = _case()
    whole = drift_stats(log_ratio, behaviour, advantages, mask).finish()
    parts = [
        drift_stats(log_ratio[i : i + 1], behaviour[i : i + 1], advantages[i : i + 1], mask[i : i + 1]).host()
        for i in range(3)
    ]
    split = LossStats.merge(parts).finish()
    for name in DRIFT_METRICS:
        assert split[name] == pytest.approx(whole[name], rel=1e-12)


def test_first_trigger_positions_skip_masked_tokens() -> None:
    triggers = torch.tensor([[False, False, True, True], [False, False, False, False]])
    mask = torch.tensor([[True, False, True, True], [True, True, False, False]])
    kappa, lengths, triggered = first_trigger(triggers, mask)
    assert kappa.tolist() == [1, 2] and lengths.tolist() == [3, 2] and triggered.tolist() == [True, False]


def test_losses_own_metrics_win_and_threshold_follows_the_loss() -> None:
    log_ratio, behaviour, advantages, mask = _case()
    out = policy_loss("mu_grpo", log_ratio, behaviour, advantages, mask, clip_low=0.0, clip_high=5.0)
    merged = with_drift(out.stats, drift_stats(log_ratio, behaviour, advantages, mask)).finish()
    assert merged["ratio_mean_neg_adv"] == out.metrics["ratio_mean_neg_adv"]
    assert merged["trigger_count"] == merged["nav_trigger_count"] == 3.0
    assert trigger_threshold({"veto_threshold": 1e-3, "aggregation": "token_mean"}) == 1e-3
    assert trigger_threshold({"clip_eps": 0.2}) == DEFAULT_TRIGGER_THRESHOLD


def test_bad_threshold_names_the_key() -> None:
    with pytest.raises(ValueError, match="veto_threshold"):
        drift_stats(*_case(), threshold=1.5)
