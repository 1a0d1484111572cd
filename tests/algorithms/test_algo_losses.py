"""Policy-loss family: hand-computed values, analytic gradients, micro-batch invariance, ρ = 1."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_mugrpo.algorithms.advantages import group_advantages
from megatron_mugrpo.algorithms.config import AlgoConfig
from megatron_mugrpo.algorithms.losses import (
    AGGREGATIONS,
    DEFAULT_AGGREGATION,
    LOG_RATIO_CLAMP,
    GrpoOptions,
    available_losses,
    loss_normaliser,
    m2_clip_bound,
    m2po_mask,
    m2po_mask_greedy,
    policy_loss,
    trust_region,
)
from megatron_mugrpo.algorithms.veto import veto_mask
from megatron_mugrpo.config import load_config
from megatron_mugrpo.errors import ConfigError

F64 = torch.float64
LOSSES = ("grpo", "mu_grpo", "m2po", "m2po_clip", "opsm", "icepop", "icepop_current", "gspo")


def _two_responses() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Response 0: A=+1, ρ=[1.5, 0.5, 1]; response 1: A=−2, ρ=[1.5, 0.5] + one padding slot."""
    log_ratio = torch.tensor([[math.log(1.5), math.log(0.5), 0.0], [math.log(1.5), math.log(0.5), 0.0]], dtype=F64)
    behaviour = torch.full((2, 3), -1.0, dtype=F64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=F64)
    return behaviour + log_ratio, behaviour, torch.tensor([1.0, -2.0], dtype=F64), mask


# --------------------------------------------------------------------------- hand-computed values


@pytest.mark.parametrize(
    ("aggregation", "grpo_sum", "mu_sum", "normaliser"),
    [
        # grpo: response 0 → (1.2 + 0.5 + 1)/3 = 0.9, response 1 → (−3 − 1.6)/2 = −2.3.
        # mu_grpo [0, 5]: response 0 → (1.5 + 0.5 + 1)/3 = 1, response 1 → (−3 − 1)/2 = −2.
        ("seq_mean_token_mean", -(0.9 - 2.3), -(1.0 - 2.0), 2.0),
        ("token_mean", -(2.7 - 4.6), -(3.0 - 4.0), 5.0),
    ],
)
def test_clipped_losses_hand_values(aggregation: str, grpo_sum: float, mu_sum: float, normaliser: float) -> None:
    lp, bl, adv, mask = _two_responses()
    grpo = policy_loss("grpo", lp, bl, adv, mask, clip_eps=0.2, aggregation=aggregation)
    mu = policy_loss("mu_grpo", lp, bl, adv, mask, aggregation=aggregation, veto_scope="seq")
    assert grpo.loss_sum.item() == pytest.approx(grpo_sum, abs=1e-12)
    assert mu.loss_sum.item() == pytest.approx(mu_sum, abs=1e-12)
    assert grpo.normaliser.item() == mu.normaliser.item() == normaliser
    # Clip binds on response 0 token 0 (A>0, ρ=1.5>1.2) and response 1 token 1 (A<0, ρ=0.5<0.8).
    assert grpo.metrics["clip_frac_high"] == pytest.approx(1 / 5)
    assert grpo.metrics["clip_frac_low"] == pytest.approx(1 / 5)
    assert mu.metrics["clip_frac_high"] == mu.metrics["clip_frac_low"] == 0.0
    assert grpo.metrics["ratio_mean_neg_adv"] == pytest.approx(1.0)
    assert grpo.metrics["ratio_mean_pos_adv"] == pytest.approx(1.0)
    # Ratios [0.5, 0.5, 1, 1.5, 1.5]: linear-interpolation quantiles.
    assert grpo.metrics["ratio_p01"] == pytest.approx(0.5)
    assert grpo.metrics["ratio_p50"] == pytest.approx(1.0)
    assert grpo.metrics["ratio_p99"] == pytest.approx(1.5)
    assert grpo.metrics["num_tokens"] == 5.0 and grpo.metrics["num_responses"] == 2.0


