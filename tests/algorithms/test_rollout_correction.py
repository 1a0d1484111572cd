"""Rollout correction and mismatch metrics: hand-computed weights and losses, the identity when off,
an invariance of the exact (untruncated) factor, and the metrics on a known pair of models."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import PreTrainedModel

from megatron_mugrpo.algorithms.losses import available_losses, needs_old_logprobs, policy_loss, update_inputs
from megatron_mugrpo.algorithms.rollout_correction import (
    RolloutCorrectionConfig,
    corrected_policy_loss,
    correction_inputs,
    correction_weights,
    mismatch_metrics,
)
from megatron_mugrpo.config import load_config
from megatron_mugrpo.errors import ConfigError, InputError
from megatron_mugrpo.records import RolloutGroup, RolloutSample
from megatron_mugrpo.rollout.engine import SamplingParams
from megatron_mugrpo.rollout.transformers_engine import TransformersEngine, teacher_forced_logprobs
from megatron_mugrpo.training.stage_reference import group_mismatch_metrics
from megatron_mugrpo.training.tiny import tiny_model

LOG = math.log
D = torch.float64


def _t(*rows):
    return torch.tensor(rows, dtype=D)


def _ratio(part) -> float:
    """A (numerator, denominator) diagnostic as its value."""
    return float(part[0] / part[1])


def test_off_by_default_and_validated():
    cfg = load_config(None)
    assert not cfg.algo.rollout_correction.enabled
    assert load_config(None, ["algo.rollout_correction.tis_cap=2"]).algo.rollout_correction.enabled
    for bad in ({"tis_cap": 0.5}, {"mask_bound": 1.0}, {"mismatch_groups": -1}):
        with pytest.raises(ConfigError) as info:
            RolloutCorrectionConfig(**bad)
        assert isinstance(info.value, InputError) and "algo.rollout_correction." in str(info.value)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["algo.rollout_correction.level=seq", "algo.rollout_correction.tis_cap=2"], r"level='seq' is unknown"),
        (["algo.rollout_correction.level=sequence"], r"level='sequence' corrects nothing by itself: set .*tis_cap"),
        (["algo.rollout_correction.mask_mode=drop", "algo.rollout_correction.mask_bound=8"], r"mask_mode='drop'"),
        (["algo.rollout_correction.mask_mode=reject"], r"mask_mode='reject' needs a mask: set .*mask_bound"),
    ],
)
def test_level_and_mask_mode_are_validated(overrides, message):
    with pytest.raises(ConfigError, match=r"algo\.rollout_correction\." + message):
        load_config(None, overrides)
    cfg = load_config(
        None,
        [
            "algo.rollout_correction.level=sequence",
            "algo.rollout_correction.mask_bound=8",
            "algo.rollout_correction.mask_mode=reject",
        ],
    ).algo.rollout_correction
    assert cfg.loss_options() == {"tis_cap": 0.0, "mask_bound": 8.0, "mask_mode": "reject", "level": "sequence"}


def test_truncated_weights_by_hand():
    # w = π_old / β = [3, 0.5, 1, 1.5]; cap 2 → [2, 0.5, 1, 1.5]; the last position is padding.
    old = _t([LOG(3.0), LOG(0.5), 0.0, LOG(1.5), 9.0])
    behaviour = torch.zeros_like(old)
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    weights, _, metrics = correction_weights(old, behaviour, mask, tis_cap=2.0)
    torch.testing.assert_close(weights, _t([2.0, 0.5, 1.0, 1.5, 0.0]))
    assert _ratio(metrics["rollout_corr_truncated_frac"]) == pytest.approx(0.25)
    assert _ratio(metrics["rollout_corr_masked_frac"]) == 0.0
    assert _ratio(metrics["rollout_corr_weight_mean"]) == pytest.approx(5.0 / 4)


def test_mask_by_hand():
    # c = 2 keeps w in [0.5, 2]: w = [3, 0.4, 1, 1.5, 0.5] → [0, 0, 1, 1.5, 0.5] (the factor itself where kept).
    old = _t([LOG(3.0), LOG(0.4), 0.0, LOG(1.5), LOG(0.5)])
    weights, _, metrics = correction_weights(old, torch.zeros_like(old), torch.ones_like(old), mask_bound=2.0)
    torch.testing.assert_close(weights, _t([0.0, 0.0, 1.0, 1.5, 0.5]))
    assert _ratio(metrics["rollout_corr_masked_frac"]) == pytest.approx(0.4)


def test_truncation_and_mask_together_by_hand():
    # cap 1.2, c = 2: w = [3 → masked, 1.5 → 1.2, 1, 0.6]
    old = _t([LOG(3.0), LOG(1.5), 0.0, LOG(0.6)])
    weights, _, _ = correction_weights(old, torch.zeros_like(old), torch.ones_like(old), tis_cap=1.2, mask_bound=2.0)
    torch.testing.assert_close(weights, _t([0.0, 1.2, 1.0, 0.6]))


def test_sequence_level_weights_by_hand():
    """Row 0: w = [4, 1], geometric mean 2; row 1: w = [1/2, 1/8] + padding, geometric mean 1/4.
    Cap 1.5 and bound 3 act on the response's factor: row 0 → 1.5 on both tokens, row 1 (1/4 < 1/3)
    masked as a whole. At token level the same bound would instead mask w = 4 and w = 1/8."""
    old = _t([LOG(4.0), 0.0, 0.0], [LOG(0.5), LOG(0.125), 5.0])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    seq = correction_weights(old, torch.zeros_like(old), mask, tis_cap=1.5, mask_bound=3.0, level="sequence")
    torch.testing.assert_close(seq.weights, _t([1.5, 1.5, 0.0], [0.0, 0.0, 0.0]))
    assert seq.kept.tolist() == [[True, True, False], [False, False, False]]
    assert _ratio(seq.stats["rollout_corr_truncated_frac"]) == pytest.approx(0.5)
    assert _ratio(seq.stats["rollout_corr_masked_frac"]) == pytest.approx(0.5)
    exact = correction_weights(old, torch.zeros_like(old), mask, mask_bound=3.0, level="sequence")
    torch.testing.assert_close(exact.weights, _t([2.0, 2.0, 0.0], [0.0, 0.0, 0.0]))  # the factor w_y where kept
    token = correction_weights(old, torch.zeros_like(old), mask, mask_bound=3.0)
    torch.testing.assert_close(token.weights, _t([0.0, 1.0, 0.0], [0.5, 0.0, 0.0]))


def test_sequence_level_corrected_grpo_by_hand():
    """One response, A = 1, π_old = 1, β = [1/4, 1]: w = [4, 1], w_y = 2, capped at 1.5 on both tokens.
    π_θ / π_old = [1.1, 1.3], clip [0.8, 1.2]: objectives 1.5 · 1.1 = 1.65 and 1.5 · 1.2 = 1.8;
    loss_sum = −(1.65 + 1.8) / 2 = −1.725; d/dlogπ_1 = −1.65 / 2, token 2 clipped (0).
    At token level the weights would be [1.5, 1]: −(1.65 + 1.2) / 2 = −1.425."""
    logprobs = _t([LOG(1.1), LOG(1.3)]).requires_grad_()
    behaviour, old, adv, mask = _t([LOG(0.25), 0.0]), _t([0.0, 0.0]), torch.tensor([1.0], dtype=D), torch.ones(1, 2)
    out = corrected_policy_loss("grpo", logprobs, behaviour, adv, mask, old_logprobs=old, tis_cap=1.5, level="sequence")
    assert float(out.loss_sum) == pytest.approx(-1.725)
    out.loss_sum.backward()
    torch.testing.assert_close(logprobs.grad, _t([-0.825, 0.0]))
    assert out.metrics["rollout_corr_truncated_frac"] == 1.0
    token = corrected_policy_loss("grpo", logprobs, behaviour, adv, mask, old_logprobs=old, tis_cap=1.5)
    assert float(token.loss_sum) == pytest.approx(-1.425)


@pytest.mark.parametrize(
    ("aggregation", "mode", "loss_sum", "normaliser"),
    [
        # Row 0 (A = 1, w = [3, 1], ratio 1.1): the first token is masked; row 1 (A = −1, w = [5, 5]) entirely.
        ("seq_mean_token_mean", "zero_weight", -(0 + 1.1) / 2, 2.0),  # T_0 = 2, |B| = 2
        ("seq_mean_token_mean", "reject", -1.1 / 1, 1.0),  # T_0 = 1, row 1 left |B|
        ("token_mean", "zero_weight", -1.1, 4.0),
        ("token_mean", "reject", -1.1, 1.0),
    ],
)
def test_zero_weight_keeps_the_normaliser_and_reject_removes_from_it(aggregation, mode, loss_sum, normaliser):
    logprobs = _t([LOG(1.1), LOG(1.1)], [LOG(0.9), LOG(0.9)])
    old = torch.zeros(2, 2, dtype=D)
    behaviour = _t([LOG(1 / 3), 0.0], [LOG(0.2), LOG(0.2)])  # w = π_old / β = [3, 1], [5, 5]
    adv, mask = torch.tensor([1.0, -1.0], dtype=D), torch.ones(2, 2)
    out = corrected_policy_loss(
        "grpo",
        logprobs,
        behaviour,
        adv,
        mask,
        old_logprobs=old,
        mask_bound=2.0,
        mask_mode=mode,
        aggregation=aggregation,
    )
    assert float(out.loss_sum) == pytest.approx(loss_sum)
    assert float(out.normaliser) == normaliser
    assert out.metrics["rollout_corr_masked_frac"] == pytest.approx(3 / 4)


@pytest.mark.parametrize("name", ["m2po", "m2po_clip"])
def test_update_pass_on_the_full_mask_matches_the_rejected_one(name):
    """train_step gives M2PO's update pass the batch's full response mask; under mask_mode: reject the
    loss sees the mask less the rejected tokens. A rejected token's advantage is 0 (weight 0), so it is
    outside the trust region and the pass's mask or bound, hence the loss, comes out the same."""
    gen = torch.Generator().manual_seed(3)
    logprobs = -torch.rand(6, 8, generator=gen, dtype=D) * 2
    behaviour = logprobs + torch.randn(6, 8, generator=gen, dtype=D) * 0.5
    old = behaviour + torch.randn(6, 8, generator=gen, dtype=D) * 0.8
    adv, mask = torch.randn(6, generator=gen, dtype=D), torch.ones(6, 8)
    caps = {"mask_bound": 2.0, "mask_mode": "reject"}
    anchor, weighted, stats = correction_inputs(behaviour, adv, mask, old_logprobs=old, **caps)
    assert 0.1 < _ratio(stats["rollout_corr_masked_frac"]) < 0.9, "the example must reject some tokens"
    kept = mask.bool() & (weighted != 0)
    full = update_inputs(name, logprobs, anchor, weighted, mask, m2_threshold=0.01)
    reduced = update_inputs(name, logprobs, anchor, weighted, kept, m2_threshold=0.01)
    for key in full:
        torch.testing.assert_close(full[key], reduced[key])
    with_pass = corrected_policy_loss(
        name, logprobs, behaviour, adv, mask, old_logprobs=old, update_inputs=full, m2_threshold=0.01, **caps
    )
    own_pass = corrected_policy_loss(name, logprobs, behaviour, adv, mask, old_logprobs=old, m2_threshold=0.01, **caps)
    torch.testing.assert_close(with_pass.loss_sum, own_pass.loss_sum)


