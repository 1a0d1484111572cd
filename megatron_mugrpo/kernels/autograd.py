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

What the fused path costs. The backward needs every block's logits a second time (the softmax
normaliser and the upstream gradient are known only after the whole forward), so with nothing kept
a step costs four ``N × H × V/tp`` matmuls where materialised logits cost three: forward, recompute,
d W, d hidden. ``keep_bytes`` trades memory for that fourth matmul: the forward keeps as many
leading blocks' logits (in the input dtype) as fit, and the backward recomputes only the others.
One reused ``[N, block]`` buffer (plus a float32 one for bf16 / fp16 inputs) holds every recomputed
block, so the per-block loop allocates nothing of that size.
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


def kept_blocks(n_tokens: int, blocks: list[tuple[int, int]], itemsize: int, keep_bytes: int) -> int:
    """How many leading blocks' logits (``itemsize`` bytes per element) fit in ``keep_bytes``."""
    kept, used = 0, 0
    for v0, v1 in blocks:
        used += n_tokens * (v1 - v0) * itemsize
        if used > keep_bytes:
            break
        kept += 1
    return kept


class _BlockBuffer:
    """One flat buffer viewed as [N, width] for every block of the loop.

    Allocating a fresh [N, block] tensor per block would fault in (and zero) new pages each time
    for large blocks; one buffer reused across blocks stays mapped.
    """

    def __init__(self, n_tokens: int, width: int, dtype: torch.dtype, device: torch.device) -> None:
        self.n_tokens = n_tokens
        self.flat = torch.empty(n_tokens * width, dtype=dtype, device=device)

    def view(self, width: int) -> torch.Tensor:
        """A contiguous [N, width] view (usable as a matmul ``out``)."""
        return self.flat[: self.n_tokens * width].view(self.n_tokens, width)


def _float_scratch(
    n_tokens: int, width: int, device: torch.device, backend: ModuleType, wanted: bool = True
) -> _BlockBuffer | None:
    """A float32 block buffer for backends that use one (``NEEDS_WORKSPACE``; Triton keeps registers)."""
    return _BlockBuffer(n_tokens, width, torch.float32, device) if wanted and backend.NEEDS_WORKSPACE else None


def _view(buffer: _BlockBuffer | None, width: int) -> torch.Tensor | None:
    return None if buffer is None else buffer.view(width)


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
        scratch = _float_scratch(logits.shape[0], chunk, logits.device, backend)
        for v0, v1 in _blocks(n_valid, chunk):
            work = _view(scratch, v1 - v0)
            backend.update_stats(stats, logits[:, v0:v1], targets - (vocab_start + v0), temperature, work=work)
        del scratch
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
        # A float32 gradient is its own scratch; bf16 / fp16 ones are computed in a float32 block first.
        scratch = _float_scratch(logits.shape[0], chunk, logits.device, backend, logits.dtype != torch.float32)
        for v0, v1 in _blocks(n_valid, chunk):
            target_cols = targets - (vocab_start + v0)
            work = _view(scratch, v1 - v0)
            backend.block_grad(
                logits[:, v0:v1], target_cols, temperature, logz, mean_z, g_lp, g_ent, grad[:, v0:v1], work=work
            )
        return grad, None, None, None, None, None, None, None, None


