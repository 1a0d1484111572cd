"""The policy-loss family of μ-GRPO and its baselines, as pure functions on [B, T] tensors.

Every loss takes the current log-probs log π_θ(a_t|s_t) ``[B, T]``, the stored behaviour log-probs
b_t ``[B, T]``, the advantages (``[B]`` per response or ``[B, T]`` per token) and the response mask
``[B, T]``, and returns ``LossOutput(loss_sum, normaliser, metrics)``:

* ``loss_sum`` (0-d, differentiable) is the **negated** objective summed at this call's
  granularity: the value to MINIMISE is −J. The full-batch loss is
  ``Σ loss_sum / Σ normaliser`` over micro-batches and data-parallel ranks, which is exact because
  the normaliser never depends on θ or on θ-dependent masks (NAV, M2PO): a vetoed or masked token
  contributes 0 to the numerator but still counts in T_y and in the token count.
* ``normaliser`` (0-d float, no grad): for ``seq_mean_token_mean`` (the paper's Eq. 2,
  J = (1/|B|) Σ_y (1/T_y) Σ_t m_t · obj_t) the number of responses with T_y > 0, with
  ``loss_sum = −Σ_y (1/T_y) Σ_t m_t · obj_t``; for ``token_mean`` the number of response tokens
  Σ m_t, with ``loss_sum = −Σ_{y,t} m_t · obj_t``.
* ``metrics``: plain floats over this call's tokens, names without prefix (the trainer adds
  ``train/``): clip fractions, NAV counts, E[ρ|A<0], E[ρ|A>0], ratio quantiles, M2, ...

Registry entries (``policy_loss(name, ...)``, options = ``AlgoConfig.loss_options()``):

* ``grpo``      min(ρA, clip(ρ, 1−ε, 1+ε)A).
* ``mu_grpo``   min(ρA, clip(ρ, c_low, c_high)A), default [0, 5], plus NAV (``veto.py``).
* ``m2po``      paper M2PO: mask the trust-region tokens with the largest (log ρ)² until the M2 of the
                remaining trust-region tokens is ≤ τ_M2, then the unclipped ρA.
* ``m2po_clip`` the released M2PO code's variant: one symmetric log-ratio bound τ derived from the
                same M2 budget, then the PPO-clipped objective with clip [e^−τ, e^τ].

The ratio is ρ_t = exp(log π_θ − b_t) with the log-ratio clamped to ±``LOG_RATIO_CLAMP`` first.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from megatron_mugrpo.algorithms.veto import broadcast_advantages, veto_mask
from megatron_mugrpo.config import AGGREGATIONS

LOG_RATIO_CLAMP = 20.0
"""|log ρ| is clamped to this before exp: e^20 ≈ 4.9e8 stays finite in float32 (and bf16) where an
unclamped exp of a large log-ratio would give inf and inf·0 = NaN gradients. Tokens beyond it have a
frozen ratio (zero gradient); with ρ < 2e-9 or ρ > 4.9e8 the token is numerically broken anyway."""
QUANTILES = (0.01, 0.5, 0.99)
"""Ratio quantiles reported as ratio_p01 / ratio_p50 / ratio_p99."""
DEFAULT_AGGREGATION = "seq_mean_token_mean"


class LossOutput(NamedTuple):
    """What every registry loss returns (a tuple: ``loss_sum, normaliser, metrics = out``)."""

    loss_sum: Tensor
    """0-d: −(objective summed at the aggregation's granularity); differentiable."""
    normaliser: Tensor
    """0-d float: responses with T_y > 0 (seq_mean_token_mean) or response tokens (token_mean)."""
    metrics: dict[str, float]


class TokenTerms(NamedTuple):
    """Per-token quantities shared by the losses; all [B, T] in the compute dtype."""

    log_ratio: Tensor
    """log ρ, differentiable w.r.t. the current log-probs; 0 off the response; clamped."""
    ratio: Tensor
    """ρ = exp(log_ratio)."""
    advantages: Tensor
    """A broadcast to [B, T], 0 off the response, no grad."""
    mask: Tensor
    """bool response mask."""
    clamped: Tensor
    """bool: response tokens whose log-ratio hit ±LOG_RATIO_CLAMP."""


LossFn = Callable[..., LossOutput]
_REGISTRY: dict[str, LossFn] = {}


def register_loss(name: str) -> Callable[[LossFn], LossFn]:
    """Decorator adding a loss to the registry under ``name``."""

    def add(fn: LossFn) -> LossFn:
        if name in _REGISTRY:
            raise ValueError(f"policy loss {name!r} is registered twice")
        _REGISTRY[name] = fn
        return fn

    return add


def available_losses() -> tuple[str, ...]:
    """Names accepted by ``policy_loss``."""
    return tuple(_REGISTRY)


def policy_loss(
    name: str,
    logprobs: Tensor,
    behaviour_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    **options: object,
) -> LossOutput:
    """Compute registry loss ``name``; see the module docstring for the contract.

    Args:
        name: registry entry (``available_losses()``).
        logprobs: [B, T] current log π_θ(a_t|s_t), aligned with the targets; carries the gradient.
        behaviour_logprobs: [B, T] stored log β(a_t|s_t) (detached here).
        advantages: [B] or [B, T].
        response_mask: [B, T] bool or 0/1 float.
        **options: exactly the loss's keyword options (``AlgoConfig.loss_options()``).
    """
    if name not in _REGISTRY:
        raise ValueError(f"unknown policy loss {name!r}; choose one of {available_losses()} (config: algo.loss)")
    fn = _REGISTRY[name]
    accepted = {p.name for p in inspect.signature(fn).parameters.values() if p.kind is p.KEYWORD_ONLY}
    unknown = sorted(set(options) - accepted)
    if unknown:
        raise TypeError(
            f"policy loss {name!r} does not take option(s) {unknown}; it takes {sorted(accepted)} "
            "(pass AlgoConfig.loss_options())"
        )
    return fn(logprobs, behaviour_logprobs, advantages, response_mask, **options)


# ---------------------------------------------------------------------------------------------
# Shared pieces
# ---------------------------------------------------------------------------------------------


def token_terms(logprobs: Tensor, behaviour_logprobs: Tensor, advantages: Tensor, response_mask: Tensor) -> TokenTerms:
    """Validate shapes and compute log ρ, ρ and [B, T] advantages.

    Computation happens in float32 at least (float64 stays float64). Positions off the response get
    log ρ = 0 through ``torch.where``, so garbage (even ±inf) in padded log-probs cannot leak NaNs into
    the loss or its gradient.
    """
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [B, T], got shape {tuple(logprobs.shape)}")
    for label, tensor in (("behaviour_logprobs", behaviour_logprobs), ("response_mask", response_mask)):
        if tensor.shape != logprobs.shape:
            raise ValueError(
                f"{label} has shape {tuple(tensor.shape)} but logprobs has {tuple(logprobs.shape)}; "
                "both must be [B, T] aligned with the targets"
            )
    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    mask = response_mask.bool()
    raw = torch.where(mask, logprobs.to(dtype) - behaviour_logprobs.detach().to(dtype), 0.0)
    log_ratio = raw.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    adv = broadcast_advantages(advantages.detach().to(dtype), logprobs)
    return TokenTerms(
        log_ratio=log_ratio,
        ratio=log_ratio.exp(),
        advantages=torch.where(mask, adv, 0.0),
        mask=mask,
        clamped=mask & (raw.detach().abs() > LOG_RATIO_CLAMP),
    )


def clipped_objective(terms: TokenTerms, low: float | Tensor, high: float | Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """PPO surrogate min(ρA, clip(ρ, low, high)A).

    Returns:
        objective: [B, T].
        clipped_low: [B, T] bool, tokens where the lower clip binds (A < 0, ρ < low; zero gradient).
        clipped_high: [B, T] bool, tokens where the upper clip binds (A > 0, ρ > high; zero gradient).
    """
    rho, adv = terms.ratio, terms.advantages
    objective = torch.minimum(rho * adv, rho.clamp(low, high) * adv)
    with torch.no_grad():
        clipped_low = terms.mask & (adv < 0) & (rho < low)
        clipped_high = terms.mask & (adv > 0) & (rho > high)
    return objective, clipped_low, clipped_high


def loss_normaliser(response_mask: Tensor, aggregation: str, dtype: torch.dtype = torch.float32) -> Tensor:
    """The normaliser of ``aggregation`` for a [B, T] response mask (0-d tensor of ``dtype``).

    The trainer can call this on a whole mini-batch before the forward passes to scale each
    micro-batch's ``loss_sum``; it equals the sum of the per-call normalisers.
    """
    lengths = response_mask.bool().sum(-1)
    if aggregation == "seq_mean_token_mean":
        return (lengths > 0).sum().to(dtype)
    if aggregation == "token_mean":
        return lengths.sum().to(dtype)
    raise ValueError(f"unknown aggregation {aggregation!r}; choose one of {AGGREGATIONS} (config: algo.aggregation)")


def aggregate(objective: Tensor, keep: Tensor, response_mask: Tensor, aggregation: str) -> tuple[Tensor, Tensor]:
    """(loss_sum, normaliser) of a per-token objective; see the module docstring.

    Args:
        objective: [B, T] per-token objective (to maximise).
        keep: [B, T] bool, tokens that contribute (response tokens minus vetoed / masked ones).
        response_mask: [B, T] bool; defines T_y and the normaliser (independent of ``keep``).
        aggregation: ``seq_mean_token_mean`` or ``token_mean``.
    """
    normaliser = loss_normaliser(response_mask, aggregation, objective.dtype)
    kept = torch.where(keep, objective, 0.0)
    if aggregation == "seq_mean_token_mean":
        lengths = response_mask.sum(-1).to(objective.dtype).clamp_min(1.0)
        return -(kept.sum(-1) / lengths).sum(), normaliser
    return -kept.sum(), normaliser


def trust_region(log_ratio: Tensor, advantages: Tensor, response_mask: Tensor) -> Tensor:
    """[B, T] bool: M2PO's trust-region tokens {A > 0 ∧ ρ > 1} ∪ {A < 0 ∧ ρ < 1} on the response.

    These are the tokens whose ratio moved in the direction the objective rewards, i.e. where an
    importance weight can blow up the update; the others are harmless to the trust region.
    """
    adv = broadcast_advantages(advantages, log_ratio)
    lr = log_ratio.detach()
    return response_mask.bool() & (((adv > 0) & (lr > 0)) | ((adv < 0) & (lr < 0)))


def _masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    return torch.where(mask, values, 0.0).sum() / mask.sum().clamp_min(1)


def _quantiles(values: Tensor, qs: tuple[float, ...]) -> Tensor:
    """Linear-interpolation quantiles of a 1-D tensor (as torch.quantile, without its size limit)."""
    if values.numel() == 0:
        return torch.zeros(len(qs), dtype=torch.float64, device=values.device)
    ordered = values.double().sort().values
    pos = torch.tensor(qs, dtype=torch.float64, device=values.device) * (values.numel() - 1)
    lo, hi = pos.floor().long(), pos.ceil().long()
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@torch.no_grad()
def ratio_metrics(terms: TokenTerms) -> dict[str, Tensor]:
    """Diagnostics shared by every loss (0-d tensors; ``finish_metrics`` turns them into floats)."""
    mask, rho, lr, adv = terms.mask, terms.ratio.detach(), terms.log_ratio.detach(), terms.advantages
    p01, p50, p99 = _quantiles(rho[mask], QUANTILES).unbind()
    return {
        "num_tokens": mask.sum(),
        "num_responses": mask.any(-1).sum(),
        "ratio_mean": _masked_mean(rho, mask),
        "ratio_mean_neg_adv": _masked_mean(rho, mask & (adv < 0)),
        "ratio_mean_pos_adv": _masked_mean(rho, mask & (adv > 0)),
        "ratio_p01": p01,
        "ratio_p50": p50,
        "ratio_p99": p99,
        "log_ratio_sq_mean": _masked_mean(lr.square(), mask),
        "logprob_gap_abs_mean": _masked_mean(lr.abs(), mask),
        "logprob_gap_abs_max": torch.where(mask, lr.abs(), 0.0).max() if mask.numel() else lr.new_zeros(()),
        "log_ratio_clamped_frac": _masked_mean(terms.clamped.to(lr.dtype), mask),
    }


def clip_metrics(terms: TokenTerms, clipped_low: Tensor, clipped_high: Tensor) -> dict[str, Tensor]:
    """clip_frac_low / clip_frac_high: fractions of response tokens where a clip bound binds."""
    count = terms.mask.sum().clamp_min(1)
    return {"clip_frac_low": clipped_low.sum() / count, "clip_frac_high": clipped_high.sum() / count}


def finish_metrics(metrics: dict[str, Tensor | float]) -> dict[str, float]:
    """Convert 0-d tensors to floats with a single device-to-host copy."""
    names = [k for k, v in metrics.items() if isinstance(v, Tensor)]
    values = torch.stack([metrics[k].detach().to(torch.float64) for k in names]).tolist() if names else []
    out = {k: float(v) for k, v in metrics.items() if not isinstance(v, Tensor)}
    out.update(zip(names, values))
    return out


# ---------------------------------------------------------------------------------------------
# Registry entries
# ---------------------------------------------------------------------------------------------


@register_loss("grpo")
def grpo_loss(
    logprobs: Tensor,
    behaviour_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_eps: float = 0.2,
    aggregation: str = DEFAULT_AGGREGATION,
) -> LossOutput:
    """Standard GRPO: obj_t = min(ρ_t A, clip(ρ_t, 1 − ε, 1 + ε) A). Shapes as in ``policy_loss``."""
    if not 0.0 < clip_eps < 1.0:
        raise ValueError(f"grpo clip_eps={clip_eps} must be in (0, 1) (config: algo.clip_eps)")
    terms = token_terms(logprobs, behaviour_logprobs, advantages, response_mask)
    objective, clipped_low, clipped_high = clipped_objective(terms, 1.0 - clip_eps, 1.0 + clip_eps)
    loss_sum, normaliser = aggregate(objective, terms.mask, terms.mask, aggregation)
    metrics = ratio_metrics(terms) | clip_metrics(terms, clipped_low, clipped_high)
    return LossOutput(loss_sum, normaliser, finish_metrics(metrics))


@register_loss("mu_grpo")
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
    ``nav_vetoed_frac`` (vetoed / response tokens).
    """
    if not 0.0 <= clip_low <= clip_high:
        raise ValueError(f"mu_grpo needs 0 <= clip_low <= clip_high, got [{clip_low}, {clip_high}] (algo.clip_*)")
    if veto_threshold <= math.exp(-LOG_RATIO_CLAMP):
        raise ValueError(
            f"veto_threshold={veto_threshold} is below exp(-{LOG_RATIO_CLAMP}), the smallest ratio the loss "
            "resolves; use a larger algo.veto_threshold (the paper uses 1e-4)"
        )
    terms = token_terms(logprobs, behaviour_logprobs, advantages, response_mask)
    objective, clipped_low, clipped_high = clipped_objective(terms, clip_low, clip_high)
    keep, nav = veto_mask(terms.log_ratio, terms.advantages, terms.mask, scope=veto_scope, threshold=veto_threshold)
    loss_sum, normaliser = aggregate(objective, keep, terms.mask, aggregation)
    nav["nav_vetoed_frac"] = nav["nav_vetoed_tokens"] / terms.mask.sum().clamp_min(1)
    metrics = ratio_metrics(terms) | clip_metrics(terms, clipped_low, clipped_high) | nav
    return LossOutput(loss_sum, normaliser, finish_metrics(metrics))


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


@register_loss("m2po")
def m2po_loss(
    logprobs: Tensor,
    behaviour_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    m2_threshold: float = 0.04,
    aggregation: str = DEFAULT_AGGREGATION,
) -> LossOutput:
    """M2PO, paper version: unclipped obj_t = ρ_t A on the tokens the M2 mask keeps.

    Our reading of "mask until M2 ≤ τ": M2 is the mean of (log ρ)² over the *remaining trust-region*
    tokens, as DESIGN.md states and as the released code measures it (``tr-M2``); averaging over all
    remaining tokens instead would let the many harmless tokens with ρ ≈ 1 dilute the budget.
    Masked tokens contribute 0 but stay in T_y / the normaliser ("averaged over all tokens").
    The mask is computed over this call's tokens, so unlike grpo / mu_grpo the loss depends on how
    a mini-batch is split into micro-batches (as in the released code).

    Extra metrics: ``m2`` (trust-region M2 before masking), ``m2_after``, ``m2_masked_tokens``,
    ``m2_masked_frac`` (masked / response tokens), ``trust_region_frac``.
    """
    terms = token_terms(logprobs, behaviour_logprobs, advantages, response_mask)
    masked = m2po_mask(terms.log_ratio, terms.advantages, terms.mask, m2_threshold)
    loss_sum, normaliser = aggregate(terms.ratio * terms.advantages, terms.mask & ~masked, terms.mask, aggregation)
    with torch.no_grad():
        region = trust_region(terms.log_ratio, terms.advantages, terms.mask)
        sq = terms.log_ratio.detach().square()
        count = terms.mask.sum().clamp_min(1)
        extra = {
            "m2": _masked_mean(sq, region),
            "m2_after": _masked_mean(sq, region & ~masked),
            "m2_masked_tokens": masked.sum(),
            "m2_masked_frac": masked.sum() / count,
            "trust_region_frac": region.sum() / count,
        }
    return LossOutput(loss_sum, normaliser, finish_metrics(ratio_metrics(terms) | extra))


@register_loss("m2po_clip")
def m2po_clip_loss(
    logprobs: Tensor,
    behaviour_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    m2_threshold: float = 0.04,
    aggregation: str = DEFAULT_AGGREGATION,
) -> LossOutput:
    """M2PO as released (Infini-AI-Lab/M2PO ``compute_m2po_policy_loss``): one derived clip.

    τ = √(``m2_clip_bound``) (capped at LOG_RATIO_CLAMP, which equals "no clip" after the ratio
    clamp), then obj_t = min(ρ_t A, clip(ρ_t, e^−τ, e^τ) A) on every response token. As in the
    release (which is run with ``miniclip_low/high = None``) no minimum clip width is imposed; the
    release aggregates with verl's token-mean by default, here the aggregation is configurable.

    Extra metrics: ``m2`` (trust-region M2), ``m2_after`` (mean of min(v, τ²)), ``m2_clip_log_bound``
    (τ), ``clip_frac_low`` / ``clip_frac_high``, ``trust_region_frac``.
    """
    terms = token_terms(logprobs, behaviour_logprobs, advantages, response_mask)
    tau_sq = m2_clip_bound(terms.log_ratio, terms.advantages, terms.mask, m2_threshold)
    tau = tau_sq.sqrt().clamp(max=LOG_RATIO_CLAMP).to(terms.ratio.dtype)
    objective, clipped_low, clipped_high = clipped_objective(terms, torch.exp(-tau), torch.exp(tau))
    loss_sum, normaliser = aggregate(objective, terms.mask, terms.mask, aggregation)
    with torch.no_grad():
        region = trust_region(terms.log_ratio, terms.advantages, terms.mask)
        sq = terms.log_ratio.detach().square()
        extra = {
            "m2": _masked_mean(sq, region),
            "m2_after": _masked_mean(torch.minimum(sq, tau.square()), region),
            "m2_clip_log_bound": tau,
            "trust_region_frac": region.sum() / terms.mask.sum().clamp_min(1),
        }
    metrics = ratio_metrics(terms) | clip_metrics(terms, clipped_low, clipped_high) | extra
    return LossOutput(loss_sum, normaliser, finish_metrics(metrics))