def test_corrected_grpo_loss_and_gradient_by_hand():
    """One response, A = 1, π_old = 1 (log 0) per token, β = [1/3, 2]: w = [3, 0.5], capped at 2 → [2, 0.5].
    π_θ / π_old = [1.1, 1.3], clip [0.8, 1.2]: objectives 2 · 1.1 = 2.2 and 0.5 · min(1.3, 1.2) = 0.6.
    seq-mean-token-mean: loss_sum = −(2.2 + 0.6) / 2 = −1.4; d/dlogπ_1 = −2.2 / 2, token 2 is clipped (0)."""
    logprobs = _t([LOG(1.1), LOG(1.3)]).requires_grad_()
    behaviour, old = _t([LOG(1 / 3), LOG(2.0)]), _t([0.0, 0.0])
    out = corrected_policy_loss(
        "grpo", logprobs, behaviour, torch.tensor([1.0], dtype=D), torch.ones(1, 2), old_logprobs=old, tis_cap=2.0
    )
    assert float(out.loss_sum) == pytest.approx(-1.4)
    assert float(out.normaliser) == 1.0
    out.loss_sum.backward()
    torch.testing.assert_close(logprobs.grad, _t([-1.1, 0.0]))
    assert out.metrics["rollout_corr_truncated_frac"] == pytest.approx(0.5)
    assert out.metrics["clip_frac_high"] == pytest.approx(0.5)


