"""NAV scopes on a constructed example: triggers at κ = 2 and t = 4 of a negative-advantage response."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_mugrpo.algorithms.losses import policy_loss
from megatron_mugrpo.algorithms.veto import nav_triggers, veto_mask

F64 = torch.float64
# ρ per position; positions 2 and 4 are below τ_c = 1e-4, position 6 is padding.
RATIOS = [1.0, 0.5, 1e-5, 2.0, 1e-6, 1.0, 1e-7]
# Row 0: A = −1 (vetoed), row 1: A = +1 (never vetoed), row 2: A = −1 without triggers.
ADVANTAGES = torch.tensor([-1.0, 1.0, -1.0], dtype=F64)


def _example() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    log_ratio = torch.tensor([RATIOS, RATIOS, [1.0, 0.5, 0.9, 2.0, 0.7, 1.0, 1.0]], dtype=F64).log()
    mask = torch.ones_like(log_ratio)
    mask[:, 6] = 0.0
    behaviour = torch.full_like(log_ratio, -1.5)
    return behaviour + log_ratio, behaviour, ADVANTAGES, mask


# Kept positions of row 0 per scope (rows 1 and 2 always keep positions 0..5).
KEPT_ROW0 = {
    "seq": [],
    "suffix": [0, 1, 2],  # S_κ = {3, 4, 5}: strictly after κ = 2
    "nontrigger_suffix": [0, 1, 2, 4],  # H_κ = S_κ minus the trigger at 4
    "trigger": [0, 1, 3, 5],
    "none": [0, 1, 2, 3, 4, 5],
}


@pytest.mark.parametrize("scope", sorted(KEPT_ROW0))
def test_veto_mask_per_scope(scope: str) -> None:
    lp, bl, adv, mask = _example()
    keep, stats = veto_mask(lp - bl, adv, mask, scope=scope, threshold=1e-4)
    expected = torch.zeros(3, 7, dtype=torch.bool)
    expected[0, KEPT_ROW0[scope]] = True
    expected[1:, :6] = True
    assert torch.equal(keep, expected)
    assert stats["nav_trigger_count"].item() == 2
    assert stats["nav_triggered_responses"].item() == 1
    assert stats["nav_vetoed_tokens"].item() == 6 - len(KEPT_ROW0[scope])


@pytest.mark.parametrize("scope", sorted(KEPT_ROW0))
def test_mu_grpo_value_per_scope(scope: str) -> None:
    lp, bl, adv, mask = _example()
    out = policy_loss("mu_grpo", lp, bl, adv, mask, veto_scope=scope, veto_threshold=1e-4, clip_high=5.0)
    # With clip [0, 5] and ρ ≤ 5 every objective is ρA; T_y = 6 for all rows whatever the veto.
    row0 = -sum(RATIOS[t] for t in KEPT_ROW0[scope]) / 6
    row1 = sum(RATIOS[:6]) / 6
    row2 = -(1.0 + 0.5 + 0.9 + 2.0 + 0.7 + 1.0) / 6
    assert out.loss_sum.item() == pytest.approx(-(row0 + row1 + row2), abs=1e-12)
    assert out.normaliser.item() == 3.0
    assert out.metrics["nav_vetoed_frac"] == pytest.approx((6 - len(KEPT_ROW0[scope])) / 18)
    assert out.metrics["nav_trigger_count"] == 2.0


def test_triggers_need_negative_advantage_and_respect_the_mask() -> None:
    lp, bl, adv, mask = _example()
    triggers = nav_triggers(lp - bl, adv, mask, threshold=1e-4)
    expected = torch.zeros(3, 7, dtype=torch.bool)
    expected[0, [2, 4]] = True  # the padded 1e-7 at position 6 is not a trigger
    assert torch.equal(triggers, expected)
    # Raising τ_c to 0.6 makes ρ = 0.5 a trigger too: κ moves to 1.
    keep, _ = veto_mask(lp - bl, adv, mask, scope="suffix", threshold=0.6)
    assert keep[0].tolist() == [True, True] + [False] * 5


def test_veto_is_detached_and_recomputed_from_current_ratios() -> None:
    lp, bl, adv, mask = _example()
    lp = lp.clone().requires_grad_(True)
    keep, _ = veto_mask(lp - bl, adv, mask, scope="seq", threshold=1e-4)
    assert not keep.requires_grad
    # Once the collapsed tokens recover (ρ back to 1), nothing is vetoed any more.
    recovered = torch.where(torch.tensor(RATIOS) < 1e-4, bl, lp.detach())
    keep_after, stats = veto_mask(recovered - bl, adv, mask, scope="seq", threshold=1e-4)
    assert stats["nav_vetoed_tokens"].item() == 0 and keep_after[:, :6].all()


def test_per_token_advantages_only_veto_negative_tokens() -> None:
    log_ratio = torch.tensor([[0.0, math.log(1e-6), 0.0, 0.0]], dtype=F64)
    adv = torch.tensor([[1.0, -1.0, -1.0, 1.0]], dtype=F64)
    keep, _ = veto_mask(log_ratio, adv, torch.ones_like(log_ratio), scope="seq", threshold=1e-4)
    assert keep.tolist() == [[True, False, False, True]]


def test_bad_scope_and_threshold() -> None:
    lp, bl, adv, mask = _example()
    with pytest.raises(ValueError, match="unknown NAV scope 'all'"):
        veto_mask(lp - bl, adv, mask, scope="all", threshold=1e-4)
    with pytest.raises(ValueError, match=r"must be in \(0, 1\)"):
        veto_mask(lp - bl, adv, mask, scope="seq", threshold=1.5)
