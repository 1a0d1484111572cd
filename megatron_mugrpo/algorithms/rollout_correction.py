"""Rollout correction: measuring and (optionally) correcting the gap between the behaviour policy
and the trainer's own policy.

The engine that samples a stage's rollouts runs the behaviour policy β; the trainer computes
π_train. At the stage's starting weights θ_old the two should agree, but an FP8 engine
(``rollout.quantization``), other kernels or another dtype make them differ. The stored behaviour
log-probs b_t are β's, so the losses' ratio ρ_t = π_θ / β is an exact importance ratio and the
gap needs no correction: that is the default. Its price is that at the first update ρ ≠ 1 already,
so the clip and the NAV trigger react to the mismatch as well as to the policy's own movement.

**Measuring** (``mismatch_metrics``): per sampled token, with log r_t = log π_old − b_t,

* ``mismatch_kl``: KL(β ‖ π_old) estimated on β's own samples with the k3 estimator
  E[(r − 1) − log r] (unbiased because E_β[r] = 1, never negative, lower variance than E[−log r]);
* ``mismatch_logprob_abs_mean`` / ``_max``: mean / max of |log π_old − b_t|.

**Correcting** (``algo.rollout_correction.*``, off by default). Split the ratio

    ρ_t = π_θ / β = (π_θ / π_old) · (π_old / β) = r_t^θ · w_t,

give the loss the policy ratio r_t^θ (its clip and NAV then act on how far the policy moved since
the stage began) and weight each token by the mismatch factor, detached. The factor is w_t itself
(``level: token``, the default) or one factor per response (``level: sequence``), the geometric mean

    w_y = exp((1/T_y) Σ_t log w_t),

broadcast to the response's tokens. Geometric rather than the product Π_t w_t (verl's sequence-level
IS weight): the product is the exact sequence importance weight, but its log is a sum over T_y
tokens, so a per-token gap of 0.01 nats (an FP8 engine's order) becomes e^{±T_y·0.01} and one cap or
bound would mean something different at every length, truncating or masking nearly every long
response; the geometric mean is length-normalised (as GSPO's ratio is), so one bound means "the
average token is off by more than this factor". Its price is bias: it is not the sequence's exact
weight. With the factor w (token or sequence):

* truncated importance sampling (``tis_cap`` = C > 0): weight min(w, C). Bounded variance; biased
  only where w > C (Yao et al. 2025, "truncated importance sampling");
* mismatch masking (``mask_bound`` = c > 1): tokens (or responses) with w outside [1/c, c] are
  removed, in one of two ways (``mask_mode``):
  - ``zero_weight`` (default): weight 0; the token stays in T_y and in the normaliser, as the
    veto's and M2PO's masked tokens do (and as verl's IcePop / IS ``mask`` mode do);
  - ``reject``: rejection sampling, as verl's ``rollout_rs``: the token leaves the response mask, so
    it counts neither in T_y nor in the token count, and a response with every token rejected
    leaves |B|. The normaliser still never depends on θ (w is fixed for the stage).

Both on: weight min(w, C) on the kept tokens. Only the mask on: weight w on the kept tokens (the
exact token factor at token level, so the kept tokens' estimator stays unbiased there).

How the weight reaches *any* registry loss: each loss's per-token objective is positively
homogeneous in the advantage (w · min(rA, clip(r)A) = min(r(wA), clip(r)(wA)) for w ≥ 0; M2PO's
r·A likewise), and NAV and M2PO's trust region only read the advantage's sign. So the corrected
loss is the registry loss called with the anchor log π_old in place of b and per-token advantages
w_t · A. A masked token (w = 0) contributes 0, cannot trigger NAV and is outside M2PO's trust region
or OPSM's negative responses; under ``reject`` it also leaves the response mask the loss is given.

What the correction needs: log π_old for every token the stage trains on, at *every* update,
when θ has already moved. The trainer computes it once per stage, before its first update, over
the whole rollout dataset, and stores it beside it (``training.stage_reference``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor

from megatron_mugrpo.algorithms.losses import LossOutput, LossStats, policy_loss
from megatron_mugrpo.errors import InputError, require
from megatron_mugrpo.metric_names import (
    MISMATCH_KL,
    MISMATCH_LOGPROB_ABS_MAX,
    MISMATCH_LOGPROB_ABS_MEAN,
    MISMATCH_TOKENS,
    stat_name,
)

LOG_WEIGHT_CLAMP = 20.0
"""|log w| is clamped to this before exp, as the losses clamp |log ρ| (losses.LOG_RATIO_CLAMP): e^20
stays finite in float32; a token that far off is masked or truncated anyway."""


LEVELS = ("token", "sequence")
"""algo.rollout_correction.level: one factor per token (w_t) or per response (geometric mean w_y)."""
MASK_MODES = ("zero_weight", "reject")
"""algo.rollout_correction.mask_mode: masked tokens get weight 0 and stay in the normaliser, or are
removed from the response mask (rejection sampling) and from the normaliser."""


class RolloutCorrectionError(InputError, ValueError):
    """An ``algo.rollout_correction`` value is invalid; the message names the key and the fix."""


@dataclass(kw_only=True)
class RolloutCorrectionConfig:
    """``algo.rollout_correction.*``: the behaviour-vs-trainer mismatch, measured and corrected."""

    tis_cap: float = 0.0
    """C > 0: truncated importance sampling, each token weighted by min(π_old / β, C) while the loss
    sees π_θ / π_old. 0 (default): off. Values around 2 are common."""
    mask_bound: float = 0.0
    """c > 1: tokens (or, at sequence level, responses) whose mismatch factor π_old / β leaves
    [1/c, c] are masked as ``mask_mode`` says. 0 (default): off."""
    mask_mode: str = "zero_weight"
    """zero_weight (default): masked tokens get weight 0 and stay in T_y and the normaliser (verl's
    IcePop / IS mask mode). reject: they leave the response mask and the normaliser (verl's rejection
    sampling, rollout_rs)."""
    level: str = "token"
    """token (default): the factor w_t per token. sequence: one factor per response, the geometric
    mean exp(mean_t log w_t), truncated or masked as a whole (docs/method.md, "Rollout correction")."""
    mismatch_groups: int = 64
    """Prompt groups of each stage's rollouts scored by the trainer (teacher forced) for the
    rollout/mismatch_* metrics when rollout.quantization is on. With a correction on, every group is
    scored anyway and the metrics cover all of them. 0: no metrics."""

    def __post_init__(self) -> None:
        require(
            self.tis_cap == 0 or self.tis_cap >= 1,
            f"algo.rollout_correction.tis_cap={self.tis_cap} must be 0 (off) or >= 1: a cap below 1 would "
            "down-weight every token (the factor is 1 where behaviour and trainer agree)",
        )
        require(
            self.mask_bound == 0 or self.mask_bound > 1,
            f"algo.rollout_correction.mask_bound={self.mask_bound} must be 0 (off) or > 1: tokens are kept "
            "while π_old / β lies in [1/c, c]",
        )
        require(
            self.mask_mode in MASK_MODES,
            f"algo.rollout_correction.mask_mode={self.mask_mode!r} is unknown; choose one of {MASK_MODES}",
        )
        require(
            self.mask_mode == "zero_weight" or self.mask_bound > 0,
            f"algo.rollout_correction.mask_mode={self.mask_mode!r} needs a mask: set "
            "algo.rollout_correction.mask_bound (e.g. 8) or drop mask_mode",
        )
        require(
            self.level in LEVELS,
            f"algo.rollout_correction.level={self.level!r} is unknown; choose one of {LEVELS}",
        )
        require(
            self.level == "token" or self.enabled,
            f"algo.rollout_correction.level={self.level!r} corrects nothing by itself: set "
            "algo.rollout_correction.tis_cap and/or mask_bound, or drop level",
        )
        require(
            self.mismatch_groups >= 0,
            f"algo.rollout_correction.mismatch_groups={self.mismatch_groups} must be >= 0 (0: no metrics)",
        )

    @property
    def enabled(self) -> bool:
        """Whether the loss uses log π_old (and so every token needs it)."""
        return self.tis_cap > 0 or self.mask_bound > 0

    def loss_options(self) -> dict[str, Any]:
        """The keyword options of ``corrected_policy_loss`` / ``correction_inputs``."""
        return {
            "tis_cap": self.tis_cap,
            "mask_bound": self.mask_bound,
            "mask_mode": self.mask_mode,
            "level": self.level,
        }


def mismatch_log_ratio(old_logprobs: Tensor, behaviour_logprobs: Tensor, response_mask: Tensor) -> Tensor:
    """log w_t = log π_old − b_t on response tokens, 0 elsewhere; [B, T] in float32 or wider, clamped to
    ±LOG_WEIGHT_CLAMP (so exp cannot overflow), no grad."""
    dtype = torch.promote_types(old_logprobs.dtype, torch.float32)
    raw = torch.where(
        response_mask.bool(), old_logprobs.detach().to(dtype) - behaviour_logprobs.detach().to(dtype), 0.0
    )
    return raw.clamp(-LOG_WEIGHT_CLAMP, LOG_WEIGHT_CLAMP)


def truncated_weights(log_ratio: Tensor, response_mask: Tensor, cap: float) -> Tensor:
    """min(w_t, C) on response tokens, 0 elsewhere ([B, T]); computed as exp(min(log w, log C))."""
    if cap < 1:
        raise RolloutCorrectionError(f"tis_cap={cap} must be >= 1 (algo.rollout_correction.tis_cap)")
    return torch.where(response_mask.bool(), log_ratio.clamp(max=math.log(cap)).exp(), 0.0)


def mismatch_keep(log_ratio: Tensor, response_mask: Tensor, bound: float) -> Tensor:
    """[B, T] bool: response tokens whose w_t lies in [1/c, c], i.e. |log w_t| <= log c."""
    if bound <= 1:
        raise RolloutCorrectionError(f"mask_bound={bound} must be > 1 (algo.rollout_correction.mask_bound)")
    return response_mask.bool() & (log_ratio.abs() <= math.log(bound))


def sequence_log_ratio(log_ratio: Tensor, response_mask: Tensor) -> Tensor:
    """log w_y = (1/T_y) Σ_t log w_t (the log of the geometric mean), broadcast to the response's
    tokens, 0 elsewhere ([B, T]); an empty row gives 0."""
    mask = response_mask.bool()
    lengths = mask.sum(-1, keepdim=True).clamp_min(1).to(log_ratio.dtype)
    per_row = torch.where(mask, log_ratio, 0.0).sum(-1, keepdim=True) / lengths
    return torch.where(mask, per_row.expand_as(log_ratio), 0.0)


class CorrectionWeights(NamedTuple):
    """The rollout correction's per-token weights, which tokens it keeps, and its diagnostics."""

    weights: Tensor
    """[B, T] the factor (w_t or w_y; truncated at C when tis_cap > 0), 0 off the response and on masked tokens."""
    kept: Tensor
    """[B, T] bool: response tokens the mask keeps (the response mask when mask_bound = 0)."""
    stats: dict[str, tuple[Tensor, Tensor]]
    """(numerator, denominator) parts over response tokens: ``rollout_corr_weight_mean``,
    ``rollout_corr_truncated_frac``, ``rollout_corr_masked_frac`` (``LossStats.means``)."""


