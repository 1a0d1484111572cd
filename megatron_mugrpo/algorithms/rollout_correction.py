"""Rollout correction: measuring and (optionally) correcting the gap between the behaviour policy
and the trainer's own policy.

The engine that samples a stage's rollouts runs the behaviour policy β; the trainer computes
π_train. At the stage's starting weights θ_old the two should agree, but an FP8 engine
(``rollout.quantization``), other kernels or another dtype make them differ. The stored behaviour
log-probs b_t are β's, so the losses' ratio ρ_t = π_θ / β is an exact importance ratio and the
gap needs no correction: that is the default. Its price is that at the first update ρ ≠ 1 already,
so the clip and the NAV trigger react to the mismatch as well as to the policy's own movement.

**Measuring** (``mismatch_metrics``): per sampled token, with log r_t = log π_old − b_t,

* ``mismatch_kl``: KL(β ‖ π_old) estimated on β's own samples with the k3 estimator
  E[(r − 1) − log r] (unbiased because E_β[r] = 1, never negative, lower variance than E[−log r]);
* ``mismatch_logprob_abs_mean`` / ``_max``: mean / max of |log π_old − b_t|.

**Correcting** (``algo.rollout_correction.*``, both off by default). Split the ratio

    ρ_t = π_θ / β = (π_θ / π_old) · (π_old / β) = r_t^θ · w_t,

give the loss the policy ratio r_t^θ (its clip and NAV then act on how far the policy moved since
the stage began) and weight each token by the mismatch factor w_t, detached:

* truncated importance sampling (``tis_cap`` = C > 0): weight min(w_t, C). Bounded variance; biased
  only on tokens with w_t > C (Yao et al. 2025, "truncated importance sampling");
* mismatch masking (``mask_bound`` = c > 1): tokens with w_t outside [1/c, c] get weight 0.

Both on: weight min(w_t, C) · 1[1/c ≤ w_t ≤ c]. Only the mask on: weight w_t · 1[...] (the exact
factor on the tokens kept, so the kept tokens' estimator stays unbiased).

How the weight reaches *any* registry loss: each loss's per-token objective is positively
homogeneous in the advantage (w · min(rA, clip(r)A) = min(r(wA), clip(r)(wA)) for w ≥ 0; M2PO's
r·A likewise), and NAV and M2PO's trust region only read the advantage's sign. So the corrected
loss is the registry loss called with the anchor log π_old in place of b and per-token advantages
w_t · A. A masked token (w = 0) contributes 0, stays in T_y and in the normaliser (as NAV-vetoed
tokens do), cannot trigger NAV and is outside M2PO's trust region.

What the correction needs: log π_old for every token the stage trains on, at *every* update,
when θ has already moved. The trainer computes it once per stage, before its first update, over
the whole rollout dataset, and stores it beside it (``training.stage_reference``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor

from megatron_mugrpo.algorithms.losses import LossOutput, LossStats, policy_loss
from megatron_mugrpo.errors import InputError, require

LOG_WEIGHT_CLAMP = 20.0
"""|log w| is clamped to this before exp, as the losses clamp |log ρ| (losses.LOG_RATIO_CLAMP): e^20
stays finite in float32; a token that far off is masked or truncated anyway."""


class RolloutCorrectionError(InputError, ValueError):
    """An ``algo.rollout_correction`` value is invalid; the message names the key and the fix."""


@dataclass(kw_only=True)
class RolloutCorrectionConfig:
    """``algo.rollout_correction.*``: the behaviour-vs-trainer mismatch, measured and corrected."""

    tis_cap: float = 0.0
    """C > 0: truncated importance sampling, each token weighted by min(π_old / β, C) while the loss
    sees π_θ / π_old. 0 (default): off. Values around 2 are common."""
    mask_bound: float = 0.0
    """c > 1: tokens whose mismatch ratio π_old / β leaves [1/c, c] contribute 0. 0 (default): off."""
    mismatch_groups: int = 64
    """Prompt groups of each stage's rollouts scored by the trainer (teacher forced) for the
    rollout/mismatch_* metrics when rollout.quantization is on. With a correction on, every group is
    scored anyway and the metrics cover all of them. 0: no metrics."""

    def __post_init__(self) -> None:
        require(
            self.tis_cap == 0 or self.tis_cap >= 1,
            f"algo.rollout_correction.tis_cap={self.tis_cap} must be 0 (off) or >= 1: a cap below 1 would "
            "down-weight every token (the factor is 1 where behaviour and trainer agree)",
        )
        require(
            self.mask_bound == 0 or self.mask_bound > 1,
            f"algo.rollout_correction.mask_bound={self.mask_bound} must be 0 (off) or > 1: tokens are kept "
            "while π_old / β lies in [1/c, c]",
        )
        require(
            self.mismatch_groups >= 0,
            f"algo.rollout_correction.mismatch_groups={self.mismatch_groups} must be >= 0 (0: no metrics)",
        )

    @property
    def enabled(self) -> bool:
        """Whether the loss uses log π_old (and so every token needs it)."""
        return self.tis_cap > 0 or self.mask_bound > 0

    def loss_options(self) -> dict[str, float]:
        """The keyword options of ``corrected_policy_loss`` / ``correction_inputs``."""
        return {"tis_cap": self.tis_cap, "mask_bound": self.mask_bound}


def mismatch_log_ratio(old_logprobs: Tensor, behaviour_logprobs: Tensor, response_mask: Tensor) -> Tensor:
    """log w_t = log π_old − b_t on response tokens, 0 elsewhere; [B, T] in float32 or wider, clamped to
    ±LOG_WEIGHT_CLAMP (so exp cannot overflow), no grad."""
    dtype = torch.promote_types(old_logprobs.dtype, torch.float32)
    raw = torch.where(
        response_mask.bool(), old_logprobs.detach().to(dtype) - behaviour_logprobs.detach().to(dtype), 0.0
    )
    return raw.clamp(-LOG_WEIGHT_CLAMP, LOG_WEIGHT_CLAMP)


def truncated_weights(log_ratio: Tensor, response_mask: Tensor, cap: float) -> Tensor:
    """min(w_t, C) on response tokens, 0 elsewhere ([B, T]); computed as exp(min(log w, log C))."""
    if cap < 1:
        raise RolloutCorrectionError(f"tis_cap={cap} must be >= 1 (algo.rollout_correction.tis_cap)")
    return torch.where(response_mask.bool(), log_ratio.clamp(max=math.log(cap)).exp(), 0.0)


def mismatch_keep(log_ratio: Tensor, response_mask: Tensor, bound: float) -> Tensor:
    """[B, T] bool: response tokens whose w_t lies in [1/c, c], i.e. |log w_t| <= log c."""
    if bound <= 1:
        raise RolloutCorrectionError(f"mask_bound={bound} must be > 1 (algo.rollout_correction.mask_bound)")
    return response_mask.bool() & (log_ratio.abs() <= math.log(bound))


@torch.no_grad()
def correction_weights(
    old_logprobs: Tensor,
    behaviour_logprobs: Tensor,
    response_mask: Tensor,
    *,
    tis_cap: float = 0.0,
    mask_bound: float = 0.0,
) -> tuple[Tensor, dict[str, tuple[Tensor, Tensor]]]:
    """Per-token weights of the corrected loss (module docstring) and their diagnostics.

    Args:
        old_logprobs: [B, T] log π_old (the trainer at the stage's starting weights).
        behaviour_logprobs: [B, T] stored b_t.
        response_mask: [B, T].
        tis_cap: C (0: no truncation). mask_bound: c (0: no mask).

    Returns:
        weights [B, T] (0 off the response and on masked tokens) and (numerator, denominator) parts
        over response tokens of ``rollout_corr_weight_mean``, ``rollout_corr_truncated_frac`` and
        ``rollout_corr_masked_frac`` (``LossStats.means``: exact across micro-batches).
    """
    mask = response_mask.bool()
    log_w = mismatch_log_ratio(old_logprobs, behaviour_logprobs, mask)
    weights = truncated_weights(log_w, mask, tis_cap) if tis_cap > 0 else torch.where(mask, log_w.exp(), 0.0)
    keep = mismatch_keep(log_w, mask, mask_bound) if mask_bound > 0 else mask
    weights = torch.where(keep, weights, 0.0)
    count = mask.sum().to(weights.dtype)
    truncated = mask & (log_w > math.log(tis_cap)) if tis_cap > 0 else torch.zeros_like(mask)
    parts = {
        "rollout_corr_weight_mean": (weights.sum(), count),
        "rollout_corr_truncated_frac": (truncated.sum().to(weights.dtype), count),
        "rollout_corr_masked_frac": ((mask & ~keep).sum().to(weights.dtype), count),
    }
    return weights, parts


class LossInputs(NamedTuple):
    """What a registry loss (and its update pass) is given in place of (b, A) under the correction."""

    anchor_logprobs: Tensor
    """[B, T]: log π_old with a correction on (the loss's ratio becomes π_θ / π_old), else b."""
    advantages: Tensor
    """[B, T] w_t · A with a correction on, else the advantages as given ([B] or [B, T])."""
    stats: dict[str, tuple[Tensor, Tensor]]
    """The correction's (numerator, denominator) diagnostics; empty when off."""


def correction_inputs(
    behaviour_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    old_logprobs: Tensor | None,
    tis_cap: float = 0.0,
    mask_bound: float = 0.0,
) -> LossInputs:
    """The loss's (anchor, advantages) under the rollout correction; (b, A) unchanged when it is off."""
    if tis_cap <= 0 and mask_bound <= 0:
        return LossInputs(behaviour_logprobs, advantages, {})
    if old_logprobs is None:
        raise ValueError(
            "algo.rollout_correction is on but the batch has no old log-probs (log π_old per token); "
            "the stage reference pass must attach them (training.stage_reference)"
        )
    weights, stats = correction_weights(
        old_logprobs, behaviour_logprobs, response_mask, tis_cap=tis_cap, mask_bound=mask_bound
    )
    adv = advantages.detach().to(weights.dtype)
    return LossInputs(old_logprobs, weights * (adv[:, None] if adv.dim() == 1 else adv), stats)


def corrected_policy_loss(
    name: str,
    logprobs: Tensor,
    behaviour_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    old_logprobs: Tensor | None,
    tis_cap: float = 0.0,
    mask_bound: float = 0.0,
    update_inputs: dict[str, Tensor] | None = None,
    **options: Any,
) -> LossOutput:
    """Registry loss ``name`` with the rollout correction (module docstring); without one (both
    options 0) exactly ``policy_loss(name, logprobs, behaviour_logprobs, advantages, response_mask)``.

    Args:
        logprobs: [B, T] log π_θ, carries the gradient.
        behaviour_logprobs: [B, T] b_t. old_logprobs: [B, T] log π_old, required when a correction is on.
        advantages: [B] or [B, T]. response_mask: [B, T].
        update_inputs: this call's share of the loss's update pass, computed on ``correction_inputs``.
        **options: the loss's own options (``AlgoConfig.loss_options()``).
    """
    inputs = correction_inputs(
        behaviour_logprobs, advantages, response_mask, old_logprobs=old_logprobs, tis_cap=tis_cap, mask_bound=mask_bound
    )
    out = policy_loss(
        name, logprobs, inputs.anchor_logprobs, inputs.advantages, response_mask, update_inputs=update_inputs, **options
    )
    if not inputs.stats:
        return out
    stats = LossStats(
        means=out.stats.means | inputs.stats, sums=out.stats.sums, maxima=out.stats.maxima, ratios=out.stats.ratios
    )
    return LossOutput(out.loss_sum, out.normaliser, stats)


@torch.no_grad()
def mismatch_metrics(behaviour_logprobs: Tensor, reference_logprobs: Tensor, response_mask: Tensor) -> dict[str, float]:
    """How far the behaviour policy's sampled-token log-probs are from a reference policy's.

    Args:
        behaviour_logprobs: [B, T] b_t of tokens sampled from β.
        reference_logprobs: [B, T] log π_ref of the same tokens, teacher forced (the trainer, full precision).
        response_mask: [B, T].

    Returns:
        ``mismatch_kl`` (k3 estimate of KL(β ‖ π_ref), module docstring), ``mismatch_logprob_abs_mean``,
        ``mismatch_logprob_abs_max`` and ``mismatch_tokens``; NaN metrics when there are no tokens.
    """
    mask = response_mask.bool()
    if not mask.any():
        nan = float("nan")
        return {
            "mismatch_kl": nan,
            "mismatch_logprob_abs_mean": nan,
            "mismatch_logprob_abs_max": nan,
            "mismatch_tokens": 0.0,
        }
    log_r = mismatch_log_ratio(reference_logprobs.double(), behaviour_logprobs.double(), mask)[mask]
    k3 = log_r.exp() - 1.0 - log_r
    return {
        "mismatch_kl": float(k3.mean()),
        "mismatch_logprob_abs_mean": float(log_r.abs().mean()),
        "mismatch_logprob_abs_max": float(log_r.abs().max()),
        "mismatch_tokens": float(mask.sum()),
    }
