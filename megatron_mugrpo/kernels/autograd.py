"""The two autograd functions behind the public interface, shared by the torch and Triton backends.

Both walk the local vocabulary shard in blocks of columns. Per block a *backend* (torch_backend or
triton_backend) folds the block into per-token float32 statistics (forward) or writes the block's
logit gradient (backward); the loop, the tensor-parallel reduction and the matmuls live here.

Why blocks of vocabulary columns rather than of tokens: the statistics merge exactly across
blocks and TP ranks, the backward then produces each block's weight gradient
``d W[v0:v1] = d logits[:, v0:v1]^T @ hidden`` in one matmul over all tokens (a single rounding
in the weight's dtype, no float32 ``[V/tp, H]`` accumulator), and the hidden gradient accumulates in
a float32 ``[N, H]`` buffer, which is small. Padding rows of the shard (global id >= vocab_size) are
never multiplied: they take no part in the softmax and get a zero gradient.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist

from megatron_mugrpo.kernels.stats import SoftmaxStats, all_reduce_stats, finalize

DEFAULT_BLOCK_BYTES = 32 * 2**20
"""Target size of one float32 [N, block] working buffer: 32 MiB keeps the fused path's working set
far below a [N, V/tp] float32 logits buffer while the per-block matmuls stay large enough to run at
full speed."""
MIN_BLOCK_COLUMNS = 128


def block_columns(n_tokens: int, n_columns: int, chunk_size: int | None) -> int:
    """Vocabulary columns per block: ``chunk_size`` if given, else what fits DEFAULT_BLOCK_BYTES."""
    if chunk_size is not None:
        if chunk_size < 1:
            raise ValueError(f"chunk_size={chunk_size} must be >= 1 (vocabulary columns per block) or None")
        return min(chunk_size, max(n_columns, 1))
    fit = DEFAULT_BLOCK_BYTES // (4 * max(n_tokens, 1))
    fit = max(MIN_BLOCK_COLUMNS, fit // MIN_BLOCK_COLUMNS * MIN_BLOCK_COLUMNS)
    return min(fit, max(n_columns, 1))


def valid_columns(n_local: int, vocab_start: int, vocab_size: int) -> int:
    """How many of this shard's columns are real vocabulary ids (the rest are padding rows)."""
    return max(0, min(n_local, vocab_size - vocab_start))


def _blocks(n_valid: int, width: int) -> list[tuple[int, int]]:
    return [(start, min(start + width, n_valid)) for start in range(0, n_valid, width)]


