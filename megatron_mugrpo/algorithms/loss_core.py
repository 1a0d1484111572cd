"""The loss registry's machinery: options checking, the (sum, normaliser) contract, combinable
statistics and the per-token pieces every loss shares.

The losses themselves live one per module (``loss_grpo``, ``loss_m2po``, ``loss_opsm``,
``loss_icepop``, ``loss_gspo``) and register here; ``algorithms.losses`` imports them all and is the
module the rest of the package uses (its docstring states the contract).
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

from megatron_mugrpo.algorithms.veto import broadcast_advantages
from megatron_mugrpo.metric_names import CLIP_HIGH, CLIP_LOW, RATIO_NEG, RATIO_POS, stat_name

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
    needs_old_logprobs: bool = False
    """Whether ``fn`` takes ``old_logprobs`` [B, T], log π_old at the stage's start (IcePop's mismatch
    factor π_old / β): the staged loop then scores D_k before the stage's first update
    (``training.stage_reference``) and every batch carries it."""


_REGISTRY: dict[str, LossSpec] = {}


def register_loss(
    name: str, *, options: type, update_pass: UpdatePass | None = None, needs_old_logprobs: bool = False
) -> Callable[[LossFn], LossFn]:
    """Decorator adding a loss to the registry under ``name`` with its options dataclass.

    The function's keyword-only parameters must be ``aggregation``, the options' fields, and (with a
    default of None) the inputs its update pass provides and, with ``needs_old_logprobs``, ``old_logprobs``.
    """

    def add(fn: LossFn) -> LossFn:
        if name in _REGISTRY:
            raise ValueError(f"policy loss {name!r} is registered twice")
        keywords = {p.name: p for p in inspect.signature(fn).parameters.values() if p.kind is p.KEYWORD_ONLY}
        option_names = {f.name for f in dataclasses.fields(options)}
        missing = option_names - set(keywords)
        extra = [k for k in set(keywords) - option_names - {"aggregation"} if keywords[k].default is not None]
        if missing or extra or "aggregation" not in keywords or needs_old_logprobs != ("old_logprobs" in keywords):
            raise TypeError(f"loss {name!r}: keywords {sorted(keywords)} do not match options {sorted(option_names)}")
        _REGISTRY[name] = LossSpec(
            fn=fn, options=options, update_pass=update_pass, needs_old_logprobs=needs_old_logprobs
        )
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
    old_logprobs: Tensor | None = None,
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
        old_logprobs: [B, T] log π_old at the stage's start, for a loss that needs it
            (``needs_old_logprobs``: ``icepop``); other losses do not read it.
        **options: exactly the loss's keyword options (``AlgoConfig.loss_options()``).
    """
    _checked_options(name, options)
    spec = loss_spec(name)
    old = {"old_logprobs": old_logprobs} if spec.needs_old_logprobs else {}
    return spec.fn(logprobs, behaviour_logprobs, advantages, response_mask, **options, **old, **(update_inputs or {}))


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


def needs_old_logprobs(name: str) -> bool:
    """Whether loss ``name`` reads log π_old at the stage's start (``LossSpec.needs_old_logprobs``)."""
    return loss_spec(name).needs_old_logprobs


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
            stat_name(RATIO_NEG): mean(rho, mask & (adv < 0)),
            stat_name(RATIO_POS): mean(rho, mask & (adv > 0)),
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
    return {stat_name(CLIP_LOW): (clipped_low.sum(), tokens), stat_name(CLIP_HIGH): (clipped_high.sum(), tokens)}


def with_stats(stats: LossStats, **parts: dict[str, Any]) -> LossStats:
    """``stats`` with extra entries in its ``means`` / ``sums`` / ``maxima``."""
    for kind, entries in parts.items():
        getattr(stats, kind).update(entries)
    return stats
