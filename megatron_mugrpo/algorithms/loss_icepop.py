"""Registry entry ``icepop``: token masking outside a ratio band (IcePop, Ring-1T; in verl, NeMo-RL
and OpenRLHF).

A response token whose ratio ρ_t = π_θ / β leaves the band [α, β_band] is masked, whatever the sign
of its advantage: it contributes 0 (masked, not clipped: a clip would keep the token's value and
cut only its gradient on one side) and stays in T_y and the normaliser, as IcePop does. The tokens
inside the band get GRPO's clipped objective. The mask is recomputed at every call and never
differentiated through. Formulas: docs/method.md, "IcePop".

    out = policy_loss("icepop", logprobs, behaviour_logprobs, advantages, mask, band_low=0.5, band_high=5.0)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from megatron_mugrpo.algorithms.loss_core import (
    DEFAULT_AGGREGATION,
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


@dataclass(kw_only=True)
class IcepopOptions:
    """``algo.icepop.*``: GRPO's clip and the ratio band outside which tokens are masked."""

    clip_eps: float = 0.2
    """ε: the ratio is clipped to [1 − ε, 1 + ε] on the tokens kept (GRPO's default)."""
    band_low: float = 0.5
    """α: tokens with ρ < α are masked (IcePop's paper: 0.5)."""
    band_high: float = 5.0
    """β: tokens with ρ > β are masked (IcePop's paper: 5)."""

    def __post_init__(self) -> None:
        require(0.0 < self.clip_eps < 1.0, f"algo.icepop.clip_eps={self.clip_eps} must be in (0, 1)")
        require(
            0.0 <= self.band_low < 1.0 < self.band_high,
            f"algo.icepop band [band_low={self.band_low}, band_high={self.band_high}] must satisfy "
            "0 <= band_low < 1 < band_high (ρ = 1 must stay inside; IcePop uses [0.5, 5])",
        )


@torch.no_grad()
def band_masked(terms: TokenTerms, low: float, high: float) -> tuple[Tensor, Tensor]:
    """[B, T] bool response tokens with ρ < low, and with ρ > high."""
    rho = terms.ratio.detach()
    return terms.mask & (rho < low), terms.mask & (rho > high)


@register_loss("icepop", options=IcepopOptions)
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
) -> LossOutput:
    """IcePop: obj_t = 1[α ≤ ρ_t ≤ β] · min(ρ_t A, clip(ρ_t, 1 − ε, 1 + ε) A). Shapes as in ``policy_loss``.

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
        means = clip_stats(terms, clipped_low & ~masked, clipped_high & ~masked) | {
            "icepop_masked_low_frac": (below.sum(), tokens),
            "icepop_masked_high_frac": (above.sum(), tokens),
            "icepop_masked_frac": (masked.sum(), tokens),
            "masked_frac": (masked.sum(), tokens),
        }
    return LossOutput(loss_sum, normaliser, with_stats(ratio_stats(terms), means=means))