def test_masked_tokens_stay_in_the_normaliser_and_cannot_trigger_nav():
    """A negative-advantage token whose π_θ collapsed would veto the whole response (NAV, seq scope);
    when the mismatch mask drops it, the other token still trains and T_y still counts both."""
    logprobs = _t([LOG(1e-6), LOG(0.9)]).requires_grad_()
    old = _t([0.0, 0.0])
    behaviour = _t([LOG(10.0), 0.0])  # w = [0.1, 1]: the first token leaves [1/2, 2]
    adv = torch.tensor([-1.0], dtype=D)
    out = corrected_policy_loss("mu_grpo", logprobs, behaviour, adv, torch.ones(1, 2), old_logprobs=old, mask_bound=2.0)
    assert out.metrics["nav_trigger_count"] == 0.0
    assert float(out.loss_sum) == pytest.approx(0.9 / 2)  # −(0 + (−1)·0.9) / 2
    plain = policy_loss("mu_grpo", logprobs, old, adv, torch.ones(1, 2))
    assert plain.metrics["nav_trigger_count"] == 1.0 and float(plain.loss_sum) == 0.0


@pytest.mark.parametrize("name", available_losses())
def test_off_is_exactly_the_registry_loss(name):
    gen = torch.Generator().manual_seed(0)
    logprobs = (-torch.rand(3, 5, generator=gen, dtype=D) * 3).requires_grad_()
    behaviour = -torch.rand(3, 5, generator=gen, dtype=D) * 3
    adv, mask = torch.tensor([1.0, -0.5, 0.7], dtype=D), torch.rand(3, 5, generator=gen) > 0.2
    old = behaviour if needs_old_logprobs(name) else None  # icepop reads π_old itself (here: = β)
    plain = policy_loss(name, logprobs, behaviour, adv, mask, old_logprobs=old)
    off = corrected_policy_loss(name, logprobs, behaviour, adv, mask, old_logprobs=old)
    assert torch.equal(plain.loss_sum, off.loss_sum) and plain.metrics == off.metrics


