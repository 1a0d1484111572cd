"""Registry entries ``m2po`` (the paper's second-moment mask) and ``m2po_clip`` (the released code's
derived clip), with their update passes over the whole optimizer update. Formulas: docs/method.md, "M2PO".
"""

from __future__ import annotations

from collections.abc import Callable
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
from megatron_mugrpo.algorithms.veto import broadcast_advantages
from megatron_mugrpo.errors import require
from megatron_mugrpo.metric_names import MASKED_FRAC, stat_name


@dataclass(kw_only=True)
class M2poOptions:
    """``algo.m2po.*`` / ``algo.m2po_clip.*``: the second-moment budget."""

    m2_threshold: float = 0.04
    """τ_M2: the mean (log ρ)² over the kept trust-region tokens must not exceed it."""

    def __post_init__(self) -> None:
        require(self.m2_threshold > 0, f"algo.m2po*.m2_threshold (τ_M2)={self.m2_threshold} must be > 0")


def trust_region(log_ratio: Tensor, advantages: Tensor, response_mask: Tensor) -> Tensor:
    """[B, T] bool: M2PO's trust-region tokens {A > 0 ∧ ρ > 1} ∪ {A < 0 ∧ ρ < 1} on the response.

    These are the tokens whose ratio moved in the direction the objective rewards, i.e. where an
    importance weight can blow up the update; the others are harmless to the trust region.
    """
    adv = broadcast_advantages(advantages, log_ratio)
    lr = log_ratio.detach()
    return response_mask.bool() & (((adv > 0) & (lr > 0)) | ((adv < 0) & (lr < 0)))


@torch.no_grad()
def m2po_mask_greedy(log_ratio: Tensor, advantages: Tensor, response_mask: Tensor, threshold: float) -> Tensor:
    """Reference M2PO masking, one token at a time (slow; for tests).

    While the mean of (log ρ)² over the remaining trust-region tokens exceeds ``threshold``, mask the
    remaining trust-region token with the largest (log ρ)² (first in row-major order on ties).

    Returns:
        [B, T] bool, True for masked tokens.
    """
    region = trust_region(log_ratio, advantages, response_mask).flatten()
    values = log_ratio.detach().double().square().flatten()
    remaining = region.clone()
    while remaining.any() and values[remaining].mean() > threshold:
        remaining[torch.where(remaining, values, -1.0).argmax()] = False
    return (region & ~remaining).view_as(log_ratio)


@torch.no_grad()
def m2po_mask(log_ratio: Tensor, advantages: Tensor, response_mask: Tensor, threshold: float) -> Tensor:
    """Vectorised M2PO masking, equal to ``m2po_mask_greedy`` (no host sync).

    Sort the trust-region (log ρ)² descending; removing the k largest leaves the mean
    (S − C_k) / (n − k) with S the total and C_k the sum of the k largest; the greedy loop stops at
    the first k where that is ≤ τ (all n are masked when no k qualifies).

    Args:
        log_ratio: [B, T] log ρ.
        advantages: [B] or [B, T].
        response_mask: [B, T].
        threshold: τ_M2 > 0.

    Returns:
        [B, T] bool, True for masked tokens.
    """
    if threshold <= 0:
        raise ValueError(f"M2PO threshold τ_M2={threshold} must be > 0 (config: algo.m2_threshold)")
    region = trust_region(log_ratio, advantages, response_mask).flatten()
    # Non-region entries get −1 so that they sort after every region value (which are > 0).
    values = torch.where(region, log_ratio.detach().double().square().flatten(), -1.0)
    ordered, order = torch.sort(values, descending=True, stable=True)
    n = region.sum()
    k = torch.arange(values.numel(), device=values.device)
    removed = torch.cumsum(ordered, 0) - ordered  # sum of the k largest, exact for k < n
    total = torch.where(region, values, 0.0).sum()
    remaining_mean = (total - removed) / (n - k).clamp_min(1)
    ok = (k < n) & (remaining_mean <= threshold)
    num_masked = torch.where(ok.any(), ok.int().argmax(), n)
    rank = torch.empty_like(order)
    rank[order] = k
    return (region & (rank < num_masked)).view_as(log_ratio)


