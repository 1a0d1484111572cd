"""Registry entries ``grpo`` (the clipped surrogate, with verl's optional dual clip) and ``mu_grpo``
(relaxed clip plus the negative-advantage veto). Formulas: docs/method.md, "Per-token objectives".

    out = policy_loss("grpo", logprobs, behaviour_logprobs, advantages, mask, clip_eps=0.2, dual_clip_c=3.0)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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
from megatron_mugrpo.algorithms.veto import VETO_SCOPES, veto_mask
from megatron_mugrpo.errors import require
from megatron_mugrpo.metric_names import MASKED_FRAC, VETO_FRAC, stat_name


@dataclass(kw_only=True)
class GrpoOptions:
    """``algo.grpo.*``: standard GRPO's symmetric ratio clip, and optionally verl's dual clip."""

    clip_eps: float = 0.2
    """ε: the ratio is clipped to [1 − ε, 1 + ε]."""
    dual_clip_c: float = 0.0
    """c > 1: dual clip (verl's ``clip_ratio_c``, default 3 there): a negative-advantage token's
    objective is floored at c·A, i.e. its loss capped at c·|A|, with zero gradient, once ρ > c.
    0 (default): off, as in the GRPO paper and μ-GRPO."""

    def __post_init__(self) -> None:
        require(0.0 < self.clip_eps < 1.0, f"algo.grpo.clip_eps={self.clip_eps} must be in (0, 1)")
        require(
            self.dual_clip_c == 0 or self.dual_clip_c > 1,
            f"algo.grpo.dual_clip_c={self.dual_clip_c} must be 0 (off) or > 1 (verl's clip_ratio_c, e.g. 3): "
            "the cap applies to ratios above it",
        )


@dataclass(kw_only=True)
class MuGrpoOptions:
    """``algo.mu_grpo.*``: relaxed clipping and the negative-advantage veto (NAV)."""

    clip_low: float = 0.0
    """Lower ratio clip c_low (μ-GRPO: 0)."""
    clip_high: float = 5.0
    """Upper ratio clip c_high (μ-GRPO: 5)."""
    veto_scope: str = "seq"
    """NAV scope: seq (whole response) | suffix (after κ) | nontrigger_suffix | trigger | none."""
    veto_threshold: float = 1e-4
    """τ_c: a negative-advantage token with ρ < τ_c triggers the veto."""

    def __post_init__(self) -> None:
        require(self.clip_low >= 0, f"algo.mu_grpo.clip_low={self.clip_low} must be >= 0 (ρ is non-negative)")
        require(
            self.clip_low <= self.clip_high,
            f"algo.mu_grpo.clip_low={self.clip_low} > algo.mu_grpo.clip_high={self.clip_high}: "
            "swap them or lower clip_low",
        )
        require(
            self.veto_scope in VETO_SCOPES,
            f"algo.mu_grpo.veto_scope={self.veto_scope!r} is unknown; choose one of {VETO_SCOPES}",
        )
        require(
            0 < self.veto_threshold < 1,
            f"algo.mu_grpo.veto_threshold (τ_c)={self.veto_threshold} must be in (0, 1); the paper uses 1e-4",
        )
        require(
            self.veto_threshold > math.exp(-LOG_RATIO_CLAMP),
            f"algo.mu_grpo.veto_threshold={self.veto_threshold} is below exp(-{LOG_RATIO_CLAMP}), the smallest "
            "ratio the loss resolves; use a larger threshold (the paper uses 1e-4)",
        )


def dual_clipped(terms: TokenTerms, objective: Tensor, c: float) -> tuple[Tensor, Tensor]:
    """verl's dual clip on a clipped objective: max(obj, c·A) where A < 0, unchanged elsewhere.

    For A < 0 and ρ > c the clipped objective is ρA < cA, so the floor binds: the value is the
    constant cA (no gradient). Returns the objective [B, T] and the bool [B, T] tokens where it binds.
    """
    adv = terms.advantages
    floored = torch.where(adv < 0, torch.maximum(objective, c * adv), objective)
    with torch.no_grad():
        binds = terms.mask & (adv < 0) & (terms.ratio > c)
    return floored, binds


@register_loss("grpo", options=GrpoOptions)
def grpo_loss(
    logprobs: Tensor,
    behaviour_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_eps: float = 0.2,
    dual_clip_c: float = 0.0,
    aggregation: str = DEFAULT_AGGREGATION,
) -> LossOutput:
    """Standard GRPO: obj_t = min(ρ_t A, clip(ρ_t, 1 − ε, 1 + ε) A). Shapes as in ``policy_loss``.

    With ``dual_clip_c`` = c > 1, negative-advantage tokens get max(obj_t, c·A) (``dual_clipped``);
    extra metric ``dual_clip_frac`` (tokens where the cap binds / response tokens).
    """
    terms = token_terms(logprobs, behaviour_logprobs, advantages, response_mask)
    objective, clipped_low, clipped_high = clipped_objective(terms, 1.0 - clip_eps, 1.0 + clip_eps)
    means = clip_stats(terms, clipped_low, clipped_high)
    if dual_clip_c > 0:
        objective, capped = dual_clipped(terms, objective, dual_clip_c)
        means["dual_clip_frac"] = (capped.sum(), terms.mask.sum())
    loss_sum, normaliser = aggregate(objective, terms.mask, terms.mask, aggregation)
    return LossOutput(loss_sum, normaliser, with_stats(ratio_stats(terms), means=means))


@register_loss("mu_grpo", options=MuGrpoOptions)
def mu_grpo_loss(
    logprobs: Tensor,
    behaviour_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_low: float = 0.0,
    clip_high: float = 5.0,
    veto_scope: str = "seq",
    veto_threshold: float = 1e-4,
    aggregation: str = DEFAULT_AGGREGATION,
) -> LossOutput:
    """μ-GRPO: obj_t = min(ρ_t A, clip(ρ_t, c_low, c_high) A) on the tokens NAV keeps.

    Vetoed tokens contribute 0 but stay in T_y and in the normaliser (the veto zero-weights tokens; it
    does not change the estimator's normalisation, so micro-batches still combine exactly).
    Extra metrics: ``nav_trigger_count``, ``nav_triggered_responses``, ``nav_vetoed_tokens``,
    ``nav_vetoed_frac`` (vetoed / response tokens) and its shared name ``masked_frac``.
    """
    terms = token_terms(logprobs, behaviour_logprobs, advantages, response_mask)
    objective, clipped_low, clipped_high = clipped_objective(terms, clip_low, clip_high)
    keep, nav = veto_mask(terms.log_ratio, terms.advantages, terms.mask, scope=veto_scope, threshold=veto_threshold)
    loss_sum, normaliser = aggregate(objective, keep, terms.mask, aggregation)
    vetoed = (nav["nav_vetoed_tokens"], terms.mask.sum())
    stats = with_stats(
        ratio_stats(terms),
        means=clip_stats(terms, clipped_low, clipped_high)
        | {stat_name(VETO_FRAC): vetoed, stat_name(MASKED_FRAC): vetoed},
        sums=nav,
    )
    return LossOutput(loss_sum, normaliser, stats)
