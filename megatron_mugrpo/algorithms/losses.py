"""The policy-loss family of μ-GRPO and its baselines, as pure functions on [B, T] tensors.

Every loss takes the current log-probs log π_θ(a_t|s_t) ``[B, T]``, the stored behaviour log-probs
b_t ``[B, T]``, the advantages (``[B]`` per response or ``[B, T]`` per token) and the response mask
``[B, T]``, and returns ``LossOutput(loss_sum, normaliser, stats)``:

* ``loss_sum`` (0-d, differentiable) is the **negated** objective summed at this call's
  granularity: the value to MINIMISE is −J. The full-batch loss is
  ``Σ loss_sum / Σ normaliser`` over micro-batches and data-parallel ranks, which is exact because
  the normaliser never depends on θ or on θ-dependent masks (NAV, M2PO): a vetoed or masked token
  contributes 0 to the numerator but still counts in T_y and in the token count.
* ``normaliser`` (0-d float, no grad): for ``seq_mean_token_mean`` (the paper's Eq. 2,
  J = (1/|B|) Σ_y (1/T_y) Σ_t m_t · obj_t) the number of responses with T_y > 0, with
  ``loss_sum = −Σ_y (1/T_y) Σ_t m_t · obj_t``; for ``token_mean`` the number of response tokens
  Σ m_t, with ``loss_sum = −Σ_{y,t} m_t · obj_t``.
* ``stats`` (``LossStats``): the diagnostics (clip fractions, NAV counts, E[ρ|A<0], E[ρ|A>0], ratio
  quantiles, M2, ...) as parts that combine exactly across micro-batches and ranks: fractions as
  (numerator, denominator), counts as sums, maxima, and the ratios themselves for the quantiles.
  ``LossOutput.metrics`` gives this call's finished floats; names carry no prefix (the trainer adds
  ``train/``).

Registry entries (``policy_loss(name, ...)``); each registers its own options dataclass, which is the
``algo.<name>.*`` section of the run config:

* ``grpo``      min(ρA, clip(ρ, 1−ε, 1+ε)A).                                  ``GrpoOptions``
* ``mu_grpo``   min(ρA, clip(ρ, c_low, c_high)A), default [0, 5], plus NAV.   ``MuGrpoOptions``
* ``m2po``      paper M2PO: mask the trust-region tokens with the largest (log ρ)² until the M2 of the
                remaining trust-region tokens is ≤ τ_M2, then the unclipped ρA. ``M2poOptions``
* ``m2po_clip`` the released M2PO code's variant: one symmetric log-ratio bound τ derived from the
                same M2 budget, then the PPO-clipped objective with clip [e^−τ, e^τ]. ``M2poOptions``

A loss may also register an **update pass**: a no-grad function of the whole optimizer update's
tokens (all micro-batches, all data-parallel ranks) whose tensors reach every micro-batch's call as
keyword inputs. M2PO uses it so that its second-moment budget applies to the update, not to one
micro-batch (``update_inputs``).

The ratio is ρ_t = exp(log π_θ − b_t) with the log-ratio clamped to ±``LOG_RATIO_CLAMP`` first.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import Tensor

from megatron_mugrpo.algorithms.veto import VETO_SCOPES, broadcast_advantages, veto_mask
from megatron_mugrpo.errors import require

LOG_RATIO_CLAMP = 20.0
"""|log ρ| is clamped to this before exp: e^20 ≈ 4.9e8 stays finite in float32 (and bf16) where an
unclamped exp of a large log-ratio would give inf and inf·0 = NaN gradients. Tokens beyond it have a
frozen ratio (zero gradient); with ρ < 2e-9 or ρ > 4.9e8 the token is numerically broken anyway."""
QUANTILES = (0.01, 0.5, 0.99)
"""Ratio quantiles reported as ratio_p01 / ratio_p50 / ratio_p99."""
AGGREGATIONS = ("seq_mean_token_mean", "token_mean")
"""algo.aggregation: token mean per response then mean over responses (paper Eq. 2), or token mean."""
DEFAULT_AGGREGATION = "seq_mean_token_mean"


# ---------------------------------------------------------------------------------------------
# Options: one dataclass per loss, the ``algo.<loss>.*`` config section
# ---------------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class GrpoOptions:
    """``algo.grpo.*``: standard GRPO's symmetric ratio clip."""

    clip_eps: float = 0.2
    """ε: the ratio is clipped to [1 − ε, 1 + ε]."""

    def __post_init__(self) -> None:
        require(0.0 < self.clip_eps < 1.0, f"algo.grpo.clip_eps={self.clip_eps} must be in (0, 1)")


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