def _m2_example() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Trust-region (log ρ)²: 0.01, 0.04, 0.25 (response 0, A=+1) and 0.16 (response 1, A=−1)."""
    log_ratio = torch.tensor([[0.1, 0.2, 0.5, -0.3], [-0.4, 0.3, 0.0, 0.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]], dtype=F64)
    return log_ratio - 2.0, torch.full((2, 4), -2.0, dtype=F64), torch.tensor([1.0, -1.0], dtype=F64), mask


def test_m2po_hand_values() -> None:
    lp, bl, adv, mask = _m2_example()
    log_ratio = lp - bl
    # Greedy: mean(0.01, .04, .25, .16) = 0.115 > 0.04 → drop 0.25 → 0.07 > 0.04 → drop 0.16 → 0.025 ≤ 0.04.
    expected_mask = torch.tensor([[0, 0, 1, 0], [1, 0, 0, 0]], dtype=torch.bool)
    assert torch.equal(m2po_mask(log_ratio, adv, mask, 0.04), expected_mask)
    assert torch.equal(m2po_mask_greedy(log_ratio, adv, mask, 0.04), expected_mask)
    out = policy_loss("m2po", lp, bl, adv, mask, m2_threshold=0.04)
    response0 = (math.exp(0.1) + math.exp(0.2) + math.exp(-0.3)) / 4
    response1 = -math.exp(0.3) / 2
    assert out.loss_sum.item() == pytest.approx(-(response0 + response1), abs=1e-12)
    assert out.normaliser.item() == 2.0
    assert out.metrics["m2"] == pytest.approx(0.115)
    assert out.metrics["m2_after"] == pytest.approx(0.025)
    assert out.metrics["m2_masked_tokens"] == 2.0
    assert out.metrics["m2_masked_frac"] == pytest.approx(2 / 6)
    assert out.metrics["trust_region_frac"] == pytest.approx(4 / 6)


def test_m2po_clip_hand_values() -> None:
    lp, bl, adv, mask = _m2_example()
    # Sorted v = [.01, .04, .16, .25], budget 0.04·4 = 0.16: capping at .04 gives .01+.04·3 = .13 ≤ .16,
    # capping at .16 gives .37 > .16 → τ² = 0.04, τ = 0.2, ratio clip [e^−0.2, e^0.2].
    assert m2_clip_bound(lp - bl, adv, mask, 0.04).item() == pytest.approx(0.04)
    out = policy_loss("m2po_clip", lp, bl, adv, mask, m2_threshold=0.04)
    response0 = (math.exp(0.1) + math.exp(0.2) + math.exp(0.2) + math.exp(-0.3)) / 4
    response1 = (-math.exp(-0.2) - math.exp(0.3)) / 2
    assert out.loss_sum.item() == pytest.approx(-(response0 + response1), abs=1e-12)
    assert out.metrics["m2_clip_log_bound"] == pytest.approx(0.2)
    assert out.metrics["m2_after"] == pytest.approx((0.01 + 0.04 + 0.04 + 0.04) / 4)
    assert out.metrics["clip_frac_high"] == pytest.approx(1 / 6)
    assert out.metrics["clip_frac_low"] == pytest.approx(1 / 6)


def test_m2po_clip_no_clipping_under_budget() -> None:
    lp, bl, adv, mask = _m2_example()
    assert math.isinf(m2_clip_bound(lp - bl, adv, mask, 1.0).item())
    clipped = policy_loss("m2po_clip", lp, bl, adv, mask, m2_threshold=1.0)
    unclipped = policy_loss("m2po", lp, bl, adv, mask, m2_threshold=1.0)
    assert clipped.loss_sum.item() == pytest.approx(unclipped.loss_sum.item(), abs=1e-12)


@pytest.mark.parametrize(
    ("delta", "aggregation", "loss_sum", "normaliser"),
    [
        # Response 1 (A = −2, ρ = [1.5, 0.5]): D = −(log 1.5 + log 0.5)/2 = ½ log(4/3) ≈ 0.1438.
        (0.1, "seq_mean_token_mean", -0.9, 2.0),  # dropped: response 0 alone, (1.2 + 0.5 + 1)/3 = 0.9
        (0.1, "token_mean", -2.7, 5.0),
        (0.2, "seq_mean_token_mean", -(0.9 - 2.3), 2.0),  # kept: GRPO's value
    ],
)
def test_opsm_hand_values(delta: float, aggregation: str, loss_sum: float, normaliser: float) -> None:
    lp, bl, adv, mask = _two_responses()
    lp.requires_grad_(True)
    out = policy_loss("opsm", lp, bl, adv, mask, clip_eps=0.2, delta=delta, aggregation=aggregation)
    assert out.loss_sum.item() == pytest.approx(loss_sum, abs=1e-12)
    assert out.normaliser.item() == normaliser
    dropped = delta < 0.1438
    assert out.metrics["opsm_masked_responses"] == float(dropped)
    assert out.metrics["opsm_masked_frac"] == out.metrics["masked_frac"] == pytest.approx(0.4 if dropped else 0.0)
    assert out.metrics["opsm_divergence_neg_adv"] == pytest.approx(0.5 * math.log(4 / 3), abs=1e-12)
    assert out.metrics["clip_frac_low"] == pytest.approx(0.0 if dropped else 0.2)  # kept tokens only
    if delta == 0.1 and aggregation == "seq_mean_token_mean":
        (grad,) = torch.autograd.grad(out.loss_sum, lp)
        # Response 0: token 0 clipped (ρ = 1.5 > 1.2), tokens 1, 2 give −ρA/3; response 1 dropped.
        expected = torch.tensor([[0.0, -0.5 / 3, -1 / 3], [0.0, 0.0, 0.0]], dtype=F64)
        torch.testing.assert_close(grad, expected, rtol=0, atol=1e-15)


def test_opsm_never_drops_positive_advantage_responses() -> None:
    _, bl, _, mask = _two_responses()
    collapsed = bl - 5.0 * mask  # D = 5 on both responses
    out = policy_loss("opsm", collapsed, bl, torch.tensor([1.0, 1.0], dtype=F64), mask, delta=1e-4)
    assert out.metrics["opsm_masked_responses"] == 0.0 and math.isnan(out.metrics["opsm_divergence_neg_adv"])


@pytest.mark.parametrize(
    ("band", "loss_sum", "low_frac", "high_frac"),
    [
        # [0.4, 1.4] masks the ρ = 1.5 tokens: response 0 → (0.5 + 1)/3 = 0.5, response 1 → −1.6/2 = −0.8
        # (GRPO would count response 1's ρ = 1.5 token as −3: a negative-advantage token it cannot clip).
        ((0.4, 1.4), -(0.5 - 0.8), 0.0, 0.4),
        # [0.6, 5] masks the ρ = 0.5 tokens: response 0 → (1.2 + 1)/3, response 1 → −3/2.
        ((0.6, 5.0), -(2.2 / 3 - 1.5), 0.4, 0.0),
    ],
)
def test_icepop_current_hand_values(
    band: tuple[float, float], loss_sum: float, low_frac: float, high_frac: float
) -> None:
    lp, bl, adv, mask = _two_responses()
    out = policy_loss("icepop_current", lp, bl, adv, mask, clip_eps=0.2, band_low=band[0], band_high=band[1])
    assert out.loss_sum.item() == pytest.approx(loss_sum, abs=1e-12)
    assert out.normaliser.item() == 2.0  # masked tokens stay in T_y and |B|
    assert out.metrics["icepop_masked_low_frac"] == pytest.approx(low_frac)
    assert out.metrics["icepop_masked_high_frac"] == pytest.approx(high_frac)
    assert out.metrics["icepop_masked_frac"] == out.metrics["masked_frac"] == pytest.approx(0.4)


def test_gspo_hand_values_and_gradient() -> None:
    """s_0 = (1.5 · 0.5 · 1)^(1/3) = 0.75^(1/3) ≈ 0.9086 (A = +1), s_1 = 0.75^(1/2) ≈ 0.8660 (A = −2).
    Clip [0.8, 1.2]: neither binds: loss_sum = −(s_0 − 2 s_1). Paper clip [1 − 3e-4, 1 + 4e-4]:
    s_1 is clipped low (A < 0): −2 · 0.9997, zero gradient; s_0 < 1 with A > 0 is not clipped.
    The gradient of response 0 is GSPO's, ∂(−s_0)/∂log π_t = −s_0 / 3 on each of its tokens."""
    lp, bl, adv, mask = _two_responses()
    s0, s1 = 0.75 ** (1 / 3), 0.75**0.5
    wide = policy_loss("gspo", lp, bl, adv, mask, clip_eps_low=0.2, clip_eps_high=0.2)
    assert wide.loss_sum.item() == pytest.approx(-(s0 - 2 * s1), abs=1e-12)
    assert wide.metrics["seq_clip_frac"] == 0.0
    assert wide.metrics["seq_ratio_mean"] == pytest.approx((s0 + s1) / 2, abs=1e-12)
    current = lp.clone().requires_grad_(True)
    paper = policy_loss("gspo", current, bl, adv, mask)  # defaults 3e-4 / 4e-4
    assert paper.loss_sum.item() == pytest.approx(-(s0 - 2 * (1 - 3e-4)), abs=1e-12)
    assert paper.metrics["seq_clip_frac"] == 0.5
    assert paper.metrics["clip_frac_low"] == pytest.approx(2 / 5) and paper.metrics["clip_frac_high"] == 0.0
    (grad,) = torch.autograd.grad(paper.loss_sum, current)
    torch.testing.assert_close(grad, torch.tensor([[-s0 / 3] * 3, [0.0] * 3], dtype=F64), rtol=0, atol=1e-15)
    token_mean = policy_loss("gspo", lp, bl, adv, mask, clip_eps_low=0.2, clip_eps_high=0.2, aggregation="token_mean")
    assert token_mean.loss_sum.item() == pytest.approx(-(3 * s0 - 2 * 2 * s1), abs=1e-12)


