"""Registry entry ``gspo``: the sequence-level importance ratio of GSPO (Zheng et al. 2025).

Each response gets one ratio, the geometric mean of its token ratios,

    s_y = exp((1/T_y) Σ_t log ρ_t) = (π_θ(y) / β(y))^(1/T_y),

clipped at the sequence level: obj_y = min(s_y A, clip(s_y, 1 − ε_low, 1 + ε_high) A). It is
computed in GSPO's token form, s_{y,t} = sg[s_y] · π_θ(y_t) / sg[π_θ(y_t)] (sg: stop-gradient),
whose value is s_y at every token and whose gradient under ``seq_mean_token_mean`` with one
advantage per response equals GSPO's: ∂/∂log π_t = s_y A / T_y (unclipped). The token form also
takes per-token advantages (the rollout correction's w_t · A). Formulas: docs/method.md, "GSPO".

    out = policy_loss("gspo", logprobs, behaviour_logprobs, advantages, mask, clip_eps_low=3e-4, clip_eps_high=4e-4)
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
    ratio_stats,
    register_loss,
    token_terms,
    with_stats,
)
from megatron_mugrpo.errors import require


@dataclass(kw_only=True)
class GspoOptions:
    """``algo.gspo.*``: the sequence ratio's clip [1 − ε_low, 1 + ε_high].

    The defaults are the GSPO paper's (3e-4, 4e-4; also verl's GSPO recipe). They are this small
    because s_y is a geometric mean: its log is the mean of T_y token log-ratios, so it moves about
    T_y times less than a single token's and a token-sized ε of 0.2 would almost never bind. Far
    off-policy (large μ) they clip most responses after a few updates, which is what F6 measures.
    """

    clip_eps_low: float = 3e-4
    """ε_low: s_y is clipped below at 1 − ε_low."""
    clip_eps_high: float = 4e-4
    """ε_high: s_y is clipped above at 1 + ε_high."""

    def __post_init__(self) -> None:
        require(
            0.0 < self.clip_eps_low < 1.0,
            f"algo.gspo.clip_eps_low={self.clip_eps_low} must be in (0, 1) (GSPO uses 3e-4)",
        )
        require(self.clip_eps_high > 0.0, f"algo.gspo.clip_eps_high={self.clip_eps_high} must be > 0 (GSPO uses 4e-4)")


def sequence_ratio(terms: TokenTerms) -> tuple[Tensor, Tensor]:
    """GSPO's ratios.

    Returns:
        seq_ratio: [B] s_y = exp(mean_t log ρ_t) over the response (1 for an empty row), no grad.
        token_ratio: [B, T] s_{y,t} = sg[s_y] · exp(log ρ_t − sg[log ρ_t]): value s_y, gradient s_y per token.
    """
    lengths = terms.mask.sum(-1).clamp_min(1).to(terms.log_ratio.dtype)
    seq_ratio = (terms.log_ratio.detach().sum(-1) / lengths).exp()
    token_ratio = seq_ratio[:, None] * torch.exp(terms.log_ratio - terms.log_ratio.detach())
    return seq_ratio, token_ratio


@register_loss("gspo", options=GspoOptions)
def gspo_loss(
    logprobs: Tensor,
    behaviour_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_eps_low: float = 3e-4,
    clip_eps_high: float = 4e-4,
    aggregation: str = DEFAULT_AGGREGATION,
) -> LossOutput:
    """GSPO: obj_t = min(s_{y,t} A_t, clip(s_{y,t}, 1 − ε_low, 1 + ε_high) A_t). Shapes as in ``policy_loss``.

    With ``seq_mean_token_mean`` each response counts once, as in the paper. Extra metrics:
    ``clip_frac_low`` / ``clip_frac_high`` (response tokens of clipped responses; token-weighted
    like the token-level losses'), ``seq_clip_frac`` (clipped / responses), ``seq_ratio_mean``
    (mean s_y over responses).
    """
    terms = token_terms(logprobs, behaviour_logprobs, advantages, response_mask)
    seq_ratio, token_ratio = sequence_ratio(terms)
    low, high = 1.0 - clip_eps_low, 1.0 + clip_eps_high
    adv = terms.advantages
    objective = torch.minimum(token_ratio * adv, token_ratio.clamp(low, high) * adv)
    loss_sum, normaliser = aggregate(objective, terms.mask, terms.mask, aggregation)
    with torch.no_grad():
        s = seq_ratio[:, None]
        clipped_low = terms.mask & (adv < 0) & (s < low)
        clipped_high = terms.mask & (adv > 0) & (s > high)
        responses = terms.mask.any(-1)
        seq_clipped = (clipped_low | clipped_high).any(-1)
        means = clip_stats(terms, clipped_low, clipped_high) | {
            "seq_clip_frac": (seq_clipped.sum(), responses.sum()),
            "seq_ratio_mean": (torch.where(responses, seq_ratio, 0.0).sum(), responses.sum()),
        }
    return LossOutput(loss_sum, normaliser, with_stats(ratio_stats(terms), means=means))