@torch.no_grad()
def correction_weights(
    old_logprobs: Tensor,
    behaviour_logprobs: Tensor,
    response_mask: Tensor,
    *,
    tis_cap: float = 0.0,
    mask_bound: float = 0.0,
    level: str = "token",
) -> CorrectionWeights:
    """Per-token weights of the corrected loss (module docstring) and their diagnostics.

    Args:
        old_logprobs: [B, T] log π_old (the trainer at the stage's starting weights).
        behaviour_logprobs: [B, T] stored b_t.
        response_mask: [B, T].
        tis_cap: C (0: no truncation). mask_bound: c (0: no mask).
        level: ``token`` (w_t) or ``sequence`` (w_y, the geometric mean over the response).

    Returns:
        ``CorrectionWeights``; at sequence level a response is truncated or masked as a whole.
    """
    if level not in LEVELS:
        raise RolloutCorrectionError(
            f"level={level!r} is unknown; choose one of {LEVELS} (algo.rollout_correction.level)"
        )
    mask = response_mask.bool()
    log_w = mismatch_log_ratio(old_logprobs, behaviour_logprobs, mask)
    if level == "sequence":
        log_w = sequence_log_ratio(log_w, mask)
    weights = truncated_weights(log_w, mask, tis_cap) if tis_cap > 0 else torch.where(mask, log_w.exp(), 0.0)
    keep = mismatch_keep(log_w, mask, mask_bound) if mask_bound > 0 else mask
    weights = torch.where(keep, weights, 0.0)
    count = mask.sum().to(weights.dtype)
    truncated = mask & (log_w > math.log(tis_cap)) if tis_cap > 0 else torch.zeros_like(mask)
    parts = {
        "rollout_corr_weight_mean": (weights.sum(), count),
        "rollout_corr_truncated_frac": (truncated.sum().to(weights.dtype), count),
        "rollout_corr_masked_frac": ((mask & ~keep).sum().to(weights.dtype), count),
    }
    return CorrectionWeights(weights, keep, parts)


