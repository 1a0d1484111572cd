"""Registry entries ``icepop`` (IcePop as defined) and ``icepop_current`` (a ratio band on π_θ / β).

**``icepop``: IcePop as its authors define it** (Ring-1T, "IcePop"; in verl, NeMo-RL and
OpenRLHF as a train/inference mismatch mask). Two ratios, kept apart:

* the mismatch factor w_t = π_old(a_t) / β(a_t): the trainer's own probability of the sampled token
  at the weights that generated the rollouts, over the inference engine's (the stored b_t);
* the policy ratio r_t = π_θ(a_t) / π_old(a_t): how far the policy moved since then.

    obj_t = M(w_t) · min(r_t A, clip(r_t, 1 − ε, 1 + ε) A),    M(w) = w if α ≤ w ≤ β_band, else 0.

The mask (and the weight w inside it) is fixed for the whole stage; GRPO's clip acts on r_t.

Which π_old: the trainer's log-probs of D_k at the **stage's start**, θ_old = the weights β was
made from, scored teacher forced before the stage's first update (``training.stage_reference``,
stored beside the rollouts and read back on resume). Why there and not at each optimizer update's
start: IcePop's θ_old is the policy that *generated* the rollouts, and w measures only the
training/inference engines' disagreement on it (FP8 or other kernels), not the policy's movement.
A no-grad forward before each update would give, with one optimizer step per update, exactly the
π_θ the loss sees at that step, so masking on it would be ``icepop_current`` again: a band that
follows the drifting policy. On a stage whose engine is exact (w = 1 everywhere), ``icepop`` is
GRPO with the ratio taken against π_old (= β up to kernel noise).

**``icepop_current``: the band on the drifting ratio** ρ_t = π_θ / β, what this project called
``icepop`` before issue #43:

    obj_t = 1[α ≤ ρ_t ≤ β_band] · min(ρ_t A, clip(ρ_t, 1 − ε, 1 + ε) A).

Recomputed every update from π_θ, over μ updates it removes every token the policy moved by more
than the band, whatever the engines do: a hard trust region around β, not IcePop's mismatch mask.

Both: masked tokens contribute 0 (masked, not clipped: a clip keeps the token's value and cuts only
its gradient on one side) and stay in T_y and the normaliser, as IcePop does; the mask is never
differentiated through. Formulas: docs/method.md, "IcePop".

    out = policy_loss("icepop", logprobs, behaviour_logprobs, advantages, mask, old_logprobs=old, band_low=0.5)
    out = policy_loss("icepop_current", logprobs, behaviour_logprobs, advantages, mask, band_low=0.5, band_high=5.0)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from megatron_mugrpo.algorithms.loss_core import (
    DEFAULT_AGGREGATION,
    LOG_RATIO_CLAMP,
    LossOutput,
    TokenTerms,
    aggregate,
    clip_stats,
    clipped_objective,
    ratio_stats,
    register_loss,
    token_terms,
    with_stats,
)
from megatron_mugrpo.errors import require
from megatron_mugrpo.metric_names import MASKED_FRAC, stat_name


@dataclass(kw_only=True)
class IcepopOptions:
    """``algo.icepop.*``: GRPO's clip on r = π_θ / π_old and the band on w = π_old / β (IcePop)."""

    SECTION: ClassVar[str] = "icepop"
    clip_eps: float = 0.2
    """ε: the ratio is clipped to [1 − ε, 1 + ε] on the tokens kept (GRPO's default)."""
    band_low: float = 0.5
    """α: tokens with a ratio below α are masked (IcePop's paper: 0.5)."""
    band_high: float = 5.0
    """β: tokens with a ratio above β are masked (IcePop's paper: 5)."""

    def __post_init__(self) -> None:
        key = f"algo.{self.SECTION}"
        require(0.0 < self.clip_eps < 1.0, f"{key}.clip_eps={self.clip_eps} must be in (0, 1)")
        require(
            0.0 <= self.band_low < 1.0 < self.band_high,
            f"{key} band [band_low={self.band_low}, band_high={self.band_high}] must satisfy "
            "0 <= band_low < 1 < band_high (a ratio of 1 must stay inside; IcePop uses [0.5, 5])",
        )


@dataclass(kw_only=True)
class IcepopCurrentOptions(IcepopOptions):
    """``algo.icepop_current.*``: GRPO's clip, and the band, both on ρ = π_θ / β."""

    SECTION: ClassVar[str] = "icepop_current"


@torch.no_grad()
def band_masked(terms: TokenTerms, low: float, high: float) -> tuple[Tensor, Tensor]:
    """[B, T] bool response tokens with ρ < low, and with ρ > high (ρ = ``terms.ratio``)."""
    rho = terms.ratio.detach()
    return terms.mask & (rho < low), terms.mask & (rho > high)