@dataclass(kw_only=True)
class M2poOptions:
    """``algo.m2po.*`` / ``algo.m2po_clip.*``: the second-moment budget."""

    m2_threshold: float = 0.04
    """τ_M2: the mean (log ρ)² over the kept trust-region tokens must not exceed it."""

    def __post_init__(self) -> None:
        require(self.m2_threshold > 0, f"algo.m2po*.m2_threshold (τ_M2)={self.m2_threshold} must be > 0")


# ---------------------------------------------------------------------------------------------
# Output and metrics
# ---------------------------------------------------------------------------------------------


@dataclass
class LossStats:
    """A loss call's diagnostics as parts that add up exactly over micro-batches and ranks.

    ``means[name] = (numerator, denominator)``, ``sums[name]`` (counts), ``maxima[name]``, and
    ``ratios``: ρ of every response token [N] (for the quantiles). Inside a loss call the values are
    0-d tensors (no host sync); ``host()`` copies them to Python floats in one transfer; ``merge``
    combines host parts; ``finish()`` gives the metric floats. A fraction reported this way is
    Σ numerator / Σ denominator over the whole update, whatever the micro-batch split.
    """

    means: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    sums: dict[str, Any] = field(default_factory=dict)
    maxima: dict[str, Any] = field(default_factory=dict)
    ratios: Tensor | None = None

    def host(self) -> LossStats:
        """The same parts as Python floats (one device-to-host copy) and ``ratios`` on the CPU."""
        scalars = [v for pair in self.means.values() for v in pair] + [*self.sums.values(), *self.maxima.values()]
        tensors = [v for v in scalars if isinstance(v, Tensor)]
        values = iter(torch.stack([t.detach().double() for t in tensors]).tolist()) if tensors else iter(())
        floats = [next(values) if isinstance(v, Tensor) else float(v) for v in scalars]
        it = iter(floats)
        means = {name: (next(it), next(it)) for name in self.means}
        sums = {name: next(it) for name in self.sums}
        maxima = {name: next(it) for name in self.maxima}
        ratios = self.ratios.detach().float().cpu() if self.ratios is not None else None
        return LossStats(means=means, sums=sums, maxima=maxima, ratios=ratios)

    @staticmethod
    def merge(parts: Sequence[LossStats]) -> LossStats:
        """Combine host parts: numerators, denominators and counts add, maxima take the max."""
        out = LossStats()
        for part in parts:
            for name, (num, den) in part.means.items():
                old = out.means.get(name, (0.0, 0.0))
                out.means[name] = (old[0] + num, old[1] + den)
            for name, value in part.sums.items():
                out.sums[name] = out.sums.get(name, 0.0) + value
            for name, value in part.maxima.items():
                out.maxima[name] = max(out.maxima.get(name, -math.inf), value)
        ratios = [p.ratios for p in parts if p.ratios is not None]
        out.ratios = torch.cat(ratios) if ratios else None
        return out

    def finish(self) -> dict[str, float]:
        """Metric floats; a mean over nothing is NaN, quantiles of no tokens are 0."""
        host = self if all(not isinstance(v, Tensor) for v in self.sums.values()) else self.host()
        out = {name: (num / den if den > 0 else math.nan) for name, (num, den) in host.means.items()}
        out.update(host.sums)
        out.update({name: (value if math.isfinite(value) else 0.0) for name, value in host.maxima.items()})
        if host.ratios is not None:
            qs = _quantiles(host.ratios, QUANTILES).tolist()
            out.update({f"ratio_p{round(q * 100):02d}": v for q, v in zip(QUANTILES, qs)})
        return out


class LossOutput(NamedTuple):
    """What every registry loss returns (a tuple: ``loss_sum, normaliser, stats = out``)."""

    loss_sum: Tensor
    """0-d: −(objective summed at the aggregation's granularity); differentiable."""
    normaliser: Tensor
    """0-d float: responses with T_y > 0 (seq_mean_token_mean) or response tokens (token_mean)."""
    stats: LossStats
    """Diagnostics as combinable parts (see LossStats)."""

    @property
    def metrics(self) -> dict[str, float]:
        """This call's diagnostics as floats (``stats.finish()``)."""
        return self.stats.finish()


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
UpdatePass = Callable[..., dict[str, Tensor]]


class LossSpec(NamedTuple):
    """A registry entry."""

    fn: LossFn
    options: type
    """The options dataclass (the ``algo.<name>.*`` section); its fields are ``fn``'s keyword options."""
    update_pass: UpdatePass | None
    """Optional no-grad function of the WHOLE update's tokens, run once per optimizer update; the
    tensors it returns ([B, T] ones are cut per micro-batch, 0-d ones shared) reach ``fn`` as keywords."""


_REGISTRY: dict[str, LossSpec] = {}