def _dual_clip_example() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Response 0: A = −1, ρ = [10, 2, 0.5]; response 1: A = +1, ρ = [10] + two padding slots."""
    log_ratio = torch.tensor([[math.log(10.0), math.log(2.0), math.log(0.5)], [math.log(10.0), 0.0, 0.0]], dtype=F64)
    behaviour = torch.full((2, 3), -2.0, dtype=F64)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=F64)
    return behaviour + log_ratio, behaviour, torch.tensor([-1.0, 1.0], dtype=F64), mask


def test_grpo_dual_clip_hand_values() -> None:
    """ε = 0.2. Response 0 (A = −1): ρ = 10 → min(−10, −1.2) = −10, dual clip c = 3 floors it at −3
    (no gradient); ρ = 2 → −2 (below c: unchanged, gradient ρA = −2); ρ = 0.5 → −0.8 (clipped).
    Response 1 (A = +1, ρ = 10): 1.2 either way (the dual clip is for A < 0 only).
    seq_mean_token_mean: without −((−10 − 2 − 0.8)/3 + 1.2) = 3.0667, with −((−3 − 2 − 0.8)/3 + 1.2) = 0.7333."""
    lp, bl, adv, mask = _dual_clip_example()
    plain_lp, dual_lp = lp.clone().requires_grad_(True), lp.clone().requires_grad_(True)
    plain = policy_loss("grpo", plain_lp, bl, adv, mask, clip_eps=0.2)
    dual = policy_loss("grpo", dual_lp, bl, adv, mask, clip_eps=0.2, dual_clip_c=3.0)
    assert plain.loss_sum.item() == pytest.approx(12.8 / 3 - 1.2, abs=1e-12)
    assert dual.loss_sum.item() == pytest.approx(5.8 / 3 - 1.2, abs=1e-12)
    assert "dual_clip_frac" not in plain.metrics
    assert dual.metrics["dual_clip_frac"] == pytest.approx(1 / 4)
    (plain_grad,) = torch.autograd.grad(plain.loss_sum, plain_lp)
    (dual_grad,) = torch.autograd.grad(dual.loss_sum, dual_lp)
    torch.testing.assert_close(
        plain_grad, torch.tensor([[10 / 3, 2 / 3, 0.0], [0.0] * 3], dtype=F64), rtol=0, atol=1e-14
    )
    torch.testing.assert_close(dual_grad, torch.tensor([[0.0, 2 / 3, 0.0], [0.0] * 3], dtype=F64), rtol=0, atol=1e-14)


def test_new_options_are_validated_naming_the_key() -> None:
    lp, bl, adv, mask = _two_responses()
    for name, bad, message in [
        ("grpo", {"dual_clip_c": 0.5}, r"algo\.grpo\.dual_clip_c=0\.5 must be 0 \(off\) or > 1"),
        ("opsm", {"delta": -1.0}, r"algo\.opsm\.delta=-1\.0 must be >= 0"),
        ("icepop", {"band_low": 1.2}, r"algo\.icepop band \[band_low=1\.2, band_high=5\.0\]"),
        ("icepop_current", {"band_high": 0.9}, r"algo\.icepop_current band \[band_low=0\.5, band_high=0\.9\]"),
        ("gspo", {"clip_eps_low": 0.0}, r"algo\.gspo\.clip_eps_low=0\.0 must be in \(0, 1\)"),
    ]:
        with pytest.raises(ConfigError, match=message):
            policy_loss(name, lp, bl, adv, mask, **bad)
        with pytest.raises(ConfigError, match=message):
            load_config(None, [f"algo.loss={name}", *(f"algo.{name}.{k}={v}" for k, v in bad.items())])


# --------------------------------------------------------------------------- conventions (docs/method.md)


def test_conventions_we_differ_from_verl_on() -> None:
    """Each row of docs/method.md's table "Conventions against verl 0.9.1", pinned."""
    cfg = load_config(None)
    # Dual clip: off by default (verl: clip_ratio_c = 3); an extreme negative-advantage ratio is not capped.
    assert GrpoOptions().dual_clip_c == 0.0 and load_config(None, ["algo.loss=grpo"]).algo.grpo.dual_clip_c == 0.0
    lp, bl, adv, mask = _dual_clip_example()
    assert policy_loss("grpo", lp, bl, adv, mask, **AlgoConfig(loss="grpo").loss_options()).loss_sum.item() > 3.0
    # Default aggregation: the paper's per-response token mean, averaged over responses (verl: token-mean).
    assert cfg.algo.aggregation == DEFAULT_AGGREGATION == "seq_mean_token_mean"
    # Single-response groups: advantage 0 (verl: the raw reward).
    advantages, _ = group_advantages(torch.tensor([1.0, 1.0, 0.0]), torch.tensor([0, 1, 1]), eps=1e-6)
    assert advantages[0].item() == 0.0 and advantages[1].item() > 0
    # The mismatch mask: masked tokens stay in the normaliser by default (verl's rejection sampling removes them).
    assert cfg.algo.rollout_correction.mask_mode == "zero_weight"
    # Correction level: token by default (verl's default is sequence level).
    assert cfg.algo.rollout_correction.level == "token"