class LossInputs(NamedTuple):
    """What a registry loss (and its update pass) is given in place of (b, A) under the correction."""

    anchor_logprobs: Tensor
    """[B, T]: log π_old with a correction on (the loss's ratio becomes π_θ / π_old), else b."""
    advantages: Tensor
    """[B, T] w · A with a correction on (0 on masked tokens), else the advantages as given ([B] or [B, T])."""
    stats: dict[str, tuple[Tensor, Tensor]]
    """The correction's (numerator, denominator) diagnostics; empty when off."""


def correction_inputs(
    behaviour_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    old_logprobs: Tensor | None,
    tis_cap: float = 0.0,
    mask_bound: float = 0.0,
    mask_mode: str = "zero_weight",
    level: str = "token",
) -> LossInputs:
    """The loss's (anchor, advantages) under the rollout correction; (b, A) unchanged when it is off.

    An update pass (M2PO's) may be given these with the full response mask even under ``mask_mode:
    reject``: a rejected token's advantage here is 0, so it is outside M2PO's trust region and the
    mask or bound comes out as without it.
    """
    return _corrected(
        behaviour_logprobs,
        advantages,
        response_mask,
        old_logprobs=old_logprobs,
        tis_cap=tis_cap,
        mask_bound=mask_bound,
        mask_mode=mask_mode,
        level=level,
    )[0]