def register_loss(name: str, *, options: type, update_pass: UpdatePass | None = None) -> Callable[[LossFn], LossFn]:
    """Decorator adding a loss to the registry under ``name`` with its options dataclass.

    The function's keyword-only parameters must be ``aggregation``, the options' fields, and (with a
    default of None) the inputs its update pass provides.
    """

    def add(fn: LossFn) -> LossFn:
        if name in _REGISTRY:
            raise ValueError(f"policy loss {name!r} is registered twice")
        keywords = {p.name: p for p in inspect.signature(fn).parameters.values() if p.kind is p.KEYWORD_ONLY}
        option_names = {f.name for f in dataclasses.fields(options)}
        missing = option_names - set(keywords)
        extra = [k for k in set(keywords) - option_names - {"aggregation"} if keywords[k].default is not None]
        if missing or extra or "aggregation" not in keywords:
            raise TypeError(f"loss {name!r}: keywords {sorted(keywords)} do not match options {sorted(option_names)}")
        _REGISTRY[name] = LossSpec(fn=fn, options=options, update_pass=update_pass)
        return fn

    return add


def available_losses() -> tuple[str, ...]:
    """Names accepted by ``policy_loss``."""
    return tuple(_REGISTRY)


def loss_spec(name: str) -> LossSpec:
    """The registry entry ``name``; a ValueError naming the choices otherwise."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown policy loss {name!r}; choose one of {available_losses()} (config: algo.loss)")
    return _REGISTRY[name]


def _checked_options(name: str, options: dict[str, Any]) -> dict[str, Any]:
    """Validate ``options`` through the loss's options dataclass (type and range checks)."""
    spec = loss_spec(name)
    own = {k: v for k, v in options.items() if k != "aggregation"}
    accepted = sorted(f.name for f in dataclasses.fields(spec.options))
    unknown = sorted(set(own) - set(accepted))
    if unknown:
        raise TypeError(
            f"policy loss {name!r} does not take option(s) {unknown}; it takes {accepted} and 'aggregation' "
            "(pass AlgoConfig.loss_options())"
        )
    spec.options(**own)  # raises ConfigError naming the option when a value is out of range
    return options


def policy_loss(
    name: str,
    logprobs: Tensor,
    behaviour_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    update_inputs: dict[str, Tensor] | None = None,
    **options: object,
) -> LossOutput:
    """Compute registry loss ``name``; see the module docstring for the contract.

    Args:
        name: registry entry (``available_losses()``).
        logprobs: [B, T] current log π_θ(a_t|s_t), aligned with the targets; carries the gradient.
        behaviour_logprobs: [B, T] stored log β(a_t|s_t) (detached here).
        advantages: [B] or [B, T].
        response_mask: [B, T] bool or 0/1 float.
        update_inputs: this call's share of the loss's update pass (``update_inputs()``); without it
            a loss that has an update pass treats this call's tokens as the whole update.
        **options: exactly the loss's keyword options (``AlgoConfig.loss_options()``).
    """
    _checked_options(name, options)
    return loss_spec(name).fn(
        logprobs, behaviour_logprobs, advantages, response_mask, **options, **(update_inputs or {})
    )


@torch.no_grad()
def update_inputs(
    name: str,
    logprobs: Tensor,
    behaviour_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    **options: object,
) -> dict[str, Tensor]:
    """The loss's update pass over ALL tokens of one optimizer update ({} when it has none).

    ``logprobs`` [B, T] are the current policy's log-probs of the whole update (a no-grad scoring
    pass); [B, T] results are to be cut per micro-batch along with the rows, 0-d ones shared.
    """
    spec = loss_spec(name)
    if spec.update_pass is None:
        return {}
    _checked_options(name, options)
    return spec.update_pass(logprobs, behaviour_logprobs, advantages, response_mask, **options)


def has_update_pass(name: str) -> bool:
    """Whether loss ``name`` needs the whole update's log-probs before its forward-backward passes."""
    return loss_spec(name).update_pass is not None


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


def _quantiles(values: Tensor, qs: tuple[float, ...]) -> Tensor:
    """Linear-interpolation quantiles of a 1-D tensor (as torch.quantile, without its size limit)."""
    if values.numel() == 0:
        return torch.zeros(len(qs), dtype=torch.float64, device=values.device)
    ordered = values.double().sort().values
    pos = torch.tensor(qs, dtype=torch.float64, device=values.device) * (values.numel() - 1)
    lo, hi = pos.floor().long(), pos.ceil().long()
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@torch.no_grad()
def ratio_stats(terms: TokenTerms) -> LossStats:
    """Diagnostics shared by every loss (0-d tensors, no host sync)."""
    mask, rho, lr, adv = terms.mask, terms.ratio.detach(), terms.log_ratio.detach(), terms.advantages
    tokens = mask.sum()

    def mean(values: Tensor, where: Tensor) -> tuple[Tensor, Tensor]:
        return torch.where(where, values, 0.0).sum(), where.sum()

    return LossStats(
        means={
            "ratio_mean": mean(rho, mask),
            "ratio_mean_neg_adv": mean(rho, mask & (adv < 0)),
            "ratio_mean_pos_adv": mean(rho, mask & (adv > 0)),
            "log_ratio_sq_mean": mean(lr.square(), mask),
            "logprob_gap_abs_mean": mean(lr.abs(), mask),
            "log_ratio_clamped_frac": mean(terms.clamped.to(lr.dtype), mask),
        },
        sums={"num_tokens": tokens, "num_responses": mask.any(-1).sum()},
        maxima={"logprob_gap_abs_max": torch.where(mask, lr.abs(), 0.0).max() if mask.numel() else lr.new_zeros(())},
        ratios=rho[mask],
    )


