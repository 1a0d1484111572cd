"""Per-token softmax statistics: the small [N] vectors that a vocab-chunked log-prob carries around.

A log-prob over a vocabulary split into blocks (and into tensor-parallel shards) never needs the
whole row of logits at once: it needs, per token, the running maximum ``m`` of ``z = logits / T``,
the rescaled sum ``S = Σ exp(z - m)``, the target's ``z`` and, for the entropy,
``W = Σ exp(z - m) · (z - m)``. Blocks (and TP ranks) merge these exactly, in float32::

    log Z   = m + log S
    logprob = z[target] - log Z
    E_p[z]  = m + W / S
    entropy = log Z - E_p[z] = log S - W / S

``W`` is kept relative to the running max (not ``Σ p z``) so that the entropy does not suffer from
cancellation when logits are large.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class SoftmaxStats:
    """Running softmax statistics of N tokens over the vocabulary columns seen so far.

    All tensors are float32 ``[N]``. A token that has seen no column has ``max = -inf`` and
    ``sumexp = 0`` (a TP rank whose shard holds only padding rows stays in that state).
    """

    max: torch.Tensor
    """[N] running max of z = logits / T."""
    sumexp: torch.Tensor
    """[N] Σ exp(z - max)."""
    target: torch.Tensor
    """[N] z of the target token; 0 while the target's column has not been seen."""
    wsum: torch.Tensor | None
    """[N] Σ exp(z - max) · (z - max), kept only when the entropy is requested."""

    @classmethod
    def empty(cls, n: int, device: torch.device, with_entropy: bool) -> SoftmaxStats:
        """Statistics of N tokens before any column is seen."""
        zeros = torch.zeros(n, dtype=torch.float32, device=device)
        return cls(
            max=torch.full((n,), float("-inf"), dtype=torch.float32, device=device),
            sumexp=zeros,
            target=zeros.clone(),
            wsum=zeros.clone() if with_entropy else None,
        )


def rescale(stats: SoftmaxStats, new_max: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Express (sumexp, wsum) relative to ``new_max`` [N] (>= stats.max); returns the two [N] tensors.

    Tokens with no column seen yet (sumexp == 0, max == -inf) stay exactly 0 instead of 0 · inf = nan.
    """
    seen = stats.sumexp > 0
    shift = torch.where(seen, stats.max - new_max, torch.zeros_like(new_max))
    scale = torch.where(seen, torch.exp(shift), torch.zeros_like(new_max))
    sumexp = stats.sumexp * scale
    wsum = None
    if stats.wsum is not None:
        wsum = scale * (stats.wsum + shift * stats.sumexp)
    return sumexp, wsum


def all_reduce_stats(stats: SoftmaxStats, group: dist.ProcessGroup | None) -> SoftmaxStats:
    """Combine the per-shard statistics of a vocabulary-parallel group (MAX, then SUM), in float32.

    Every rank must call this with the same N. The target's z comes from the one rank that owns
    its column (the others hold 0). With ``group=None`` or a group of one rank it is the identity.
    """
    if group is None or dist.get_world_size(group) == 1:
        return stats
    global_max = stats.max.clone()
    dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=group)
    sumexp, wsum = rescale(stats, global_max)
    parts = [sumexp, stats.target] + ([wsum] if wsum is not None else [])
    packed = torch.stack(parts)
    dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
    return SoftmaxStats(
        max=global_max,
        sumexp=packed[0],
        target=packed[1],
        wsum=packed[2] if wsum is not None else None,
    )


def finalize(
    stats: SoftmaxStats,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """From full-vocabulary statistics to (logprob [N], log Z [N], entropy [N] | None, E_p[z] [N] | None)."""
    log_sumexp = torch.log(stats.sumexp)
    logz = stats.max + log_sumexp
    logprob = stats.target - logz
    if stats.wsum is None:
        return logprob, logz, None, None
    mean_shifted = stats.wsum / stats.sumexp
    return logprob, logz, log_sumexp - mean_shifted, stats.max + mean_shifted