@torch.no_grad()
def mismatch_band(
    old_logprobs: Tensor, behaviour_logprobs: Tensor, response_mask: Tensor, low: float, high: float
) -> tuple[Tensor, Tensor, Tensor]:
    """IcePop's M(w) for w_t = π_old / β, and which tokens fall below / above the band.

    Args:
        old_logprobs: [B, T] log π_old (the trainer at the stage's starting weights).
        behaviour_logprobs: [B, T] stored b_t = log β.
        response_mask: [B, T] bool.
        low, high: the band [α, β_band].

    Returns:
        weight: [B, T] w_t on response tokens inside the band, 0 elsewhere (float32 or wider).
        below, above: [B, T] bool, response tokens with w_t < α, w_t > β_band. Compared in log space.
    """
    dtype = torch.promote_types(old_logprobs.dtype, torch.float32)
    raw = torch.where(response_mask, old_logprobs.to(dtype) - behaviour_logprobs.to(dtype), 0.0)
    log_w = raw.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    below = response_mask & (log_w < (math.log(low) if low > 0 else -math.inf))
    above = response_mask & (log_w > math.log(high))
    weight = torch.where(response_mask & ~below & ~above, log_w.exp(), 0.0)
    return weight, below, above


def _band_means(below: Tensor, above: Tensor, tokens: Tensor) -> dict[str, tuple[Tensor, Tensor]]:
    masked = below | above
    return {
        "icepop_masked_low_frac": (below.sum(), tokens),
        "icepop_masked_high_frac": (above.sum(), tokens),
        "icepop_masked_frac": (masked.sum(), tokens),
        stat_name(MASKED_FRAC): (masked.sum(), tokens),
    }


@register_loss("icepop", options=IcepopOptions, needs_old_logprobs=True)
def icepop_loss(
    logprobs: Tensor,
    behaviour_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_eps: float = 0.2,
    band_low: float = 0.5,
    band_high: float = 5.0,
    aggregation: str = DEFAULT_AGGREGATION,
    old_logprobs: Tensor | None = None,
) -> LossOutput:
    """IcePop: obj_t = M(π_old / β) · min(r_t A, clip(r_t, 1 − ε, 1 + ε) A), r_t = π_θ / π_old.

    ``old_logprobs`` [B, T]: log π_old at the stage's start (module docstring); other shapes as in
    ``policy_loss``. Extra metrics: ``icepop_masked_low_frac`` / ``icepop_masked_high_frac`` (w below /
    above the band), ``icepop_masked_frac`` and the shared ``masked_frac``, ``icepop_weight_mean``
    (M(w) over response tokens). The ratio metrics (``ratio_mean_neg_adv``, ...) and the clip
    fractions are r's, the clip fractions over kept tokens only.
    """
    if old_logprobs is None:
        raise ValueError(
            "algo.loss=icepop masks on π_old / β and needs log π_old (the trainer's log-probs at the stage's "
            "start, training.stage_reference); pass old_logprobs, or use algo.loss=icepop_current (π_θ / β)"
        )
    terms = token_terms(logprobs, old_logprobs, advantages, response_mask)
    objective, clipped_low, clipped_high = clipped_objective(terms, 1.0 - clip_eps, 1.0 + clip_eps)
    weight, below, above = mismatch_band(
        old_logprobs.detach(), behaviour_logprobs.detach(), terms.mask, band_low, band_high
    )
    masked = below | above
    loss_sum, normaliser = aggregate(
        weight.to(objective.dtype) * objective, terms.mask & ~masked, terms.mask, aggregation
    )
    with torch.no_grad():
        tokens = terms.mask.sum()
        means = clip_stats(terms, clipped_low & ~masked, clipped_high & ~masked) | _band_means(below, above, tokens)
        means["icepop_weight_mean"] = (weight.sum(), tokens)
    return LossOutput(loss_sum, normaliser, with_stats(ratio_stats(terms), means=means))


@register_loss("icepop_current", options=IcepopCurrentOptions)
def icepop_current_loss(
    logprobs: Tensor,
    behaviour_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_eps: float = 0.2,
    band_low: float = 0.5,
    band_high: float = 5.0,
    aggregation: str = DEFAULT_AGGREGATION,
) -> LossOutput:
    """obj_t = 1[α ≤ ρ_t ≤ β_band] · min(ρ_t A, clip(ρ_t, 1 − ε, 1 + ε) A), ρ_t = π_θ / β. Shapes as in
    ``policy_loss``.

    Extra metrics: ``icepop_masked_low_frac`` / ``icepop_masked_high_frac`` (below / above the
    band), ``icepop_masked_frac`` and the shared ``masked_frac`` (both, over response tokens);
    the clip fractions count kept tokens only.
    """
    terms = token_terms(logprobs, behaviour_logprobs, advantages, response_mask)
    objective, clipped_low, clipped_high = clipped_objective(terms, 1.0 - clip_eps, 1.0 + clip_eps)
    below, above = band_masked(terms, band_low, band_high)
    masked = below | above
    loss_sum, normaliser = aggregate(objective, terms.mask & ~masked, terms.mask, aggregation)
    with torch.no_grad():
        tokens = terms.mask.sum()
        means = clip_stats(terms, clipped_low & ~masked, clipped_high & ~masked) | _band_means(below, above, tokens)
    return LossOutput(loss_sum, normaliser, with_stats(ratio_stats(terms), means=means))