@torch.no_grad()
def m2_clip_bound(log_ratio: Tensor, advantages: Tensor, response_mask: Tensor, threshold: float) -> Tensor:
    """The released M2PO code's clip threshold: τ² as a 0-d float64 tensor (inf: no clipping).

    With v the (log ρ)² of the n trust-region tokens, τ² is the largest v_j such that capping every
    value at it keeps the mean under budget: (1/n) Σ_i min(v_i, v_j) ≤ τ_M2. When the uncapped mean
    already fits, τ² = inf; when no v_j fits, τ² = 0 (the released ``_solve_tau_from_sorted_delta2``
    uses the same breakpoints, with a strict < and a 1e-12 slack).
    """
    if threshold <= 0:
        raise ValueError(f"M2PO threshold τ_M2={threshold} must be > 0 (config: algo.m2_threshold)")
    region = trust_region(log_ratio, advantages, response_mask).flatten()
    values = torch.where(region, log_ratio.detach().double().square().flatten(), torch.inf)
    ordered = torch.sort(values).values  # region values first (ascending), then +inf
    n = region.sum()
    j = torch.arange(values.numel(), device=values.device)
    inside = j < n
    prefix = torch.cumsum(torch.where(inside, ordered, 0.0), 0)
    capped_sum = prefix + torch.where(inside, ordered, 0.0) * (n - 1 - j)  # Σ_i min(v_i, v_j)
    fits = (inside & (capped_sum <= threshold * n)).sum()
    last_fit = ordered[(fits - 1).clamp_min(0)]
    return torch.where(fits == n, torch.inf, torch.where(fits == 0, 0.0, last_fit))


def _update_pass(
    key: str, compute: Callable[[Tensor, Tensor, Tensor, float], Tensor]
) -> Callable[..., dict[str, Tensor]]:
    """An M2PO update pass: ``{key: compute(log ρ, A, mask, τ_M2)}`` over the whole update's tokens."""

    def update_pass(
        logprobs: Tensor,
        behaviour_logprobs: Tensor,
        advantages: Tensor,
        response_mask: Tensor,
        *,
        m2_threshold: float,
        aggregation: str = DEFAULT_AGGREGATION,
    ) -> dict[str, Tensor]:
        terms = token_terms(logprobs, behaviour_logprobs, advantages, response_mask)
        return {key: compute(terms.log_ratio, terms.advantages, terms.mask, m2_threshold)}

    return update_pass


_m2po_update_pass = _update_pass("m2_mask", m2po_mask)
"""``m2_mask`` [B, T]: the M2PO mask over the whole update's tokens."""
_m2po_clip_update_pass = _update_pass("m2_clip_sq_bound", m2_clip_bound)
"""``m2_clip_sq_bound`` (0-d): τ² of the released M2PO code over the whole update's tokens."""


def _m2_stats(terms: TokenTerms, kept_sq: Tensor, kept: Tensor) -> dict[str, tuple[Tensor, Tensor]]:
    """M2 over the trust region before, and of ``kept_sq`` over its ``kept`` tokens after, masking or capping."""
    region = trust_region(terms.log_ratio, terms.advantages, terms.mask)
    sq = terms.log_ratio.detach().square()
    return {
        "m2": (torch.where(region, sq, 0.0).sum(), region.sum()),
        "m2_after": (torch.where(region & kept, kept_sq, 0.0).sum(), (region & kept).sum()),
        "trust_region_frac": (region.sum(), terms.mask.sum()),
    }