def _finish_forward(
    ctx: Any, stats: SoftmaxStats, tp_group: dist.ProcessGroup | None, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reduce across TP, finalize, and return (logprob, entropy-or-empty, log Z, E_p[z]-or-empty)."""
    logprob, logz, entropy, mean_z = finalize(all_reduce_stats(stats, tp_group))
    if not with_entropy:
        entropy = mean_z = logprob.new_empty(0)
        ctx.mark_non_differentiable(entropy)
    return logprob, entropy, logz, mean_z


def _upstream(
    ctx: Any, grad_logprob: torch.Tensor, grad_entropy: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    grad_ent = grad_entropy.float().contiguous() if ctx.with_entropy else None
    return grad_logprob.float().contiguous(), grad_ent


class VocabParallelLogprob(torch.autograd.Function):
    """log_softmax(logits / T)[target] (and entropy) from a vocab shard of materialised logits."""

    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        targets: torch.Tensor,
        temperature: float,
        vocab_start: int,
        vocab_size: int,
        tp_group: dist.ProcessGroup | None,
        with_entropy: bool,
        chunk: int,
        backend: ModuleType,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n_valid = valid_columns(logits.shape[1], vocab_start, vocab_size)
        stats = SoftmaxStats.empty(logits.shape[0], logits.device, with_entropy)
        for v0, v1 in _blocks(n_valid, chunk):
            backend.update_stats(stats, logits[:, v0:v1], targets - (vocab_start + v0), temperature)
        logprob, entropy, logz, mean_z = _finish_forward(ctx, stats, tp_group, with_entropy)
        ctx.save_for_backward(logits, targets, logz, mean_z)
        ctx.params = (temperature, vocab_start, n_valid, chunk, backend)
        ctx.with_entropy = with_entropy
        return logprob, entropy

    @staticmethod
    def backward(ctx: Any, grad_logprob: torch.Tensor, grad_entropy: torch.Tensor) -> tuple[Any, ...]:
        logits, targets, logz, mean_z = ctx.saved_tensors
        temperature, vocab_start, n_valid, chunk, backend = ctx.params
        g_lp, g_ent = _upstream(ctx, grad_logprob, grad_entropy)
        grad = torch.empty_like(logits)
        grad[:, n_valid:].zero_()
        for v0, v1 in _blocks(n_valid, chunk):
            target_cols = targets - (vocab_start + v0)
            backend.block_grad(logits[:, v0:v1], target_cols, temperature, logz, mean_z, g_lp, g_ent, grad[:, v0:v1])
        return grad, None, None, None, None, None, None, None, None


class FusedLinearLogprob(torch.autograd.Function):
    """log_softmax((hidden @ weight^T) / T)[target] without ever holding [N, V/tp] logits.

    Backward recomputes each block's logits from hidden × weight-block. The hidden gradient is the
    sum over vocab shards of d logits @ W_shard; with ``reduce_hidden_grad`` it is all-reduced across
    ``tp_group`` here, which is what Megatron's ``copy_to_tensor_model_parallel_region`` does for
    the input of the column-parallel output layer that this function replaces.
    """

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        temperature: float,
        vocab_start: int,
        vocab_size: int,
        tp_group: dist.ProcessGroup | None,
        with_entropy: bool,
        chunk: int,
        backend: ModuleType,
        reduce_hidden_grad: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n_valid = valid_columns(weight.shape[0], vocab_start, vocab_size)
        stats = SoftmaxStats.empty(hidden.shape[0], hidden.device, with_entropy)
        for v0, v1 in _blocks(n_valid, chunk):
            block = torch.mm(hidden, weight[v0:v1].t())  # [N, Vb] in the input dtype
            backend.update_stats(stats, block, targets - (vocab_start + v0), temperature, scratch=True)
            del block
        logprob, entropy, logz, mean_z = _finish_forward(ctx, stats, tp_group, with_entropy)
        ctx.save_for_backward(hidden, weight, targets, logz, mean_z)
        ctx.params = (temperature, vocab_start, n_valid, chunk, backend, tp_group, reduce_hidden_grad)
        ctx.with_entropy = with_entropy
        return logprob, entropy

    @staticmethod
    def backward(ctx: Any, grad_logprob: torch.Tensor, grad_entropy: torch.Tensor) -> tuple[Any, ...]:
        hidden, weight, targets, logz, mean_z = ctx.saved_tensors
        temperature, vocab_start, n_valid, chunk, backend, tp_group, reduce_hidden_grad = ctx.params
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        g_lp, g_ent = _upstream(ctx, grad_logprob, grad_entropy)
        grad_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device) if need_hidden else None
        grad_weight = None
        if need_weight:
            # Contiguous whatever weight's layout, so each block's rows can be the matmul's `out`.
            grad_weight = torch.empty(weight.shape, dtype=weight.dtype, device=weight.device)
            grad_weight[n_valid:].zero_()
        for v0, v1 in _blocks(n_valid, chunk):
            w_block = weight[v0:v1]
            block = torch.mm(hidden, w_block.t())  # recomputed logits, overwritten by their gradient
            target_cols = targets - (vocab_start + v0)
            backend.block_grad(block, target_cols, temperature, logz, mean_z, g_lp, g_ent, block)
            if grad_weight is not None:
                torch.mm(block.t(), hidden, out=grad_weight[v0:v1])
            if grad_hidden is not None:
                _accumulate_hidden_grad(grad_hidden, block, w_block)
            del block
        if grad_hidden is not None:
            if reduce_hidden_grad and tp_group is not None and dist.get_world_size(tp_group) > 1:
                dist.all_reduce(grad_hidden, group=tp_group)
            grad_hidden = grad_hidden.to(hidden.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None, None, None, None


def _accumulate_hidden_grad(acc: torch.Tensor, grad_block: torch.Tensor, w_block: torch.Tensor) -> None:
    """acc [N, H] float32 += grad_block [N, Vb] @ w_block [Vb, H].

    In float32 this is one fused addmm. For bf16 / fp16 the block product is formed by the matmul
    with float32 accumulation inside and rounded once per block before the float32 sum.
    """
    if grad_block.dtype == torch.float32:
        acc.addmm_(grad_block, w_block)
    else:
        acc += torch.mm(grad_block, w_block)
