"""NAV, the negative-advantage veto of μ-GRPO.

With relaxed clipping (ρ clipped to [0, 5]) a stale negative-advantage response keeps contributing
updates after some of its tokens have collapsed under the current policy (ρ ≈ 0). NAV removes such
responses, or parts of them, from the loss: a token is a **trigger** when its response has A < 0 and its ratio
ρ_t < τ_c; κ(y) is the first trigger position of response y. Depending on the scope, tokens of the
negative-advantage response that has at least one trigger are removed from the loss:

* ``seq`` (default): the whole response (S_seq);
* ``suffix``: tokens strictly after κ (S_κ; κ itself stays);
* ``nontrigger_suffix``: tokens strictly after κ that are not triggers themselves (H_κ = S_κ \\ T);
* ``trigger``: only the trigger tokens (T; a diagnostic, the paper shows it still collapses);
* ``none``: nothing.

The mask is recomputed on every call from the current ratios and is never differentiated through.
Positive-advantage (and zero-advantage) tokens are never vetoed.

    keep, stats = veto_mask(log_ratio, advantages, response_mask, scope="seq", threshold=1e-4)
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

VETO_SCOPES = ("seq", "suffix", "nontrigger_suffix", "trigger", "none")
"""NAV scopes (algo.mu_grpo.veto_scope): S_seq, S_κ, H_κ = S_κ \\ T, T, and no veto."""


def broadcast_advantages(advantages: Tensor, like: Tensor) -> Tensor:
    """Return advantages as [B, T]: a [B] tensor is broadcast over the T positions of ``like``."""
    if advantages.dim() == 1 and advantages.shape[0] == like.shape[0]:
        return advantages[:, None].expand_as(like)
    if advantages.shape == like.shape:
        return advantages
    raise ValueError(
        f"advantages has shape {tuple(advantages.shape)}; expected [B]={like.shape[0]} (one per response) "
        f"or [B, T]={tuple(like.shape)} (per token, aligned with the log-probs)"
    )


@torch.no_grad()
def nav_triggers(log_ratio: Tensor, advantages: Tensor, response_mask: Tensor, threshold: float) -> Tensor:
    """Trigger tokens: response tokens with A < 0 and ρ < τ_c.

    Args:
        log_ratio: [B, T] log ρ = log π_θ − log β.
        advantages: [B] or [B, T].
        response_mask: [B, T] bool or 0/1 float.
        threshold: τ_c in (0, 1).

    Returns:
        [B, T] bool. The comparison is done in log space (log ρ < log τ_c), so it cannot overflow.
    """
    if not 0.0 < threshold < 1.0:
        raise ValueError(f"NAV threshold τ_c={threshold} must be in (0, 1); the paper uses 1e-4")
    adv = broadcast_advantages(advantages, log_ratio)
    return response_mask.bool() & (adv < 0) & (log_ratio.detach() < math.log(threshold))


@torch.no_grad()
def veto_mask(
    log_ratio: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    scope: str = "seq",
    threshold: float = 1e-4,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Which response tokens stay in the loss under NAV.

    Args:
        log_ratio: [B, T] log ρ_t (any dtype; only compared, never differentiated).
        advantages: [B] (one per response) or [B, T] (per token).
        response_mask: [B, T] bool or 0/1 float; 1 on response tokens.
        scope: one of ``VETO_SCOPES``.
        threshold: τ_c; a negative-advantage token with ρ < τ_c is a trigger.

    Returns:
        keep: [B, T] bool, detached: response tokens that are not vetoed (False off the response).
        stats: 0-d tensors (no device sync): ``nav_trigger_count`` (trigger tokens),
            ``nav_triggered_responses`` (responses with at least one trigger) and
            ``nav_vetoed_tokens`` (response tokens removed from the loss).
    """
    if scope not in VETO_SCOPES:
        raise ValueError(f"unknown NAV scope {scope!r}; choose one of {VETO_SCOPES} (config: algo.mu_grpo.veto_scope)")
    mask = response_mask.bool()
    negative = mask & (broadcast_advantages(advantages, log_ratio) < 0)
    triggers = nav_triggers(log_ratio, advantages, mask, threshold)
    # Triggers strictly before position t: > 0 exactly on the suffix S_κ = {t > κ}.
    triggers_before = torch.cumsum(triggers.int(), dim=-1) - triggers.int()
    after_kappa = triggers_before > 0
    triggered_rows = triggers.any(dim=-1, keepdim=True)

    if scope == "seq":
        vetoed = negative & triggered_rows
    elif scope == "suffix":
        vetoed = negative & after_kappa
    elif scope == "nontrigger_suffix":
        vetoed = negative & after_kappa & ~triggers
    elif scope == "trigger":
        vetoed = triggers
    else:
        vetoed = torch.zeros_like(mask)

    stats = {
        "nav_trigger_count": triggers.sum(),
        "nav_triggered_responses": triggered_rows.sum(),
        "nav_vetoed_tokens": vetoed.sum(),
    }
    return mask & ~vetoed, stats
