"""The μ-GRPO paper's per-update drift diagnostics, for every loss: pure math on [B, T] tensors.

The paper (§3, Figures 2-3, App. C-D) diagnoses collapse through how far the current policy π_θ has
drifted from the behaviour policy β on the stage's rollouts D_k, and where in a response the
drift sits. The losses already report E[ρ | A<0] (``ratio_mean_neg_adv``), E[ρ | A>0]
(``ratio_mean_pos_adv``), the clip fractions (``clip_frac_low`` / ``clip_frac_high``) and, under NAV,
the veto fraction and trigger count (``nav_vetoed_frac``, ``nav_trigger_count``). What a veto does
depends on the loss; what follows does not, so it is measured the same way whatever ``algo.loss``
is, on the ratio ρ_t = π_θ / β of the stored behaviour log-probs, at the update's forward pass (the
weights the optimizer step starts from):

* ``trigger_count``: tokens with A < 0 and ρ < τ_c (NAV's triggers, whether or not NAV is on);
* ``triggered_responses``: responses with at least one trigger;
* ``neg_adv_low_ratio_frac``: the fraction of A < 0 tokens with ρ < τ_c;
* ``trigger_pos_frac``: κ / T_y, the first trigger's position among the response's T_y tokens
  (0-based), averaged over triggered responses;
* ``post_trigger_suffix_len``: the tokens strictly after κ (|S_κ| = T_y − κ − 1), averaged over
  triggered responses: the suffix the paper's App. D locates the harm in;
* ``kl_behaviour_k3``: KL(β ‖ π_θ) on the update's tokens of D_k with the k3 estimator
  E_β[(ρ − 1) − log ρ] (unbiased since E_β[ρ] = 1, never negative; Schulman's "Approximating KL").

Positions count response tokens only (``cumsum`` of the mask), so observation tokens inside a
multi-turn response are skipped, as NAV's κ skips them. τ_c is the run's NAV threshold
(``algo.mu_grpo.veto_threshold``) when the loss has one, else ``DEFAULT_TRIGGER_THRESHOLD``.

Every figure comes as (numerator, denominator) or a count (``LossStats``), so it is exact over
micro-batches and data-parallel ranks: each response lies in one micro-batch.

    stats = drift_stats(logprobs, behaviour_logprobs, advantages, response_mask, threshold=1e-4)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from megatron_mugrpo.algorithms.loss_core import LossStats, token_terms
from megatron_mugrpo.metric_names import (
    KL_BEHAVIOUR_K3,
    NEG_ADV_LOW_RATIO_FRAC,
    POST_TRIGGER_SUFFIX_LEN,
    TRIGGER_COUNT,
    TRIGGER_POS_FRAC,
    stat_name,
)

DEFAULT_TRIGGER_THRESHOLD = 1e-4
"""τ_c of the paper (and NAV's default) for losses that have no NAV threshold of their own."""

DRIFT_METRICS = (
    stat_name(TRIGGER_COUNT),
    "triggered_responses",
    stat_name(NEG_ADV_LOW_RATIO_FRAC),
    stat_name(TRIGGER_POS_FRAC),
    stat_name(POST_TRIGGER_SUFFIX_LEN),
    stat_name(KL_BEHAVIOUR_K3),
)
"""The names ``drift_stats`` adds (the trainer logs them as ``train/<name>``)."""


def trigger_threshold(loss_options: Mapping[str, Any]) -> float:
    """τ_c for the diagnostics: the loss's NAV threshold (``veto_threshold``), else the paper's 1e-4."""
    return float(loss_options.get("veto_threshold", DEFAULT_TRIGGER_THRESHOLD))


@torch.no_grad()
def first_trigger(triggers: Tensor, response_mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """κ and T_y per response.

    Args:
        triggers: [B, T] bool trigger tokens (a subset of the response).
        response_mask: [B, T] bool.

    Returns:
        kappa: [B] long, the first trigger's index among the response tokens (0-based; T_y when none).
        lengths: [B] long, T_y.
        triggered: [B] bool, rows with at least one trigger.
    """
    mask = response_mask.bool()
    lengths = mask.sum(-1)
    position = mask.long().cumsum(-1) - 1  # index among response tokens; -1 before the first
    big = torch.full_like(position, torch.iinfo(torch.long).max)
    kappa = torch.where(triggers, position, big).min(-1).values if triggers.shape[-1] else lengths.clone()
    triggered = triggers.any(-1)
    return torch.where(triggered, kappa, lengths), lengths, triggered


@torch.no_grad()
def drift_stats(
    logprobs: Tensor,
    behaviour_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    threshold: float = DEFAULT_TRIGGER_THRESHOLD,
) -> LossStats:
    """The module's diagnostics as combinable parts.

    Args:
        logprobs: [B, T] log π_θ (the update's forward pass; not differentiated here).
        behaviour_logprobs: [B, T] stored log β.
        advantages: [B] or [B, T].
        response_mask: [B, T] bool or 0/1.
        threshold: τ_c in (0, 1).

    Returns:
        ``LossStats`` with ``means`` for the fractions, positions, lengths and the KL, and ``sums``
        for the counts (names: ``DRIFT_METRICS``).
    """
    if not 0.0 < threshold < 1.0:
        raise ValueError(f"trigger threshold τ_c={threshold} must be in (0, 1) (algo.mu_grpo.veto_threshold)")
    terms = token_terms(logprobs.detach(), behaviour_logprobs, advantages, response_mask)
    mask, log_ratio = terms.mask, terms.log_ratio
    negative = mask & (terms.advantages < 0)
    triggers = negative & (log_ratio < math.log(threshold))
    kappa, lengths, triggered = first_trigger(triggers, mask)
    dtype = log_ratio.dtype
    rows = triggered.sum().to(dtype)
    position = torch.where(triggered, kappa.to(dtype) / lengths.clamp_min(1).to(dtype), 0.0)
    suffix = torch.where(triggered, (lengths - kappa - 1).to(dtype), 0.0)
    k3 = torch.where(mask, log_ratio.exp() - 1.0 - log_ratio, 0.0)
    return LossStats(
        means={
            stat_name(NEG_ADV_LOW_RATIO_FRAC): (triggers.sum().to(dtype), negative.sum().to(dtype)),
            stat_name(TRIGGER_POS_FRAC): (position.sum(), rows),
            stat_name(POST_TRIGGER_SUFFIX_LEN): (suffix.sum(), rows),
            stat_name(KL_BEHAVIOUR_K3): (k3.sum(), mask.sum().to(dtype)),
        },
        sums={stat_name(TRIGGER_COUNT): triggers.sum(), "triggered_responses": triggered.sum()},
    )


def with_drift(stats: LossStats, drift: LossStats) -> LossStats:
    """``stats`` (a loss's) with the drift diagnostics added; a loss's own entry of the same name wins."""
    return LossStats(
        means=drift.means | stats.means,
        sums=drift.sums | stats.sums,
        maxima=stats.maxima,
        ratios=stats.ratios,
    )
