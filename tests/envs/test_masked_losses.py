"""Every loss sees policy tokens only: environment tokens interleaved in a multi-turn trajectory change nothing.

A trajectory's tensors hold the policy's tokens with the environment's observation tokens between its
turns (policy mask 0). Each registry loss, the rollout correction (TIS, mismatch mask) and HDR's
headroom and drift are computed twice in float64: on the interleaved layout with garbage log-probs,
behaviour log-probs and advantages at the environment positions, and on the policy tokens alone,
packed to the left. Loss sums, normalisers, every metric and the gradients must agree; the gradient
at an environment position must be 0. One case is also checked against a value computed by hand.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_mugrpo.algorithms.losses import AGGREGATIONS, available_losses, loss_spec, policy_loss, update_inputs
from megatron_mugrpo.algorithms.replay import group_headroom_drift
from megatron_mugrpo.algorithms.rollout_correction import corrected_policy_loss
from megatron_mugrpo.algorithms.veto import VETO_SCOPES

F64 = torch.float64
ADVANTAGES = torch.tensor([1.3, -0.7, -2.0, 0.4, -1.1], dtype=F64)
TURNS = [  # per response: (policy tokens, observation tokens) per turn
    [(3, 4), (2, 0)],
    [(2, 3), (1, 2), (3, 0)],
    [(4, 5), (2, 0)],
    [(1, 0)],
    [(2, 1), (2, 2), (1, 0)],
]


def _variants() -> list[tuple[str, dict]]:
    cases = [(name, {}) for name in available_losses()]
    cases += [("grpo", {"dual_clip_c": 3.0})]
    cases += [("mu_grpo", {"veto_scope": scope}) for scope in VETO_SCOPES]
    cases += [("opsm", {"delta": 0.05}), ("icepop", {"band_low": 0.8, "band_high": 1.5})]
    cases += [("icepop_current", {"band_low": 0.8, "band_high": 1.5})]
    return cases


def _defaults(name: str) -> dict:
    import dataclasses

    return {f.name: f.default for f in dataclasses.fields(loss_spec(name).options)}


class Layouts:
    """The same tokens twice: interleaved with observations (``i``) and the policy tokens alone (``c``)."""

    def __init__(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        rows = []
        for turns in TURNS:
            flags = []
            for policy, observation in turns:
                flags += [True] * policy + [False] * observation
            rows.append(flags)
        self.B, self.Ti = len(rows), max(len(r) for r in rows)
        self.Tc = max(sum(r) for r in rows)
        n = sum(sum(r) for r in rows)
        behaviour = -torch.rand(n, generator=gen, dtype=F64) * 3
        # Log-ratios wide enough to clip, veto (ρ < 1e-4 on negative rows), leave IcePop's band and move M2PO.
        log_ratio = torch.randn(n, generator=gen, dtype=F64) * 0.8
        log_ratio[torch.randperm(n, generator=gen)[:4]] = -12.0
        current = behaviour + log_ratio
        old = behaviour + torch.randn(n, generator=gen, dtype=F64) * 0.3
        token_adv = torch.randn(n, generator=gen, dtype=F64)
        self.policy = torch.zeros(self.B, self.Ti, dtype=torch.bool)
        self.compact = torch.zeros(self.B, self.Tc, dtype=torch.bool)
        for b, flags in enumerate(rows):
            self.policy[b, : len(flags)] = torch.tensor(flags)
            self.compact[b, : sum(flags)] = True
        garbage = lambda: torch.randn(self.B, self.Ti, generator=gen, dtype=F64) * 30 + 7  # noqa: E731
        self.i = {
            "logprobs": self._place(current, self.policy, garbage()),
            "behaviour": self._place(behaviour, self.policy, garbage()),
            "old": self._place(old, self.policy, garbage()),
            "token_adv": self._place(token_adv, self.policy, garbage()),
            "mask": self.policy.to(F64),
        }
        zeros = torch.zeros(self.B, self.Tc, dtype=F64)
        self.c = {
            "logprobs": self._place(current, self.compact, zeros.clone()),
            "behaviour": self._place(behaviour, self.compact, zeros.clone()),
            "old": self._place(old, self.compact, zeros.clone()),
            "token_adv": self._place(token_adv, self.compact, zeros.clone()),
            "mask": self.compact.to(F64),
        }

    @staticmethod
    def _place(values: torch.Tensor, where: torch.Tensor, fill: torch.Tensor) -> torch.Tensor:
        out = fill.clone()
        out[where] = values  # row-major: each response's policy tokens in order
        return out


def _run(layout: dict, name: str, options: dict, advantages: torch.Tensor, correction: dict | None = None):
    logprobs = layout["logprobs"].clone().requires_grad_(True)
    if correction is None:
        extra = update_inputs(name, logprobs.detach(), layout["behaviour"], advantages, layout["mask"], **options)
        out = policy_loss(
            name,
            logprobs,
            layout["behaviour"],
            advantages,
            layout["mask"],
            update_inputs=extra,
            old_logprobs=layout["old"],  # read by icepop only (its π_old / β)
            **options,
        )
    else:
        out = corrected_policy_loss(
            name,
            logprobs,
            layout["behaviour"],
            advantages,
            layout["mask"],
            old_logprobs=layout["old"],
            **correction,
            **options,
        )
    out.loss_sum.backward()
    return out, logprobs.grad


def _same_metrics(a: dict[str, float], b: dict[str, float]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        both_nan = math.isnan(a[key]) and math.isnan(b[key])
        assert both_nan or a[key] == pytest.approx(b[key], rel=1e-12, abs=1e-12), key


def _check(lay: Layouts, name: str, options: dict, per_token: bool, correction: dict | None = None) -> None:
    adv_i = lay.i["token_adv"] if per_token else ADVANTAGES
    adv_c = lay.c["token_adv"] if per_token else ADVANTAGES
    out_i, grad_i = _run(lay.i, name, options, adv_i, correction)
    out_c, grad_c = _run(lay.c, name, options, adv_c, correction)
    assert torch.isfinite(out_i.loss_sum)
    torch.testing.assert_close(out_i.loss_sum, out_c.loss_sum, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out_i.normaliser, out_c.normaliser, rtol=0, atol=0)
    _same_metrics(out_i.metrics, out_c.metrics)
    torch.testing.assert_close(grad_i[lay.policy], grad_c[lay.compact], rtol=1e-12, atol=1e-12)
    assert not grad_i[~lay.policy].any()  # no gradient reaches an observation token


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize(("name", "overrides"), _variants(), ids=lambda v: str(v))
def test_every_loss_on_interleaved_masks_equals_the_loss_on_policy_tokens_alone(name, overrides, aggregation):
    lay = Layouts(seed=11)
    options = _defaults(name) | overrides | {"aggregation": aggregation}
    _check(lay, name, options, per_token=False)
    if name in ("grpo", "mu_grpo"):  # per-token advantages too
        _check(lay, name, options, per_token=True)


def test_the_variants_trigger_what_they_mask():
    """The data is not vacuous: NAV vetoes, M2PO masks, IcePop masks and clipping binds on it."""
    lay = Layouts(seed=11)
    metrics = {
        name: _run(lay.i, name, _defaults(name) | {"aggregation": "token_mean"}, ADVANTAGES)[0].metrics
        for name in ("mu_grpo", "m2po", "icepop_current", "grpo")
    }
    assert metrics["mu_grpo"]["masked_frac"] > 0 and metrics["m2po"]["masked_frac"] > 0
    assert metrics["icepop_current"]["masked_frac"] > 0 and metrics["grpo"]["clip_frac_low"] > 0


@pytest.mark.parametrize(
    "correction",
    [
        {"tis_cap": 2.0, "level": "token"},
        {"mask_bound": 1.5, "mask_mode": "reject", "level": "token"},
        {"tis_cap": 2.0, "mask_bound": 1.5, "mask_mode": "zero_weight", "level": "sequence"},
    ],
    ids=["tis", "mismatch_reject", "sequence"],
)
@pytest.mark.parametrize("name", ["mu_grpo", "m2po", "gspo"])
def test_the_rollout_correction_sees_policy_tokens_only(name, correction):
    lay = Layouts(seed=5)
    _check(lay, name, _defaults(name) | {"aggregation": "seq_mean_token_mean"}, False, correction)


def test_hdr_headroom_and_drift_see_policy_tokens_only():
    lay = Layouts(seed=3)
    groups = torch.tensor([0, 0, 1, 1, 1])
    hi, di = group_headroom_drift(lay.i["logprobs"], lay.i["behaviour"], ADVANTAGES, lay.i["mask"], groups, 2)
    hc, dc = group_headroom_drift(lay.c["logprobs"], lay.c["behaviour"], ADVANTAGES, lay.c["mask"], groups, 2)
    torch.testing.assert_close(hi, hc, rtol=1e-12, atol=0)
    torch.testing.assert_close(di, dc, rtol=1e-12, atol=0)


def test_nav_suffix_by_hand_across_an_observation():
    """One response, A = −1, tokens [p, e, p, e, e, p]: policy ρ = [1, 1e-5, 1]. The trigger (ρ < 1e-4) is the
    second policy token; the suffix scope vetoes the policy tokens after it (the third), never counting the
    observation tokens: loss_sum = −((−1) + (−1e-5) + 0) / 3 over T_y = 3 policy tokens, normaliser 1."""
    behaviour = torch.tensor([[-1.0, 9.0, -2.0, 9.0, 9.0, -0.5]], dtype=F64)
    log_ratio = torch.tensor([[0.0, 50.0, math.log(1e-5), -50.0, 50.0, 0.0]], dtype=F64)
    mask = torch.tensor([[1, 0, 1, 0, 0, 1]], dtype=F64)
    out = policy_loss(
        "mu_grpo",
        behaviour + log_ratio,
        behaviour,
        torch.tensor([-1.0], dtype=F64),
        mask,
        clip_low=0.0,
        clip_high=5.0,
        veto_scope="suffix",
        veto_threshold=1e-4,
        aggregation="seq_mean_token_mean",
    )
    assert out.loss_sum.item() == pytest.approx((1.0 + 1e-5) / 3, rel=1e-12)
    assert out.normaliser.item() == 1.0
    assert out.metrics["num_tokens"] == 3.0
