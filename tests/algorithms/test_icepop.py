"""IcePop as defined (``icepop``: GRPO's clip on π_θ / π_old, weight and mask on π_old / β) against the
band on the drifting ratio (``icepop_current``): float64 hand-computed values, and the config rules."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_mugrpo.algorithms.losses import needs_old_logprobs, policy_loss
from megatron_mugrpo.config import load_config
from megatron_mugrpo.errors import ConfigError

F64 = torch.float64
L = math.log


def _case() -> tuple[torch.Tensor, ...]:
    """[B=2, T=3], float64; probabilities chosen so every factor is a short decimal.

    response 0 (A = +1, 3 tokens): β = 0.5 each; π_old = 0.5, 0.2, 0.6 → w = 1, 0.4 (< α = 0.5: masked),
        1.2; π_θ = 0.55, 0.3, 0.9 → r = 1.1, 1.5, 1.5 (token 2 clipped at 1 + ε = 1.2).
    response 1 (A = −1, 2 tokens + padding): β = 0.1; π_old = 0.6, 0.08 → w = 6 (> 5: masked), 0.8;
        π_θ = 0.6, 0.04 → r = 1, 0.5 (token 1 clipped at 1 − ε = 0.8: A < 0 keeps the clipped value).
    """
    behaviour = torch.tensor([[L(0.5), L(0.5), L(0.5)], [L(0.1), L(0.1), 0.0]], dtype=F64)
    old = torch.tensor([[L(0.5), L(0.2), L(0.6)], [L(0.6), L(0.08), 0.0]], dtype=F64)
    current = torch.tensor([[L(0.55), L(0.3), L(0.9)], [L(0.6), L(0.04), 0.0]], dtype=F64)
    advantages = torch.tensor([1.0, -1.0], dtype=F64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    return current, behaviour, old, advantages, mask


def test_icepop_hand_values_and_gradient() -> None:
    current, behaviour, old, advantages, mask = _case()
    logprobs = current.clone().requires_grad_(True)
    out = policy_loss("icepop", logprobs, behaviour, advantages, mask, old_logprobs=old, clip_eps=0.2)
    # response 0: (w·min(rA, clip(r)A)) = 1·1.1 + 0 (masked) + 1.2·1.2 = 2.54 over T_y = 3;
    # response 1: 0 (masked) + 0.8·min(−0.5, −0.8) = −0.64 over T_y = 2.
    assert out.loss_sum.item() == pytest.approx(-(2.54 / 3 - 0.64 / 2), abs=1e-14)
    assert out.normaliser.item() == 2.0  # masked tokens stay in T_y and |B|
    metrics = out.metrics
    assert metrics["icepop_masked_low_frac"] == pytest.approx(1 / 5, abs=1e-15)
    assert metrics["icepop_masked_high_frac"] == pytest.approx(1 / 5, abs=1e-15)
    assert metrics["icepop_masked_frac"] == metrics["masked_frac"] == pytest.approx(2 / 5, abs=1e-15)
    assert metrics["icepop_weight_mean"] == pytest.approx((1.0 + 1.2 + 0.8) / 5, abs=1e-14)
    assert metrics["clip_frac_high"] == pytest.approx(1 / 5) and metrics["clip_frac_low"] == pytest.approx(1 / 5)
    assert metrics["ratio_mean"] == pytest.approx((1.1 + 1.5 + 1.5 + 1.0 + 0.5) / 5, abs=1e-14)  # r's, not ρ's
    (grad,) = torch.autograd.grad(out.loss_sum, logprobs)
    # Only response 0's token 0 is kept and unclipped: d/dlogπ of −w·r·A/T_y = −1·1.1·1/3.
    expected = torch.zeros_like(current)
    expected[0, 0] = -1.1 / 3
    torch.testing.assert_close(grad, expected, rtol=1e-14, atol=1e-15)


def test_the_mask_stays_put_while_the_policy_drifts() -> None:
    """icepop's mask is on π_old / β, fixed for the stage; icepop_current's follows π_θ / β."""
    current, behaviour, old, advantages, mask = _case()
    drifted = current.clone()
    drifted[0, 0] = L(0.1)  # π_θ falls from 0.55 to 0.1 on a token both keep at first: ρ = 0.2, r = 0.2
    for lp in (current, drifted):
        out = policy_loss("icepop", lp, behaviour, advantages, mask, old_logprobs=old)
        assert out.metrics["icepop_masked_frac"] == pytest.approx(2 / 5)  # w = 0.4 and w = 6, whatever π_θ does
    # π_θ / β: 1.1, 0.6, 1.8 | 6, 0.4 → two outside [0.5, 5]; after the drift 0.2 leaves the band too.
    still = policy_loss("icepop_current", current, behaviour, advantages, mask)
    moved = policy_loss("icepop_current", drifted, behaviour, advantages, mask)
    assert still.metrics["icepop_masked_frac"] == pytest.approx(2 / 5)
    assert moved.metrics["icepop_masked_frac"] == pytest.approx(3 / 5)


def test_exact_engine_makes_icepop_grpo_on_the_old_policy() -> None:
    current, behaviour, _, advantages, mask = _case()
    out = policy_loss("icepop", current, behaviour, advantages, mask, old_logprobs=behaviour, clip_eps=0.2)
    grpo = policy_loss("grpo", current, behaviour, advantages, mask, clip_eps=0.2)
    assert out.loss_sum.item() == pytest.approx(grpo.loss_sum.item(), abs=1e-15)
    assert out.metrics["icepop_weight_mean"] == 1.0 and out.metrics["masked_frac"] == 0.0


def test_icepop_without_old_logprobs_names_the_fix() -> None:
    current, behaviour, _, advantages, mask = _case()
    with pytest.raises(ValueError, match="icepop_current"):
        policy_loss("icepop", current, behaviour, advantages, mask)
    assert needs_old_logprobs("icepop") and not needs_old_logprobs("icepop_current")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["algo.rollout_correction.tis_cap=2"], r"algo\.loss=icepop already corrects"),
        (["mode=async"], r"algo\.loss=icepop masks on π_old / β.*mode: async has no such pass"),
        (["replay.enabled=true"], r"replay\.enabled cannot be combined with algo\.loss=icepop"),
    ],
)
def test_config_refuses_what_icepop_cannot_get_old_logprobs_in(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["algo.loss=icepop", *overrides])
    cfg = load_config(None, ["algo.loss=icepop"])
    assert cfg.algo.needs_old_logprobs and not load_config(None, ["algo.loss=icepop_current"]).algo.needs_old_logprobs