def test_exact_factor_keeps_the_unclipped_objective():
    """With nothing masked and no truncation the weight is exactly π_old / β, and (π_θ / π_old) · w = π_θ / β:
    M2PO with a budget that masks nothing (unclipped ρA) gives the same loss and gradient either way."""
    gen = torch.Generator().manual_seed(1)
    logprobs = (-torch.rand(4, 6, generator=gen, dtype=D)).requires_grad_()
    behaviour, old = -torch.rand(4, 6, generator=gen, dtype=D), -torch.rand(4, 6, generator=gen, dtype=D)
    adv, mask = torch.tensor([1.0, -1.0, 0.5, -0.3], dtype=D), torch.ones(4, 6)
    direct = policy_loss("m2po", logprobs, behaviour, adv, mask, m2_threshold=1e9)
    (grad_direct,) = torch.autograd.grad(direct.loss_sum, logprobs)
    split = corrected_policy_loss(
        "m2po", logprobs, behaviour, adv, mask, old_logprobs=old, mask_bound=1e9, m2_threshold=1e9
    )
    (grad_split,) = torch.autograd.grad(split.loss_sum, logprobs)
    torch.testing.assert_close(split.loss_sum, direct.loss_sum)
    torch.testing.assert_close(grad_split, grad_direct)


def test_correction_without_old_logprobs_is_an_error():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="old log-probs"):
        corrected_policy_loss("grpo", x, x, torch.ones(1), torch.ones(1, 2), old_logprobs=None, tis_cap=2.0)


