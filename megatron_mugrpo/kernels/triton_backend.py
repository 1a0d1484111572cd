"""Triton implementation of the two per-block operations (the CUDA path).

Same contract as :mod:`megatron_mugrpo.kernels.torch_backend`, but each operation is one kernel
that streams the (bf16 / fp16 / fp32) logits once and keeps everything else in registers:

* ``update_stats``: one program per token row walks the block in tiles of ``BLOCK_V`` columns with
  an online max / sum-exp (and Σ e·(z - max) for the entropy) in float32, and picks up the
  target's z; no float32 copy of the block exists anywhere.
* ``block_grad``: one program per (row, tile) recomputes p = exp(z - log Z) from the saved log Z and
  writes (onehot - p) · g / T (plus the entropy term) in the output dtype, optionally in place over
  the logits it has just read (the fused linear path reuses its recomputed logits buffer).

On CPU the kernels run under the Triton interpreter: set ``TRITON_INTERPRET=1`` *before* this module
is imported (``triton.jit`` reads it at decoration time). :data:`INTERPRETED` records which mode the
kernels were built in.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from megatron_mugrpo.kernels.stats import SoftmaxStats

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
"""True when the kernels were decorated under the Triton interpreter (CPU tensors allowed)."""

NEEDS_WORKSPACE = False
"""The kernels keep float32 values in registers: callers need not lend float32 scratch blocks."""
MAX_BLOCK_V = 2048
"""Columns per tile: large enough to amortise the per-tile reductions, small enough for registers."""
STATS_NUM_WARPS = 8
GRAD_NUM_WARPS = 4


@triton.jit
def _update_stats_kernel(
    logits_ptr,
    row_stride,
    target_cols_ptr,
    max_ptr,
    sumexp_ptr,
    target_ptr,
    wsum_ptr,
    n_cols,
    temperature,
    WITH_ENTROPY: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * row_stride
    target_col = tl.load(target_cols_ptr + row)
    run_max = tl.load(max_ptr + row)
    run_sum = tl.load(sumexp_ptr + row)
    run_w = tl.load(wsum_ptr + row)  # aliases sumexp when WITH_ENTROPY is off; never stored then
    picked = run_sum * 0.0
    for start in range(0, n_cols, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        in_block = cols < n_cols
        z = tl.load(row_ptr + cols, mask=in_block, other=float("-inf")).to(tl.float32) / temperature
        picked += tl.sum(tl.where((cols == target_col) & in_block, z, 0.0), axis=0)
        new_max = tl.maximum(run_max, tl.max(z, axis=0))
        seen = run_sum > 0.0
        shift = tl.where(seen, run_max - new_max, 0.0)
        scale = tl.where(seen, tl.exp(shift), 0.0)
        shifted = tl.where(in_block, z - new_max, 0.0)  # 0, not -inf, off the block: no 0 * inf below
        e = tl.where(in_block, tl.exp(shifted), 0.0)
        if WITH_ENTROPY:
            run_w = scale * (run_w + shift * run_sum) + tl.sum(e * shifted, axis=0)
        run_sum = run_sum * scale + tl.sum(e, axis=0)
        run_max = new_max
    tl.store(max_ptr + row, run_max)
    tl.store(sumexp_ptr + row, run_sum)
    tl.store(target_ptr + row, tl.load(target_ptr + row) + picked)
    if WITH_ENTROPY:
        tl.store(wsum_ptr + row, run_w)


@triton.jit
def _block_grad_kernel(
    logits_ptr,
    logits_row_stride,
    out_ptr,
    out_row_stride,
    target_cols_ptr,
    logz_ptr,
    mean_z_ptr,
    grad_logprob_ptr,
    grad_entropy_ptr,
    n_cols,
    temperature,
    WITH_ENTROPY: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    in_block = cols < n_cols
    z = tl.load(logits_ptr + row * logits_row_stride + cols, mask=in_block, other=0.0).to(tl.float32)
    z = z / temperature
    g = tl.load(grad_logprob_ptr + row)
    p = tl.exp(z - tl.load(logz_ptr + row))
    grad = tl.where(cols == tl.load(target_cols_ptr + row), g, 0.0) - p * g
    if WITH_ENTROPY:
        grad -= p * (z - tl.load(mean_z_ptr + row)) * tl.load(grad_entropy_ptr + row)
    grad = grad / temperature
    tl.store(out_ptr + row * out_row_stride + cols, grad.to(out_ptr.dtype.element_ty), mask=in_block)


def _check_rows(block: torch.Tensor) -> None:
    if block.stride(1) != 1:
        raise ValueError(f"triton log-prob kernels need unit column stride, got strides {block.stride()}")
    if block.device.type != "cuda" and not INTERPRETED:
        raise RuntimeError(
            "the Triton log-prob kernels got CPU tensors but were built without the interpreter; "
            "set TRITON_INTERPRET=1 before importing megatron_mugrpo.kernels.triton_backend, "
            "or use impl='torch'"
        )


def _tile(n_cols: int) -> int:
    return min(MAX_BLOCK_V, triton.next_power_of_2(max(n_cols, 16)))


def update_stats(
    stats: SoftmaxStats,
    block: torch.Tensor,
    target_cols: torch.Tensor,
    temperature: float,
    work: torch.Tensor | None = None,
) -> None:
    """Fold a [N, Vb] block of real-vocabulary logits into ``stats`` in place (see torch_backend).

    ``work`` is accepted for interface parity: the kernel never copies the block anyway.
    """
    _check_rows(block)
    n, n_cols = block.shape
    if n == 0 or n_cols == 0:
        return
    with_entropy = stats.wsum is not None
    _update_stats_kernel[(n,)](
        block,
        block.stride(0),
        target_cols.contiguous(),
        stats.max,
        stats.sumexp,
        stats.target,
        stats.wsum if with_entropy else stats.sumexp,
        n_cols,
        float(temperature),
        WITH_ENTROPY=with_entropy,
        BLOCK_V=_tile(n_cols),
        num_warps=STATS_NUM_WARPS,
    )


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
    """Write d(loss)/d(logits) of a [N, Vb] block into ``out`` (may alias ``block``; see torch_backend).

    ``work`` is accepted for interface parity and ignored.
    """
    _check_rows(block)
    _check_rows(out)
    n, n_cols = block.shape
    if n == 0 or n_cols == 0:
        return
    with_entropy = grad_entropy is not None and mean_z is not None
    tile = _tile(n_cols)
    _block_grad_kernel[(n, triton.cdiv(n_cols, tile))](
        block,
        block.stride(0),
        out,
        out.stride(0),
        target_cols.contiguous(),
        logz,
        mean_z if with_entropy else logz,
        grad_logprob.contiguous(),
        grad_entropy.contiguous() if with_entropy else grad_logprob,
        n_cols,
        float(temperature),
        WITH_ENTROPY=with_entropy,
        BLOCK_V=tile,
        num_warps=GRAD_NUM_WARPS,
    )