def _corrected(
    behaviour_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    old_logprobs: Tensor | None,
    tis_cap: float,
    mask_bound: float,
    mask_mode: str,
    level: str,
) -> tuple[LossInputs, Tensor]:
    """``correction_inputs`` and the response mask the loss is given: less the rejected tokens under
    ``mask_mode: reject``, the mask as given otherwise."""
    if mask_mode not in MASK_MODES:
        raise RolloutCorrectionError(
            f"mask_mode={mask_mode!r} is unknown; choose one of {MASK_MODES} (algo.rollout_correction.mask_mode)"
        )
    if tis_cap <= 0 and mask_bound <= 0:
        return LossInputs(behaviour_logprobs, advantages, {}), response_mask
    if old_logprobs is None:
        raise ValueError(
            "algo.rollout_correction is on but the batch has no old log-probs (log π_old per token); "
            "the stage reference pass must attach them (training.stage_reference)"
        )
    weights, kept, stats = correction_weights(
        old_logprobs, behaviour_logprobs, response_mask, tis_cap=tis_cap, mask_bound=mask_bound, level=level
    )
    adv = advantages.detach().to(weights.dtype)
    mask = kept.to(response_mask.dtype) if mask_mode == "reject" else response_mask
    return LossInputs(old_logprobs, weights * (adv[:, None] if adv.dim() == 1 else adv), stats), mask


