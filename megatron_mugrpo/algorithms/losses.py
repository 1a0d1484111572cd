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

Registry entries (``policy_loss(name, ...)``), one module each; each registers its own options
dataclass, which is the ``algo.<name>.*`` section of the run config:

* ``grpo``      min(ρA, clip(ρ, 1−ε, 1+ε)A); optional dual clip max(·, cA) for A<0.  ``loss_grpo.GrpoOptions``
* ``mu_grpo``   min(ρA, clip(ρ, c_low, c_high)A), default [0, 5], plus NAV.        ``loss_grpo.MuGrpoOptions``
* ``m2po``      paper M2PO: mask the trust-region tokens with the largest (log ρ)² until the M2 of the
                remaining trust-region tokens is ≤ τ_M2, then the unclipped ρA. ``loss_m2po.M2poOptions``
* ``m2po_clip`` the released M2PO code's variant: one symmetric log-ratio bound τ derived from the
                same M2 budget, then the PPO-clipped objective with clip [e^−τ, e^τ]. ``loss_m2po.M2poOptions``
* ``opsm``      GRPO's clipped objective; negative-advantage responses with mean_t(log β − log π_θ) > δ
                dropped (off-policy sequence masking).                         ``loss_opsm.OpsmOptions``
* ``icepop``    IcePop: GRPO's clip on π_θ / π_old, tokens weighted by the train/inference mismatch
                w = π_old / β and masked where w leaves [α, β]; π_old is the trainer at the stage's
                start (``needs_old_logprobs``).                                ``loss_icepop.IcepopOptions``
* ``icepop_current`` GRPO's clipped objective; tokens whose drifting ρ = π_θ / β leaves [α, β]
                masked (a hard trust region around β).                     ``loss_icepop.IcepopCurrentOptions``
* ``gspo``      the sequence ratio s_y = exp(mean_t log ρ_t), clipped at the sequence level.
                                                                                ``loss_gspo.GspoOptions``

Every loss that removes tokens from the loss (NAV, M2PO, OPSM, IcePop) reports the fraction of
response tokens it removed as ``masked_frac`` besides its own name; clipping losses report
``clip_frac_low`` / ``clip_frac_high`` (and ``dual_clip_frac``).

A loss may also register an **update pass**: a no-grad function of the whole optimizer update's
tokens (all micro-batches, all data-parallel ranks) whose tensors reach every micro-batch's call as
keyword inputs. M2PO uses it so that its second-moment budget applies to the update, not to one
micro-batch (``update_inputs``).

The ratio is ρ_t = exp(log π_θ − b_t) with the log-ratio clamped to ±``LOG_RATIO_CLAMP`` first.
"""

from __future__ import annotations

from megatron_mugrpo.algorithms import loss_grpo, loss_gspo, loss_icepop, loss_m2po, loss_opsm
from megatron_mugrpo.algorithms.loss_core import (
    AGGREGATIONS,
    DEFAULT_AGGREGATION,
    LOG_RATIO_CLAMP,
    QUANTILES,
    LossFn,
    LossOutput,
    LossSpec,
    LossStats,
    TokenTerms,
    UpdatePass,
    aggregate,
    available_losses,
    clip_stats,
    clipped_objective,
    has_update_pass,
    loss_normaliser,
    loss_spec,
    needs_old_logprobs,
    policy_loss,
    ratio_stats,
    register_loss,
    token_terms,
    update_inputs,
    with_stats,
)
from megatron_mugrpo.algorithms.loss_grpo import GrpoOptions, MuGrpoOptions, dual_clipped, grpo_loss, mu_grpo_loss
from megatron_mugrpo.algorithms.loss_gspo import GspoOptions, gspo_loss, sequence_ratio
from megatron_mugrpo.algorithms.loss_icepop import (
    IcepopCurrentOptions,
    IcepopOptions,
    band_masked,
    icepop_current_loss,
    icepop_loss,
    mismatch_band,
)
from megatron_mugrpo.algorithms.loss_m2po import (
    M2poOptions,
    m2_clip_bound,
    m2po_clip_loss,
    m2po_loss,
    m2po_mask,
    m2po_mask_greedy,
    trust_region,
)
from megatron_mugrpo.algorithms.loss_opsm import OpsmOptions, opsm_drop, opsm_loss

LOSS_MODULES = (loss_grpo, loss_m2po, loss_opsm, loss_icepop, loss_gspo)
"""The modules whose import registers the registry entries (importing this module imports them all)."""

__all__ = [
    "AGGREGATIONS",
    "DEFAULT_AGGREGATION",
    "LOG_RATIO_CLAMP",
    "LOSS_MODULES",
    "QUANTILES",
    "GrpoOptions",
    "GspoOptions",
    "IcepopCurrentOptions",
    "IcepopOptions",
    "LossFn",
    "LossOutput",
    "LossSpec",
    "LossStats",
    "M2poOptions",
    "MuGrpoOptions",
    "OpsmOptions",
    "TokenTerms",
    "UpdatePass",
    "aggregate",
    "available_losses",
    "band_masked",
    "clip_stats",
    "clipped_objective",
    "dual_clipped",
    "grpo_loss",
    "gspo_loss",
    "has_update_pass",
    "icepop_current_loss",
    "icepop_loss",
    "loss_normaliser",
    "loss_spec",
    "m2_clip_bound",
    "m2po_clip_loss",
    "m2po_loss",
    "m2po_mask",
    "m2po_mask_greedy",
    "mismatch_band",
    "mu_grpo_loss",
    "needs_old_logprobs",
    "opsm_drop",
    "opsm_loss",
    "policy_loss",
    "ratio_stats",
    "register_loss",
    "sequence_ratio",
    "token_terms",
    "trust_region",
    "update_inputs",
    "with_stats",
]