def test_mismatch_metrics_by_hand():
    """log r = log π_ref − b = [−log 2, log 2]: k3 = (r − 1) − log r = (−0.5 + log 2) and (1 − log 2),
    mean 0.25 exactly; |Δ| mean and max log 2."""
    behaviour = _t([LOG(0.5), LOG(0.25), 0.0])
    reference = _t([LOG(0.25), LOG(0.5), -3.0])
    metrics = mismatch_metrics(behaviour, reference, torch.tensor([[1, 1, 0]]))
    assert metrics["mismatch_kl"] == pytest.approx(0.25)
    assert metrics["mismatch_logprob_abs_mean"] == pytest.approx(LOG(2))
    assert metrics["mismatch_logprob_abs_max"] == pytest.approx(LOG(2))
    assert metrics["mismatch_tokens"] == 2.0
    assert math.isnan(mismatch_metrics(behaviour, reference, torch.zeros(1, 3))["mismatch_kl"])


def _model(seed: int, head_scale: float = 1.0) -> PreTrainedModel:
    model = tiny_model(seed=seed, vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=1).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(head_scale * 8.0)  # peaked distributions, so the pair differs clearly
    return model


def test_mismatch_metrics_on_a_known_pair_of_models(tmp_path):
    """β = model A samples; the reference B is A with its output layer scaled by 0.8 (so log π_B =
    log_softmax(0.8 · z)). The metrics' |Δ| equal a float64 recompute of both full distributions at
    the sampled tokens, and the KL estimate is close to the exact per-position KL(A ‖ B)."""
    behaviour_model, reference_model = _model(0), _model(0)
    with torch.no_grad():
        reference_model.lm_head.weight.mul_(0.8)
    behaviour_model.save_pretrained(tmp_path / "a")
    engine = TransformersEngine(tmp_path / "a", dtype="float32", device="cpu", batch_size=64, eos_token_ids=[])
    prompts = [[1, 3 + (i % 9), 4] for i in range(8)]
    gens = engine.generate(prompts, 16, SamplingParams(max_new_tokens=12, seed=0))
    groups = [
        RolloutGroup(
            prompt_id=str(i),
            prompt_ids=p,
            answer="",
            samples=[
                RolloutSample(response_ids=g.response_ids, behaviour_logprobs=g.logprobs, finish_reason="length")
                for g in gs
            ],
        )
        for i, (p, gs) in enumerate(zip(prompts, gens))
    ]
    flat = [(g.prompt_ids, s.response_ids) for g in groups for s in g.samples]
    scored = teacher_forced_logprobs(reference_model, [p for p, _ in flat], [r for _, r in flat], 1.0)
    per_group, k = [], 0
    for g in groups:
        per_group.append([scored[k + j].tolist() for j in range(len(g.samples))])
        k += len(g.samples)
    metrics = group_mismatch_metrics(groups, per_group)

    diffs, exact_kl = [], []
    with torch.no_grad():
        for prompt, response in flat:
            seq = torch.tensor([prompt + response])
            za = behaviour_model(seq).logits[0, len(prompt) - 1 : -1].double()
            zb = reference_model(seq).logits[0, len(prompt) - 1 : -1].double()
            la, lb = za.log_softmax(-1), zb.log_softmax(-1)
            diffs.append((lb - la).gather(1, seq[0, len(prompt) :, None]).squeeze(1).abs())
            exact_kl.append((la.exp() * (la - lb)).sum(-1))
    diffs, exact_kl = torch.cat(diffs), torch.cat(exact_kl)
    assert metrics["rollout/mismatch_tokens"] == diffs.numel() == 8 * 16 * 12
    assert metrics["rollout/mismatch_logprob_abs_max"] == pytest.approx(float(diffs.max()), abs=1e-5)
    assert metrics["rollout/mismatch_logprob_abs_mean"] == pytest.approx(float(diffs.mean()), abs=1e-5)
    assert float(exact_kl.mean()) > 0.01
    assert metrics["rollout/mismatch_kl"] == pytest.approx(float(exact_kl.mean()), rel=0.2)