def corrected_policy_loss(
    name: str,
    logprobs: Tensor,
    behaviour_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    old_logprobs: Tensor | None,
    tis_cap: float = 0.0,
    mask_bound: float = 0.0,
    mask_mode: str = "zero_weight",
    level: str = "token",
    update_inputs: dict[str, Tensor] | None = None,
    **options: Any,
) -> LossOutput:
    """Registry loss ``name`` with the rollout correction (module docstring); without one (tis_cap and
    mask_bound 0) exactly ``policy_loss(name, logprobs, behaviour_logprobs, advantages, response_mask)``.

    Args:
        logprobs: [B, T] log π_θ, carries the gradient.
        behaviour_logprobs: [B, T] b_t. old_logprobs: [B, T] log π_old, required when a correction is on.
        advantages: [B] or [B, T]. response_mask: [B, T].
        tis_cap, mask_bound, mask_mode, level: ``RolloutCorrectionConfig.loss_options()``.
        update_inputs: this call's share of the loss's update pass, computed on ``correction_inputs``.
        **options: the loss's own options (``AlgoConfig.loss_options()``).
    """
    inputs, mask = _corrected(
        behaviour_logprobs,
        advantages,
        response_mask,
        old_logprobs=old_logprobs,
        tis_cap=tis_cap,
        mask_bound=mask_bound,
        mask_mode=mask_mode,
        level=level,
    )
    out = policy_loss(
        name,
        logprobs,
        inputs.anchor_logprobs,
        inputs.advantages,
        mask,
        update_inputs=update_inputs,
        old_logprobs=old_logprobs,  # read only by a loss that masks on π_old / β itself (icepop)
        **options,
    )
    if not inputs.stats:
        return out
    stats = LossStats(
        means=out.stats.means | inputs.stats, sums=out.stats.sums, maxima=out.stats.maxima, ratios=out.stats.ratios
    )
    return LossOutput(out.loss_sum, out.normaliser, stats)


@torch.no_grad()
def mismatch_metrics(behaviour_logprobs: Tensor, reference_logprobs: Tensor, response_mask: Tensor) -> dict[str, float]:
    """How far the behaviour policy's sampled-token log-probs are from a reference policy's.

    Args:
        behaviour_logprobs: [B, T] b_t of tokens sampled from β.
        reference_logprobs: [B, T] log π_ref of the same tokens, teacher forced (the trainer, full precision).
        response_mask: [B, T].

    Returns:
        ``mismatch_kl`` (k3 estimate of KL(β ‖ π_ref), module docstring), ``mismatch_logprob_abs_mean``,
        ``mismatch_logprob_abs_max`` and ``mismatch_tokens``; NaN metrics when there are no tokens.
    """
    mask = response_mask.bool()
    if not mask.any():
        nan = float("nan")
        return {
            stat_name(MISMATCH_KL): nan,
            stat_name(MISMATCH_LOGPROB_ABS_MEAN): nan,
            stat_name(MISMATCH_LOGPROB_ABS_MAX): nan,
            stat_name(MISMATCH_TOKENS): 0.0,
        }
    log_r = mismatch_log_ratio(reference_logprobs.double(), behaviour_logprobs.double(), mask)[mask]
    k3 = log_r.exp() - 1.0 - log_r
    return {
        stat_name(MISMATCH_KL): float(k3.mean()),
        stat_name(MISMATCH_LOGPROB_ABS_MEAN): float(log_r.abs().mean()),
        stat_name(MISMATCH_LOGPROB_ABS_MAX): float(log_r.abs().max()),
        stat_name(MISMATCH_TOKENS): float(mask.sum()),
    }
