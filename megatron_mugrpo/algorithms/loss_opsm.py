"""Registry entry ``opsm``: off-policy sequence masking (DeepSeek-V3.2; slime's ``--use-opsm``, TRL).

A negative-advantage response whose sequence-level divergence from the behaviour policy,

    D_y = (1/T_y) Σ_t (log β(y_t) − log π_θ(y_t)) = −mean_t log ρ_t,

exceeds δ is dropped from the loss: the current policy has already moved away from a response the
update pushes further down, the same failure NAV guards against, measured over the whole response
instead of by one collapsed token. Every other token gets GRPO's clipped objective. The mask is
recomputed at every call from the current ratios and never differentiated through; dropped tokens
contribute 0 and stay in T_y and the normaliser. Formulas: docs/method.md, "OPSM".

    out = policy_loss("opsm", logprobs, behaviour_logprobs, advantages, mask, clip_eps=0.2, delta=1e-4)
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
from megatron_mugrpo.metric_names import MASKED_FRAC, stat_name


@dataclass(kw_only=True)
class OpsmOptions:
    """``algo.opsm.*``: GRPO's clip and the sequence-divergence threshold δ."""

    clip_eps: float = 0.2
    """ε: the ratio is clipped to [1 − ε, 1 + ε] on the tokens kept (GRPO's default)."""
    delta: float = 1e-4
    """δ: a negative-advantage response with mean_t (log β − log π_θ) > δ is dropped (slime's
    ``--opsm-delta`` default, 1e-4)."""

    def __post_init__(self) -> None:
        require(0.0 < self.clip_eps < 1.0, f"algo.opsm.clip_eps={self.clip_eps} must be in (0, 1)")
        require(
            self.delta >= 0,
            f"algo.opsm.delta={self.delta} must be >= 0: it bounds a mean log-ratio from above (slime uses 1e-4)",
        )


@torch.no_grad()
def opsm_drop(terms: TokenTerms, delta: float) -> tuple[Tensor, Tensor]:
    """Which responses OPSM drops.

    Returns:
        dropped: [B, T] bool, every response token of a dropped response.
        divergence: [B] D_y = −mean_t log ρ_t over the response (0 for an empty row).
    """
    mask = terms.mask
    lengths = mask.sum(-1).clamp_min(1).to(terms.log_ratio.dtype)
    divergence = -terms.log_ratio.detach().sum(-1) / lengths
    negative = (mask & (terms.advantages < 0)).any(-1)
    rows = negative & (divergence > delta)
    return mask & rows[:, None], divergence


@register_loss("opsm", options=OpsmOptions)
def opsm_loss(
    logprobs: Tensor,
    behaviour_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_eps: float = 0.2,
    delta: float = 1e-4,
    aggregation: str = DEFAULT_AGGREGATION,
) -> LossOutput:
    """OPSM: obj_t = min(ρ_t A, clip(ρ_t, 1 − ε, 1 + ε) A) on the responses ``opsm_drop`` keeps.

    Shapes as in ``policy_loss``. A response is negative when its tokens' advantage is < 0 (with
    per-token advantages, any of them). Extra metrics: ``opsm_masked_responses`` (count),
    ``opsm_masked_frac`` and the shared ``masked_frac`` (dropped / response tokens),
    ``opsm_divergence_neg_adv`` (mean D_y over negative-advantage responses).
    """
    terms = token_terms(logprobs, behaviour_logprobs, advantages, response_mask)
    objective, clipped_low, clipped_high = clipped_objective(terms, 1.0 - clip_eps, 1.0 + clip_eps)
    dropped, divergence = opsm_drop(terms, delta)
    loss_sum, normaliser = aggregate(objective, terms.mask & ~dropped, terms.mask, aggregation)
    with torch.no_grad():
        tokens = terms.mask.sum()
        negative = (terms.mask & (terms.advantages < 0)).any(-1)
        masked = (dropped.sum(), tokens)
        means = clip_stats(terms, clipped_low & ~dropped, clipped_high & ~dropped) | {
            "opsm_masked_frac": masked,
            stat_name(MASKED_FRAC): masked,
            "opsm_divergence_neg_adv": (torch.where(negative, divergence, 0.0).sum(), negative.sum()),
        }
        sums = {"opsm_masked_responses": dropped.any(-1).sum()}
    return LossOutput(loss_sum, normaliser, with_stats(ratio_stats(terms), means=means, sums=sums))
