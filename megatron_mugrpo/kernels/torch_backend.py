"""Chunked PyTorch implementation of the two per-block operations (the CPU path and the reference).

Both operations see one block of logits ``[N, Vb]`` (any of fp32 / bf16 / fp16) holding only real
vocabulary columns (the caller never passes padding rows) and work in float32 on that block only,
so the float32 working set is a few ``[N, Vb]`` buffers, never ``[N, V/tp]``.
"""

from __future__ import annotations

import torch

from megatron_mugrpo.kernels.stats import SoftmaxStats, rescale


def _target_hits(target_cols: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(hit [N] bool, clamped column [N, 1]) of each token's target inside a block of ``width`` columns."""
    hit = (target_cols >= 0) & (target_cols < width)
    return hit, target_cols.clamp(0, width - 1).unsqueeze(1)


def _scaled_float(block: torch.Tensor, temperature: float, scratch: bool) -> torch.Tensor:
    """z = block / T in float32; reuses ``block``'s memory when it is float32 scratch.

    T = 1 (the default rollout temperature) skips the division, one pass over the block less.
    """
    if block.dtype != torch.float32:
        z = block.float()
    elif scratch:
        z = block
    else:
        return block / temperature if temperature != 1.0 else block.clone()
    return z.div_(temperature) if temperature != 1.0 else z


def update_stats(
    stats: SoftmaxStats,
    block: torch.Tensor,
    target_cols: torch.Tensor,
    temperature: float,
    scratch: bool = False,
) -> None:
    """Fold one block of logits into ``stats`` (in place).

    Args:
        stats: running statistics of the N tokens (float32 [N] tensors), updated in place.
        block: [N, Vb] logits of Vb consecutive real vocabulary columns.
        target_cols: [N] int64 target id minus the block's first global id (outside [0, Vb): not here).
        temperature: T; the softmax is taken over z = logits / T.
        scratch: the caller no longer needs ``block``; a float32 block is then overwritten instead of
            copied (the fused path's recomputed logits).
    """
    z = _scaled_float(block, temperature, scratch)  # [N, Vb] float32
    hit, cols = _target_hits(target_cols, z.shape[1])
    stats.target += torch.where(hit, z.gather(1, cols).squeeze(1), torch.zeros_like(stats.target))
    new_max = torch.maximum(stats.max, z.amax(dim=1))
    sumexp, wsum = rescale(stats, new_max)
    shifted = z.sub_(new_max.unsqueeze(1))  # z - max, in place
    if wsum is None:
        stats.sumexp = sumexp + shifted.exp_().sum(dim=1)
    else:
        probs = torch.exp(shifted)
        stats.sumexp = sumexp + probs.sum(dim=1)
        stats.wsum = wsum + probs.mul_(shifted).sum(dim=1)
    stats.max = new_max


def block_grad(
    block: torch.Tensor,
    target_cols: torch.Tensor,
    temperature: float,
    logz: torch.Tensor,
    mean_z: torch.Tensor | None,
    grad_logprob: torch.Tensor,
    grad_entropy: torch.Tensor | None,
    out: torch.Tensor,
) -> None:
    """Write d(loss)/d(logits) of one block into ``out`` [N, Vb] (may alias ``block``).

    With p = softmax(z) over the full vocabulary (from the saved log Z [N]):
        d logprob / d z_j = onehot_j - p_j
        d entropy / d z_j = -p_j (z_j - E_p[z])
    and d/d logits = (d/dz) / T. ``grad_logprob`` / ``grad_entropy`` are float32 [N] upstream grads.
    When ``out`` is ``block`` the block is scratch and a float32 block is reused as the work buffer.
    """
    z = _scaled_float(block, temperature, scratch=out is block)
    with_entropy = grad_entropy is not None and mean_z is not None
    grad = torch.exp(z - logz.unsqueeze(1)) if with_entropy else z.sub_(logz.unsqueeze(1)).exp_()  # p
    if with_entropy:
        entropy_term = z.sub_(mean_z.unsqueeze(1)).mul_(grad).mul_(grad_entropy.unsqueeze(1))
        grad.mul_(-grad_logprob.unsqueeze(1)).sub_(entropy_term)
    else:
        grad.mul_(-grad_logprob.unsqueeze(1))
    hit, cols = _target_hits(target_cols, grad.shape[1])
    grad.scatter_add_(1, cols, torch.where(hit, grad_logprob, torch.zeros_like(grad_logprob)).unsqueeze(1))
    grad.div_(temperature)
    if grad is not out:
        out.copy_(grad)