def clip_stats(terms: TokenTerms, clipped_low: Tensor, clipped_high: Tensor) -> dict[str, tuple[Tensor, Tensor]]:
    """clip_frac_low / clip_frac_high: fractions of response tokens where a clip bound binds."""
    tokens = terms.mask.sum()
    return {"clip_frac_low": (clipped_low.sum(), tokens), "clip_frac_high": (clipped_high.sum(), tokens)}


def _with(stats: LossStats, **parts: dict[str, Any]) -> LossStats:
    """``stats`` with extra entries in its ``means`` / ``sums`` / ``maxima``."""
    for kind, entries in parts.items():
        getattr(stats, kind).update(entries)
    return stats


# ---------------------------------------------------------------------------------------------
# Registry entries
# ---------------------------------------------------------------------------------------------


@register_loss("grpo", options=GrpoOptions)
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
    terms = token_terms(logprobs, behaviour_logprobs, advantages, response_mask)
    objective, clipped_low, clipped_high = clipped_objective(terms, 1.0 - clip_eps, 1.0 + clip_eps)
    loss_sum, normaliser = aggregate(objective, terms.mask, terms.mask, aggregation)
    stats = _with(ratio_stats(terms), means=clip_stats(terms, clipped_low, clipped_high))
    return LossOutput(loss_sum, normaliser, stats)


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
    ``nav_vetoed_frac`` (vetoed / response tokens).
    """
    terms = token_terms(logprobs, behaviour_logprobs, advantages, response_mask)
    objective, clipped_low, clipped_high = clipped_objective(terms, clip_low, clip_high)
    keep, nav = veto_mask(terms.log_ratio, terms.advantages, terms.mask, scope=veto_scope, threshold=veto_threshold)
    loss_sum, normaliser = aggregate(objective, keep, terms.mask, aggregation)
    stats = _with(
        ratio_stats(terms),
        means=clip_stats(terms, clipped_low, clipped_high)
        | {"nav_vetoed_frac": (nav["nav_vetoed_tokens"], terms.mask.sum())},
        sums=nav,
    )
    return LossOutput(loss_sum, normaliser, stats)


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


def _m2po_update_pass(
    logprobs: Tensor,
    behaviour_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    m2_threshold: float,
    aggregation: str = DEFAULT_AGGREGATION,
) -> dict[str, Tensor]:
    """``m2_mask`` [B, T]: the M2PO mask over the whole update's tokens."""
    terms = token_terms(logprobs, behaviour_logprobs, advantages, response_mask)
    return {"m2_mask": m2po_mask(terms.log_ratio, terms.advantages, terms.mask, m2_threshold)}


def _m2po_clip_update_pass(
    logprobs: Tensor,
    behaviour_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    m2_threshold: float,
    aggregation: str = DEFAULT_AGGREGATION,
) -> dict[str, Tensor]:
    """``m2_clip_sq_bound`` (0-d): τ² of the released M2PO code over the whole update's tokens."""
    terms = token_terms(logprobs, behaviour_logprobs, advantages, response_mask)
    return {"m2_clip_sq_bound": m2_clip_bound(terms.log_ratio, terms.advantages, terms.mask, m2_threshold)}


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
    ``m2_masked_frac`` (masked / response tokens), ``trust_region_frac``.
    """
    terms = token_terms(logprobs, behaviour_logprobs, advantages, response_mask)
    if m2_mask is None:
        m2_mask = m2po_mask(terms.log_ratio, terms.advantages, terms.mask, m2_threshold)
    masked = m2_mask.bool() & terms.mask
    loss_sum, normaliser = aggregate(terms.ratio * terms.advantages, terms.mask & ~masked, terms.mask, aggregation)
    with torch.no_grad():
        means = _m2_stats(terms, terms.log_ratio.detach().square(), ~masked)
        means["m2_masked_frac"] = (masked.sum(), terms.mask.sum())
    stats = _with(ratio_stats(terms), means=means, sums={"m2_masked_tokens": masked.sum()})
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
    stats = _with(ratio_stats(terms), means=means, maxima={"m2_clip_log_bound": tau})
    return LossOutput(loss_sum, normaliser, stats)