@register_loss("m2po", options=M2poOptions, update_pass=_m2po_update_pass)
def m2po_loss(
    logprobs: Tensor,
    behaviour_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    m2_threshold: float = 0.04,
    aggregation: str = DEFAULT_AGGREGATION,
    m2_mask: Tensor | None = None,
) -> LossOutput:
    """M2PO, paper version: unclipped obj_t = ρ_t A on the tokens the M2 mask keeps.

    Our reading of "mask until M2 ≤ τ": M2 is the mean of (log ρ)² over the *remaining trust-region*
    tokens, as the released code measures it (``tr-M2``); averaging over all remaining tokens instead
    would let the many harmless tokens with ρ ≈ 1 dilute the budget. Masked tokens contribute 0 but
    stay in T_y / the normaliser ("averaged over all tokens").

    ``m2_mask`` [B, T] (True = masked) is this call's rows of the mask the update pass computed over
    the WHOLE optimizer update (all micro-batches and data-parallel ranks), so the budget applies to
    the update and the loss does not depend on the micro-batch split. Without it the mask is
    computed over this call's tokens.

    Extra metrics: ``m2`` (trust-region M2 before masking), ``m2_after``, ``m2_masked_tokens``,
    ``m2_masked_frac`` (masked / response tokens; also as the shared ``masked_frac``), ``trust_region_frac``.
    """
    terms = token_terms(logprobs, behaviour_logprobs, advantages, response_mask)
    if m2_mask is None:
        m2_mask = m2po_mask(terms.log_ratio, terms.advantages, terms.mask, m2_threshold)
    masked = m2_mask.bool() & terms.mask
    loss_sum, normaliser = aggregate(terms.ratio * terms.advantages, terms.mask & ~masked, terms.mask, aggregation)
    with torch.no_grad():
        means = _m2_stats(terms, terms.log_ratio.detach().square(), ~masked)
        means["m2_masked_frac"] = means[stat_name(MASKED_FRAC)] = (masked.sum(), terms.mask.sum())
    stats = with_stats(ratio_stats(terms), means=means, sums={"m2_masked_tokens": masked.sum()})
    return LossOutput(loss_sum, normaliser, stats)


@register_loss("m2po_clip", options=M2poOptions, update_pass=_m2po_clip_update_pass)
def m2po_clip_loss(
    logprobs: Tensor,
    behaviour_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    m2_threshold: float = 0.04,
    aggregation: str = DEFAULT_AGGREGATION,
    m2_clip_sq_bound: Tensor | None = None,
) -> LossOutput:
    """M2PO as released (Infini-AI-Lab/M2PO ``compute_m2po_policy_loss``): one derived clip.

    τ = √(``m2_clip_bound``) (capped at LOG_RATIO_CLAMP, which equals "no clip" after the ratio
    clamp), then obj_t = min(ρ_t A, clip(ρ_t, e^−τ, e^τ) A) on every response token. As in the
    release (which is run with ``miniclip_low/high = None``) no minimum clip width is imposed; the
    release aggregates with verl's token-mean by default, here the aggregation is configurable.
    ``m2_clip_sq_bound`` is τ² from the update pass (the whole optimizer update); without it τ² is
    computed over this call's tokens.

    Extra metrics: ``m2`` (trust-region M2), ``m2_after`` (mean of min(v, τ²)), ``m2_clip_log_bound``
    (τ), ``clip_frac_low`` / ``clip_frac_high``, ``trust_region_frac``.
    """
    terms = token_terms(logprobs, behaviour_logprobs, advantages, response_mask)
    tau_sq = m2_clip_sq_bound
    if tau_sq is None:
        tau_sq = m2_clip_bound(terms.log_ratio, terms.advantages, terms.mask, m2_threshold)
    tau = tau_sq.to(terms.ratio.device).sqrt().clamp(max=LOG_RATIO_CLAMP).to(terms.ratio.dtype)
    objective, clipped_low, clipped_high = clipped_objective(terms, torch.exp(-tau), torch.exp(tau))
    loss_sum, normaliser = aggregate(objective, terms.mask, terms.mask, aggregation)
    with torch.no_grad():
        capped = torch.minimum(terms.log_ratio.detach().square(), tau.square())
        means = _m2_stats(terms, capped, terms.mask) | clip_stats(terms, clipped_low, clipped_high)
    stats = with_stats(ratio_stats(terms), means=means, maxima={"m2_clip_log_bound": tau})
    return LossOutput(loss_sum, normaliser, stats)
