"""Chunked PyTorch implementation of the two per-block operations (the CPU path and the reference).

Both operations see one block of logits ``[N, Vb]`` (any of fp32 / bf16 / fp16) holding only real
vocabulary columns (the caller never passes padding rows) and work in float32 on that block only,
so the float32 working set is one or two ``[N, Vb]`` buffers, never ``[N, V/tp]``.

The caller may lend a float32 ``work`` buffer of the block's shape (the fused path reuses one for
every block instead of allocating, and so faulting in, fresh pages per block). Each operation makes
few full passes over the block: the 1/T scale and the subtraction of the row statistic are one
``add`` (``-m + (1/T) · x``), exponentiation is in place, and the upstream gradient and 1/T are
folded into one per-row factor.
"""

from __future__ import annotations

import torch

from megatron_mugrpo.kernels.stats import SoftmaxStats, rescale

NEEDS_WORKSPACE = True
"""The block loop should lend float32 ``work`` buffers (see the module docstring)."""


def _target_hits(target_cols: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(hit [N] bool, clamped column [N, 1]) of each token's target inside a block of ``width`` columns."""
    hit = (target_cols >= 0) & (target_cols < width)
    return hit, target_cols.clamp(0, width - 1).unsqueeze(1)


def _float_buffer(block: torch.Tensor, work: torch.Tensor | None) -> torch.Tensor:
    """``work`` if lent, else a fresh float32 buffer of the block's shape."""
    if work is None:
        return torch.empty(block.shape, dtype=torch.float32, device=block.device)
    if work.dtype != torch.float32 or work.shape != block.shape:
        raise ValueError(f"work must be float32 {tuple(block.shape)}, got {work.dtype} {tuple(work.shape)}")
    return work


def _shifted(block: torch.Tensor, row_value: torch.Tensor, temperature: float, out: torch.Tensor) -> torch.Tensor:
    """out = block / T - row_value[:, None] in float32, in one pass (out may be ``block`` itself).

    ``add(-c, x, alpha=1/T)`` promotes a bf16 / fp16 block to float32 element by element, so no
    float32 copy of the block is made first.
    """
    return torch.add(row_value.neg().unsqueeze(1), block, alpha=1.0 / temperature, out=out)


def update_stats(
    stats: SoftmaxStats,
    block: torch.Tensor,
    target_cols: torch.Tensor,
    temperature: float,
    work: torch.Tensor | None = None,
) -> None:
    """Fold one block of logits into ``stats`` (in place).

    Args:
        stats: running statistics of the N tokens (float32 [N] tensors), updated in place.
        block: [N, Vb] logits of Vb consecutive real vocabulary columns (read only, unless ``work``
            is ``block`` itself).
        target_cols: [N] int64 target id minus the block's first global id (outside [0, Vb): not here).
        temperature: T; the softmax is taken over z = logits / T.
        work: optional float32 [N, Vb] scratch buffer; it may be ``block`` itself when the caller
            no longer needs the block (the fused path's recomputed float32 logits).
    """
    scale = 1.0 / temperature
    hit, cols = _target_hits(target_cols, block.shape[1])
    picked = block.gather(1, cols).squeeze(1).float() * scale
    stats.target += torch.where(hit, picked, torch.zeros_like(stats.target))
    # max(x) / T is the max of z = x / T since T > 0 and rounding is monotonic: no pass to scale first.
    new_max = torch.maximum(stats.max, block.amax(dim=1).float() * scale)
    sumexp, wsum = rescale(stats, new_max)
    shifted = _shifted(block, new_max, temperature, _float_buffer(block, work))  # z - max
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
    work: torch.Tensor | None = None,
) -> None:
    """Write d(loss)/d(logits) of one block into ``out`` [N, Vb] (may alias ``block``).

    With p = softmax(z) over the full vocabulary (from the saved log Z [N]):
        d logprob / d z_j = onehot_j - p_j
        d entropy / d z_j = -p_j (z_j - E_p[z])
    so d/d logits_j = (g_lp · onehot_j - p_j · (g_lp + g_ent · (z_j - E_p[z]))) / T.
    ``grad_logprob`` / ``grad_entropy`` are float32 [N] upstream grads. ``work``: optional float32
    [N, Vb] scratch, used when ``out`` is not float32 (it may alias ``block``, never ``out``).
    """
    with_entropy = grad_entropy is not None and mean_z is not None
    buf = out if out.dtype == torch.float32 else _float_buffer(block, work)
    scale = 1.0 / temperature
    if with_entropy:
        # weight_j = g_lp + g_ent · (z_j - E_p[z]); z_j - E_p[z] = (z_j - log Z) + (log Z - E_p[z]).
        weight = _shifted(block, logz, temperature, torch.empty_like(buf))
        weight.add_((logz - mean_z).unsqueeze(1)).mul_(grad_entropy.unsqueeze(1)).add_(grad_logprob.unsqueeze(1))
        grad = _shifted(block, logz, temperature, buf).exp_().mul_(weight).mul_(-scale)  # -p · weight / T
    else:
        grad = _shifted(block, logz, temperature, buf).exp_().mul_((-scale * grad_logprob).unsqueeze(1))
    hit, cols = _target_hits(target_cols, grad.shape[1])
    on_target = torch.where(hit, scale * grad_logprob, torch.zeros_like(grad_logprob))
    grad.scatter_add_(1, cols, on_target.unsqueeze(1))
    if grad is not out:
        out.copy_(grad)
