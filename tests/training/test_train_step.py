"""One update through Megatron's schedule on a single CPU rank: invariances and sanity checks.

Tolerances (float32 on CPU): different micro-batch splits or log-prob implementations only change
the order of float32 additions, so results agree to ~1e-7 relative; the tests allow ATOL below.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from dist_utils import run_distributed

from megatron_mugrpo.algorithms.config import AlgoConfig
from megatron_mugrpo.algorithms.losses import MuGrpoOptions, policy_loss, update_inputs
from megatron_mugrpo.records import TrainBatch
from megatron_mugrpo.training.optimizer import OptimConfig
from megatron_mugrpo.training.parallel import initialize_parallel
from megatron_mugrpo.training.setup import Policy, build_policy
from megatron_mugrpo.training.train_step import forward_logprobs, train_step

from .common import hf_config, make_batch

ATOL = 2e-6
"""float32 agreement for reordered sums (loss, grad norm, weights after an update)."""
LR = 1e-3
"""Large enough that one update visibly moves a tiny model."""


def _policy(seed: int = 0, **optim: Any) -> Policy:
    groups = initialize_parallel(1, 1, seed=seed)
    return build_policy(hf_config(), groups=groups, dtype=torch.float32, optim=OptimConfig(lr=LR, **optim))


def _step(
    policy: Policy, batch: TrainBatch, micro_batch_size: int = 4, impl: str = "fused", logits_budget_mib: float = 0
) -> dict:
    options = AlgoConfig().loss_options()
    return train_step(
        policy,
        batch,
        loss_name="mu_grpo",
        loss_options=options,
        temperature=1.0,
        micro_batch_size=micro_batch_size,
        impl=impl,
        logits_budget_mib=logits_budget_mib,
    )


def _params(policy: Policy) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in policy.unwrapped()[0].named_parameters()}


def _assert_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float = ATOL) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=atol, rtol=0, msg=f"parameter {name} differs")


# --------------------------------------------------------------------------------------------


def _parameters_change(rank: int, world_size: int) -> None:
    policy = _policy()
    before = _params(policy)
    metrics = _step(policy, make_batch(0))
    after = _params(policy)
    expected = {
        "train/loss",
        "train/grad_norm",
        "train/lr",
        "train/rollout_logprob_abs_diff_max",
        "train/rollout_logprob_abs_diff_mean",
        "train/clip_frac_low",
        "train/nav_vetoed_frac",
    }
    assert expected <= metrics.keys(), sorted(expected - metrics.keys())
    assert metrics["train/lr"] == LR and metrics["train/grad_norm"] > 0
    changed = [name for name in before if not torch.equal(before[name], after[name])]
    assert len(changed) == len(before), f"unchanged after an update: {sorted(set(before) - set(changed))}"


def _zero_advantage_is_weight_decay_only(rank: int, world_size: int) -> None:
    policy = _policy(weight_decay=0.01)
    before = _params(policy)
    metrics = _step(policy, make_batch(0, zero_advantage=True))
    assert metrics["train/grad_norm"] == 0.0 and metrics["train/loss"] == 0.0
    decay = 1.0 - LR * 0.01  # AdamW: p ← p − lr·wd·p, and the Adam step of a zero gradient is 0
    for name, param in _params(policy).items():
        no_decay = param.dim() == 1 or name.endswith(".bias")  # Megatron's wd_mult = 0 parameters
        expected = before[name] if no_decay else before[name] * decay
        torch.testing.assert_close(param, expected, atol=1e-9, rtol=0, msg=name)


def _skewed_batch() -> TrainBatch:
    """8 responses; odd rows' behaviour log-probs raised by 1 (ρ ≈ e^-1 there), so that NAV at
    τ_c = 0.5 triggers on some negative-advantage responses and M2PO's budget binds."""
    batch = make_batch(5, groups=2, group_size=4)
    odd = (torch.arange(batch.num_sequences) % 2 == 1)[:, None]
    shifted = torch.where(odd, (batch.behaviour_logprobs + 1.0).clamp(max=0.0), batch.behaviour_logprobs)
    batch.behaviour_logprobs = shifted * batch.response_mask
    return batch


SPLIT_CASES = {
    "mu_grpo": AlgoConfig(mu_grpo=MuGrpoOptions(veto_threshold=0.5)).loss_options(),
    "m2po": AlgoConfig(loss="m2po").loss_options(),
    "m2po_clip": AlgoConfig(loss="m2po_clip").loss_options(),
}


def _expected_update(policy: Policy, batch: TrainBatch, name: str) -> tuple[float, dict[str, float]]:
    """The whole update's loss and metrics computed on all its tokens at once (the definition)."""
    logprobs = forward_logprobs(policy, batch, temperature=1.0, micro_batch_size=8)
    options = SPLIT_CASES[name]
    inputs = update_inputs(name, logprobs, batch.behaviour_logprobs, batch.advantages, batch.response_mask, **options)
    out = policy_loss(
        name,
        logprobs,
        batch.behaviour_logprobs,
        batch.advantages,
        batch.response_mask,
        update_inputs=inputs,
        **options,
    )
    return float(out.loss_sum / out.normaliser), out.metrics