class FusedLinearLogprob(torch.autograd.Function):
    """log_softmax((hidden @ weight^T) / T)[target] without ever holding [N, V/tp] logits.

    The forward keeps the logits of the leading blocks that fit in ``keep_bytes``; the backward
    recomputes the other blocks from hidden × weight-block. The hidden gradient is the sum over
    vocab shards of d logits @ W_shard; with ``reduce_hidden_grad`` it is all-reduced across
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
        keep_bytes: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n_tokens = hidden.shape[0]
        n_valid = valid_columns(weight.shape[0], vocab_start, vocab_size)
        blocks = _blocks(n_valid, chunk)
        n_kept = kept_blocks(n_tokens, blocks, hidden.element_size(), keep_bytes)
        stats = SoftmaxStats.empty(n_tokens, hidden.device, with_entropy)
        recomputed = _BlockBuffer(n_tokens, chunk, hidden.dtype, hidden.device)
        # float32 scratch: the logits buffer itself when float32 (a block there is not needed after
        # its statistics, and a kept block leaves the buffer free), a second buffer otherwise.
        if hidden.dtype == torch.float32:
            scratch = recomputed if backend.NEEDS_WORKSPACE else None
        else:
            scratch = _float_scratch(n_tokens, chunk, hidden.device, backend)
        kept = []
        for i, (v0, v1) in enumerate(blocks):
            if i < n_kept:
                block = torch.mm(hidden, weight[v0:v1].t())  # [N, Vb] in the input dtype, kept for backward
                kept.append(block)
            else:
                block = torch.mm(hidden, weight[v0:v1].t(), out=recomputed.view(v1 - v0))
            work = _view(scratch, v1 - v0)
            backend.update_stats(stats, block, targets - (vocab_start + v0), temperature, work=work)
        del recomputed, scratch
        logprob, entropy, logz, mean_z = _finish_forward(ctx, stats, tp_group, with_entropy)
        ctx.save_for_backward(hidden, weight, targets, logz, mean_z, *kept)
        ctx.params = (temperature, vocab_start, n_valid, blocks, chunk, backend, tp_group, reduce_hidden_grad)
        ctx.with_entropy = with_entropy
        return logprob, entropy

    @staticmethod
    def backward(ctx: Any, grad_logprob: torch.Tensor, grad_entropy: torch.Tensor) -> tuple[Any, ...]:
        hidden, weight, targets, logz, mean_z, *kept = ctx.saved_tensors
        temperature, vocab_start, n_valid, blocks, chunk, backend, tp_group, reduce_hidden_grad = ctx.params
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        g_lp, g_ent = _upstream(ctx, grad_logprob, grad_entropy)
        rows = _rows_with_gradient(g_lp, g_ent)
        active = _TokenRows(hidden, targets, logz, mean_z if ctx.with_entropy else None, g_lp, g_ent, rows)
        grad_weight = None
        if need_weight:
            # Contiguous whatever weight's layout, so each block's rows can be the matmul's `out`.
            grad_weight = torch.empty(weight.shape, dtype=weight.dtype, device=weight.device)
            grad_weight[n_valid:].zero_()
        grad_hidden = None
        if need_hidden:
            grad_hidden = torch.zeros(active.hidden.shape, dtype=torch.float32, device=hidden.device)
        n_active = active.hidden.shape[0]
        grads = _BlockBuffer(n_active, chunk, hidden.dtype, hidden.device)
        # A float32 gradient block is its own scratch; bf16 / fp16 ones are computed in float32 first.
        scratch = _float_scratch(n_active, chunk, hidden.device, backend, hidden.dtype != torch.float32)
        for i, (v0, v1) in enumerate(blocks):
            w_block = weight[v0:v1]
            grad_block = grads.view(v1 - v0)  # d logits of the block, written over the block's logits
            if i < len(kept):
                # Read, never overwritten: the graph may be run backward again (retain_graph).
                logits = active.select(kept[i], out=grad_block)
            else:
                logits = torch.mm(active.hidden, w_block.t(), out=grad_block)
            backend.block_grad(
                logits,
                active.targets - (vocab_start + v0),
                temperature,
                active.logz,
                active.mean_z,
                active.g_lp,
                active.g_ent,
                grad_block,
                work=_view(scratch, v1 - v0),
            )
            if grad_weight is not None:
                torch.mm(grad_block.t(), active.hidden, out=grad_weight[v0:v1])
            if grad_hidden is not None:
                _accumulate_hidden_grad(grad_hidden, grad_block, w_block)
        if grad_hidden is not None:
            grad_hidden = active.scatter(grad_hidden)
            if reduce_hidden_grad and tp_group is not None and dist.get_world_size(tp_group) > 1:
                dist.all_reduce(grad_hidden, group=tp_group)
            grad_hidden = grad_hidden.to(hidden.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None, None, None, None, None


def _rows_with_gradient(g_lp: torch.Tensor, g_ent: torch.Tensor | None) -> torch.Tensor | None:
    """Indices of the tokens with a non-zero upstream gradient, or None when that is every token.

    A token whose upstream gradients are both zero has an exactly zero logit gradient, so it takes
    no part in any backward matmul. In RL batches these are many: prompt and padding positions
    (loss mask 0), groups whose rewards are all equal (advantage 0), vetoed or clipped tokens.
    Finding them costs one device synchronisation per backward.
    """
    live = g_lp != 0
    if g_ent is not None:
        live |= g_ent != 0
    rows = torch.nonzero(live).squeeze(1)
    return None if rows.numel() == live.numel() else rows


class _TokenRows:
    """The per-token backward inputs restricted to ``rows`` (all of them when ``rows`` is None)."""

    def __init__(
        self,
        hidden: torch.Tensor,
        targets: torch.Tensor,
        logz: torch.Tensor,
        mean_z: torch.Tensor | None,
        g_lp: torch.Tensor,
        g_ent: torch.Tensor | None,
        rows: torch.Tensor | None,
    ) -> None:
        self.rows, self.n_tokens = rows, hidden.shape[0]
        pick = (lambda t: t) if rows is None else (lambda t: None if t is None else t.index_select(0, rows))
        self.hidden, self.targets, self.logz = pick(hidden), pick(targets), pick(logz)
        self.mean_z, self.g_lp, self.g_ent = pick(mean_z), pick(g_lp), pick(g_ent)

    def select(self, block: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The active rows of a kept [N, Vb] block: the block itself, or its rows copied into ``out``."""
        if self.rows is None:
            return block
        return torch.index_select(block, 0, self.rows, out=out)

    def scatter(self, grad_rows: torch.Tensor) -> torch.Tensor:
        """[N, H] from the active rows' [n_active, H] (zero elsewhere)."""
        if self.rows is None:
            return grad_rows
        full = grad_rows.new_zeros((self.n_tokens, grad_rows.shape[1]))
        return full.index_copy_(0, self.rows, grad_rows)


def _accumulate_hidden_grad(acc: torch.Tensor, grad_block: torch.Tensor, w_block: torch.Tensor) -> None:
    """acc [N, H] float32 += grad_block [N, Vb] @ w_block [Vb, H].

    In float32 this is one fused addmm. For bf16 / fp16 the block product is formed by the matmul
    with float32 accumulation inside and rounded once per block before the float32 sum.
    """
    if grad_block.dtype == torch.float32:
        acc.addmm_(grad_block, w_block)
    else:
        acc += torch.mm(grad_block, w_block)