# --------------------------------------------------------------------------- random inputs


def _random_batch(
    seed: int, batch: int = 8, length: int = 12, spread: float = 0.6
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random float64 batch with padding, A of both signs and a few collapsed (ρ ≈ 1e-6) tokens."""
    g = torch.Generator().manual_seed(seed)
    behaviour = -torch.rand(batch, length, generator=g, dtype=F64) * 3
    log_ratio = torch.randn(batch, length, generator=g, dtype=F64) * spread
    collapsed = torch.rand(batch, length, generator=g) < 0.08
    log_ratio = torch.where(collapsed, torch.full_like(log_ratio, -14.0), log_ratio)
    lengths = torch.randint(1, length + 1, (batch,), generator=g)
    mask = (torch.arange(length)[None, :] < lengths[:, None]).to(F64)
    advantages = torch.randn(batch, generator=g, dtype=F64)
    advantages[0] = -advantages[0].abs() - 0.1  # response 0 always holds a NAV trigger
    log_ratio[0, 0] = -14.0
    return behaviour + log_ratio, behaviour, advantages, mask


OPTIONS = {
    "grpo": {"clip_eps": 0.2},
    "mu_grpo": {"clip_low": 0.0, "clip_high": 5.0, "veto_scope": "seq", "veto_threshold": 1e-4},
    "m2po": {"m2_threshold": 0.04},
    "m2po_clip": {"m2_threshold": 0.04},
    "opsm": {"clip_eps": 0.2, "delta": 0.05},
    "icepop": {"clip_eps": 0.2, "band_low": 0.5, "band_high": 5.0},
    "icepop_current": {"clip_eps": 0.2, "band_low": 0.5, "band_high": 5.0},
    "gspo": {"clip_eps_low": 0.05, "clip_eps_high": 0.05},
}


def _analytic_grad(name: str, lp, bl, adv, mask, aggregation: str) -> torch.Tensor:
    """d(Σ loss_sum / Σ normaliser)/d logprobs from the formula: −w_y · kept · unclipped · ρ_t A_t
    (GSPO: ρ_t is the response's s_y and the clip decision is s_y's; icepop is given π_old = β, so w = 1
    and it is GRPO's: its own mismatch weighting is tests/algorithms/test_icepop.py's)."""
    log_ratio = torch.where(mask.bool(), lp - bl, 0.0)
    rho, a, m = log_ratio.exp(), adv[:, None].expand_as(lp), mask.bool()
    kept, low, high = m, 0.0, math.inf
    lengths = mask.sum(-1, keepdim=True)
    if name in ("grpo", "opsm", "icepop", "icepop_current"):
        low, high = 0.8, 1.2
    if name == "opsm":  # drop negative-advantage responses whose mean log(β/π_θ) exceeds δ = 0.05
        divergence = -log_ratio.sum(-1, keepdim=True) / lengths.clamp_min(1)
        kept = m & ~((a < 0) & (divergence > 0.05))
    elif name == "icepop_current":
        kept = m & (rho >= 0.5) & (rho <= 5.0)
    elif name == "gspo":
        rho = (log_ratio.sum(-1, keepdim=True) / lengths.clamp_min(1)).exp().expand_as(lp)
        low, high = 0.95, 1.05
    elif name == "mu_grpo":
        low, high = 0.0, 5.0
        kept = veto_mask(log_ratio, adv, mask, scope="seq", threshold=1e-4)[0]
    elif name == "m2po":
        kept = m & ~m2po_mask_greedy(log_ratio, adv, mask, 0.04)
    elif name == "m2po_clip":
        # Same float64 ops as the loss, so the breakpoint token (|log ρ| = τ) compares identically.
        tau = torch.tensor(_brute_force_tau_sq(log_ratio, adv, mask, 0.04), dtype=F64).sqrt()
        tau = tau.clamp(max=LOG_RATIO_CLAMP)
        low, high = torch.exp(-tau), torch.exp(tau)
    unclipped = ~(((a < 0) & (rho < low)) | ((a > 0) & (rho > high)))
    if aggregation == "seq_mean_token_mean":
        weight = 1.0 / (lengths.clamp_min(1) * (lengths > 0).sum())
    else:
        weight = torch.full_like(lengths, 1.0 / mask.sum())
    return -(weight * kept * unclipped * rho * a)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_autograd_matches_analytic_gradient(name: str, aggregation: str) -> None:
    for seed in range(3):
        lp, bl, adv, mask = _random_batch(seed)
        lp.requires_grad_(True)
        out = policy_loss(name, lp, bl, adv, mask, aggregation=aggregation, old_logprobs=bl, **OPTIONS[name])
        (grad,) = torch.autograd.grad(out.loss_sum / out.normaliser, lp)
        expected = _analytic_grad(name, lp.detach(), bl, adv, mask, aggregation)
        torch.testing.assert_close(grad, expected, rtol=1e-10, atol=1e-13)
        assert out.normaliser.requires_grad is False


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("name", ["grpo", "mu_grpo", "opsm", "icepop", "icepop_current", "gspo"])
def test_eight_micro_batches_of_one_equal_one_batch_of_eight(name: str, aggregation: str) -> None:
    lp, bl, adv, mask = _random_batch(seed=7)
    full = lp.clone().requires_grad_(True)
    out = policy_loss(name, full, bl, adv, mask, aggregation=aggregation, old_logprobs=bl, **OPTIONS[name])
    (out.loss_sum / out.normaliser).backward()

    split = lp.clone().requires_grad_(True)
    parts = [
        policy_loss(
            name,
            split[i : i + 1],
            bl[i : i + 1],
            adv[i : i + 1],
            mask[i : i + 1],
            aggregation=aggregation,
            old_logprobs=bl[i : i + 1],
            **OPTIONS[name],
        )
        for i in range(8)
    ]
    total_normaliser = sum(p.normaliser for p in parts)
    (sum(p.loss_sum for p in parts) / total_normaliser).backward()

    assert out.metrics.get("nav_trigger_count", 1.0) > 0, "the example must exercise NAV"
    torch.testing.assert_close(total_normaliser, out.normaliser)
    torch.testing.assert_close(total_normaliser, loss_normaliser(mask, aggregation, F64))
    torch.testing.assert_close(split.grad, full.grad, rtol=1e-12, atol=1e-15)


def test_all_losses_agree_with_plain_policy_gradient_at_ratio_one() -> None:
    lp, _, adv, mask = _random_batch(seed=3)
    lengths = mask.sum(-1)
    plain_lp = lp.clone().requires_grad_(True)
    # REINFORCE with the paper's aggregation: −(1/|B|) Σ_y (1/T_y) Σ_t m_t A_y log π_t.
    plain = -((plain_lp * mask * adv[:, None]).sum(-1) / lengths).mean()
    (plain_grad,) = torch.autograd.grad(plain, plain_lp)
    values = {}
    for name in OPTIONS:
        current = lp.clone().requires_grad_(True)
        out = policy_loss(name, current, lp, adv, mask, old_logprobs=lp, **OPTIONS[name])
        (grad,) = torch.autograd.grad(out.loss_sum / out.normaliser, current)
        torch.testing.assert_close(grad, plain_grad, rtol=1e-12, atol=1e-15)
        values[name] = out.loss_sum.item()
        assert out.metrics["logprob_gap_abs_max"] == 0.0
    # At ρ = 1 every surrogate equals A: the loss is −mean_y A_y.
    for value in values.values():
        assert value == pytest.approx(-adv.sum().item(), abs=1e-12)


# --------------------------------------------------------------------------- M2PO internals


def _brute_force_tau_sq(log_ratio, adv, mask, threshold: float) -> float:
    values = (log_ratio[trust_region(log_ratio, adv, mask)] ** 2).tolist()
    if not values or sum(values) / len(values) <= threshold:
        return math.inf
    fits = [t for t in values if sum(min(v, t) for v in values) / len(values) <= threshold]
    return max(fits, default=0.0)


@pytest.mark.parametrize("threshold", [0.01, 0.04, 0.2])
def test_m2po_greedy_and_vectorised_agree_and_meet_budget(threshold: float) -> None:
    for seed in range(20):
        lp, bl, adv, mask = _random_batch(seed, batch=6, length=10, spread=0.4)
        log_ratio = torch.where(mask.bool(), lp - bl, 0.0)
        greedy = m2po_mask_greedy(log_ratio, adv, mask, threshold)
        fast = m2po_mask(log_ratio, adv, mask, threshold)
        assert torch.equal(greedy, fast), f"seed {seed}"
        region = trust_region(log_ratio, adv, mask)
        remaining = log_ratio[region & ~fast] ** 2
        if remaining.numel():
            assert remaining.mean().item() <= threshold
        # Minimal: un-masking the smallest masked token would break the budget.
        if fast.any():
            smallest = (log_ratio[fast] ** 2).min()
            assert torch.cat([remaining, smallest[None]]).mean().item() > threshold
        assert m2_clip_bound(log_ratio, adv, mask, threshold).item() == _brute_force_tau_sq(
            log_ratio, adv, mask, threshold
        )


def test_m2po_vectorised_matches_greedy_with_ties() -> None:
    log_ratio = torch.tensor([[0.5, 0.5, -0.5, 0.1], [0.5, -0.5, 0.2, 0.0]], dtype=F64)
    adv = torch.tensor([[1.0, 1.0, -1.0, 1.0], [1.0, -1.0, 1.0, 0.0]], dtype=F64)
    mask = torch.ones_like(log_ratio)
    assert torch.equal(m2po_mask(log_ratio, adv, mask, 0.05), m2po_mask_greedy(log_ratio, adv, mask, 0.05))


# --------------------------------------------------------------------------- contract and safety


def test_registry_matches_config_and_takes_loss_options() -> None:
    assert set(available_losses()) == set(LOSSES)
    lp, bl, adv, mask = _random_batch(seed=1)
    for name in LOSSES:
        out = policy_loss(name, lp, bl, adv, mask, old_logprobs=bl, **AlgoConfig(loss=name).loss_options())
        loss_sum, normaliser, _ = out
        assert loss_sum.dim() == 0 and normaliser.dim() == 0
        assert all(isinstance(v, float) and math.isfinite(v) for v in out.metrics.values()), out.metrics


def test_bad_inputs_name_the_problem() -> None:
    lp, bl, adv, mask = _random_batch(seed=2)
    with pytest.raises(ValueError, match="unknown policy loss 'ppo'"):
        policy_loss("ppo", lp, bl, adv, mask)
    with pytest.raises(TypeError, match="does not take option"):
        policy_loss("grpo", lp, bl, adv, mask, clip_high=5.0)
    with pytest.raises(ValueError, match="behaviour_logprobs has shape"):
        policy_loss("grpo", lp, bl[:, :-1], adv, mask)
    with pytest.raises(ValueError, match="advantages has shape"):
        policy_loss("grpo", lp, bl, adv[:-1], mask)
    with pytest.raises(ValueError, match="unknown aggregation"):
        policy_loss("grpo", lp, bl, adv, mask, aggregation="sum")
    with pytest.raises(ValueError, match=r"veto_scope='prefix' is unknown"):
        policy_loss("mu_grpo", lp, bl, adv, mask, veto_scope="prefix")


def test_padding_garbage_and_extreme_ratios_stay_finite() -> None:
    lp, bl, adv, mask = _random_batch(seed=4)
    lp = torch.where(mask.bool(), lp, torch.tensor(-math.inf, dtype=F64))
    lp[0, 0] = bl[0, 0] + 80.0  # exp(80) overflows float32: must be clamped, not inf
    for name in LOSSES:
        current = lp.to(torch.float32).requires_grad_(True)
        options = AlgoConfig(loss=name).loss_options()
        out = policy_loss(name, current, bl.float(), adv.float(), mask.float(), old_logprobs=bl.float(), **options)
        out.loss_sum.backward()
        assert torch.isfinite(out.loss_sum) and torch.isfinite(current.grad).all(), name
        assert out.metrics["log_ratio_clamped_frac"] > 0
        assert out.metrics["ratio_p99"] <= math.exp(LOG_RATIO_CLAMP) * (1 + 1e-6)


def test_per_token_advantages_equal_broadcast_ones() -> None:
    lp, bl, adv, mask = _random_batch(seed=5)
    for name in LOSSES:
        per_response = policy_loss(name, lp, bl, adv, mask, old_logprobs=bl, **OPTIONS[name])
        per_token = policy_loss(
            name, lp, bl, adv[:, None].expand_as(lp).clone(), mask, old_logprobs=bl, **OPTIONS[name]
        )
        assert per_token.loss_sum.item() == pytest.approx(per_response.loss_sum.item(), abs=1e-12)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: checks the losses on GPU against CPU")
def test_cuda_matches_cpu() -> None:
    lp, bl, adv, mask = _random_batch(seed=6, batch=16, length=64)
    for name in LOSSES:
        options = AlgoConfig(loss=name).loss_options()
        results = []
        for device in ("cpu", "cuda"):
            current = lp.to(device=device, dtype=torch.float32).requires_grad_(True)
            old = bl.float().to(device)
            out = policy_loss(name, current, old, adv.float().to(device), mask.to(device), old_logprobs=old, **options)
            out.loss_sum.backward()
            results.append((out.loss_sum.detach().cpu(), current.grad.cpu(), out.metrics))
        (cpu_loss, cpu_grad, cpu_metrics), (gpu_loss, gpu_grad, gpu_metrics) = results
        torch.testing.assert_close(gpu_loss, cpu_loss, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(gpu_grad, cpu_grad, rtol=1e-5, atol=1e-7)
        assert gpu_metrics.keys() == cpu_metrics.keys()