def _metrics_and_masks_do_not_depend_on_the_split(rank: int, world_size: int) -> None:
    """1 × 8 and 8 × 1 micro-batches give the same update, masks and metrics as the whole batch at once."""
    batch = _skewed_batch()
    for name, options in SPLIT_CASES.items():
        results = []
        for micro_batch_size in (8, 1):
            policy = _policy(seed=0)
            loss, expected = _expected_update(policy, batch, name)
            metrics = train_step(
                policy, batch, loss_name=name, loss_options=options, temperature=1.0, micro_batch_size=micro_batch_size
            )
            assert metrics["train/loss"] == pytest.approx(loss, abs=ATOL), name
            for key, value in expected.items():
                assert metrics[f"train/{key}"] == pytest.approx(value, abs=ATOL, nan_ok=True), (name, key)
            results.append(_params(policy))
        _assert_close(results[0], results[1])
    # The example exercises what it checks: vetoed responses, M2 masking, a binding clip bound.
    assert _expected_count(batch, "mu_grpo", "nav_vetoed_tokens") > 0
    assert _expected_count(batch, "m2po", "m2_masked_tokens") > 0


def _expected_count(batch: TrainBatch, name: str, key: str) -> float:
    return _expected_update(_policy(seed=0), batch, name)[1][key]


def _micro_batch_invariance(rank: int, world_size: int) -> None:
    batch = make_batch(1, groups=1, group_size=4)
    results = []
    for micro_batch_size in (4, 1):  # one micro-batch of 4 sequences vs four of 1
        policy = _policy(seed=0)
        metrics = [_step(policy, batch, micro_batch_size) for _ in range(2)]
        results.append((metrics, _params(policy)))
    (m4, p4), (m1, p1) = results
    for a, b in zip(m4, m1):
        for key in a:  # every figure, loss metrics included, is exact over the split
            assert a[key] == pytest.approx(b[key], abs=ATOL, nan_ok=True), key
    _assert_close(p4, p1)


def _fused_equals_unfused(rank: int, world_size: int) -> None:
    """Every log-prob policy gives the same update: unfused, fused keeping no / every block's logits,
    and auto with a budget below (→ fused) and above (→ unfused) the micro-batch's logits."""
    batch = make_batch(2)
    results = []
    for impl, budget_mib in (("unfused", 0), ("fused", 0), ("fused", 64), ("auto", 0), ("auto", 64)):
        policy = _policy(seed=0)
        logprobs = forward_logprobs(
            policy, batch, temperature=0.7, micro_batch_size=4, impl=impl, logits_budget_mib=budget_mib
        )
        metrics = _step(policy, batch, impl=impl, logits_budget_mib=budget_mib)
        results.append((logprobs, metrics, _params(policy)))
    (lu, mu, pu), *others = results
    for lf, mf, pf in others:
        torch.testing.assert_close(lf, lu, atol=ATOL, rtol=0)
        for key in ("train/loss", "train/grad_norm", "train/rollout_logprob_abs_diff_max"):
            assert mf[key] == pytest.approx(mu[key], abs=ATOL), key
        _assert_close(pf, pu)


def _first_update_gap_is_zero(rank: int, world_size: int) -> None:
    """With behaviour log-probs = the policy's own (first update of a stage), ρ = 1 and the gap ~0."""
    policy = _policy()
    batch = make_batch(3)
    batch.behaviour_logprobs = forward_logprobs(policy, batch, temperature=1.0, micro_batch_size=4)
    metrics = _step(policy, batch)
    assert metrics["train/rollout_logprob_abs_diff_max"] < 1e-5
    assert metrics["train/ratio_mean"] == pytest.approx(1.0, abs=1e-5)


def _padding_vocab_is_excluded(rank: int, world_size: int) -> None:
    """Log-probs normalise over the true vocabulary only, although the model has 128 logit rows."""
    policy = _policy()
    batch = make_batch(4)
    model = policy.unwrapped()[0]
    tokens = batch.tokens
    positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    with torch.no_grad():
        logits = model(tokens, positions, None)
    assert logits.shape[-1] == 128
    reference = torch.log_softmax(logits[..., : hf_config()["vocab_size"]].float() / 0.8, dim=-1)
    reference = reference.gather(-1, batch.targets.unsqueeze(-1)).squeeze(-1) * batch.response_mask
    for impl in ("fused", "unfused"):
        ours = forward_logprobs(policy, batch, temperature=0.8, micro_batch_size=3, impl=impl)
        torch.testing.assert_close(ours, reference, atol=ATOL, rtol=0)


@pytest.mark.parametrize(
    "body",
    [
        _parameters_change,
        _zero_advantage_is_weight_decay_only,
        _micro_batch_invariance,
        _metrics_and_masks_do_not_depend_on_the_split,
        _fused_equals_unfused,
        _first_update_gap_is_zero,
        _padding_vocab_is_excluded,
    ],
    ids=lambda fn: fn.__name__.strip("_"),
)
def test_single_rank(body):
    run_distributed(body, 1)


def _m2po_with_two_data_parallel_ranks(rank: int, world_size: int) -> None:
    """DP = 2: each rank trains on half the rows, yet M2PO's mask covers the whole update."""
    batch = _skewed_batch()
    for name in ("m2po", "m2po_clip"):
        policy = _policy(seed=0)
        loss, expected = _expected_update(policy, batch, name)
        metrics = train_step(
            policy, batch, loss_name=name, loss_options=SPLIT_CASES[name], temperature=1.0, micro_batch_size=2
        )
        assert metrics["train/loss"] == pytest.approx(loss, abs=ATOL), name
        for key in ("m2", "m2_after", "m2_masked_tokens", "m2_clip_log_bound", "trust_region_frac"):
            if key in expected:
                assert metrics[f"train/{key}"] == pytest.approx(expected[key], abs=ATOL), (name, key)


@pytest.mark.multiprocess
def test_m2po_mask_spans_data_parallel_ranks():
    run_distributed(_m2po_with_two_data_parallel_ranks, 2)
