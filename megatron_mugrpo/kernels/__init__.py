"""Fused, vocabulary-parallel log-probs (and entropy) that never materialise float32 [N, V/tp] logits.

    logprob[n] = log_softmax(logits[n] / T)[targets[n]]      over the TRUE vocabulary

Each TP rank holds vocabulary rows ``[vocab_start, vocab_start + V/tp)`` of the output layer; ids
``>= vocab_size`` are padding rows (Megatron pads the vocabulary to a multiple of 128 · tp, Hugging
Face and the rollout engine do not have them) and are excluded from the softmax. Max and sum-exp are
reduced across ``tp_group`` in float32; the target logit comes from the rank that owns it.

Two entry points, both autograd-capable, one interface for two implementations:

* :func:`fused_linear_logprobs` (the train step's default): hidden [N, H] × weight shard
  [V/tp, H] → log-probs, block by block of vocabulary columns; backward recomputes each block
  except the leading ones whose logits fit in ``keep_bytes``.
* :func:`vocab_parallel_logprobs`: the same from already materialised logits [N, V/tp].

``impl``: ``"triton"`` (CUDA kernels; CPU tensors only under ``TRITON_INTERPRET=1``), ``"torch"``
(chunked PyTorch, the CPU path and the reference) or ``"auto"`` (Triton on CUDA when importable,
torch otherwise). Inputs may be fp32, bf16 or fp16; statistics and accumulation are float32;
log-probs and entropies come back as float32 [N].

This package imports neither megatron-core nor Transformer Engine at import time.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch
import torch.distributed as dist

from megatron_mugrpo.kernels import torch_backend
from megatron_mugrpo.kernels.autograd import FusedLinearLogprob, VocabParallelLogprob, block_columns
from megatron_mugrpo.kernels.fp8 import (
    FP8_RECIPES,
    build_te_recipe,
    check_fp8_available,
    fp8_context,
    megatron_fp8_kwargs,
)

IMPLS = ("auto", "triton", "torch")
INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

__all__ = [
    "FP8_RECIPES",
    "IMPLS",
    "build_te_recipe",
    "check_fp8_available",
    "fp8_context",
    "fused_linear_logprobs",
    "megatron_fp8_kwargs",
    "reference_logprobs",
    "resolve_impl",
    "vocab_parallel_logprobs",
]


def resolve_impl(impl: str, device: torch.device) -> ModuleType:
    """The backend module for ``impl`` on ``device`` (see the module docstring)."""
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r} is not one of {IMPLS}")
    if impl == "torch" or (impl == "auto" and device.type != "cuda"):
        return torch_backend
    try:
        return importlib.import_module("megatron_mugrpo.kernels.triton_backend")
    except ImportError as exc:
        if impl == "auto":
            return torch_backend
        raise ImportError(f"impl='triton' needs the triton package ({exc}); use impl='torch'") from exc


def _check_common(
    targets: torch.Tensor,
    n_tokens: int,
    n_local: int,
    temperature: float,
    vocab_start: int,
    vocab_size: int,
    tp_group: dist.ProcessGroup | None,
) -> None:
    """Validate the arguments shared by both entry points; errors name the bad input."""
    if targets.dim() != 1 or targets.shape[0] != n_tokens or targets.dtype != torch.long:
        raise ValueError(f"targets must be int64 [N={n_tokens}], got {targets.dtype} {tuple(targets.shape)}")
    if not temperature > 0:
        raise ValueError(f"temperature={temperature} must be > 0 (the rollout temperature T)")
    if vocab_start < 0 or vocab_size < 1:
        raise ValueError(f"vocab_start={vocab_start} must be >= 0 and vocab_size={vocab_size} >= 1")
    single = tp_group is None or dist.get_world_size(tp_group) == 1
    if single and (vocab_start != 0 or n_local < vocab_size):
        raise ValueError(
            f"this shard holds ids [{vocab_start}, {vocab_start + n_local}) of a vocabulary of {vocab_size} "
            "but no tensor-parallel group was given: pass tp_group, or the full (padded) vocabulary"
        )
    if n_tokens:
        low, high = torch.stack([targets.min(), targets.max()]).tolist()  # one device sync
        if low < 0 or high >= vocab_size:
            raise ValueError(
                f"targets must be token ids in [0, vocab_size={vocab_size}); got range [{low}, {high}] "
                "(mask positions with the loss mask, not with -100)"
            )


def _check_dtype(name: str, tensor: torch.Tensor) -> None:
    if tensor.dtype not in INPUT_DTYPES:
        raise ValueError(f"{name} must be one of {INPUT_DTYPES}, got {tensor.dtype}")


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float,
    vocab_start: int,
    vocab_size: int,
    tp_group: dist.ProcessGroup | None = None,
    with_entropy: bool = False,
    chunk_size: int | None = None,
    impl: str = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Selected-token log-probs (and entropy) from a vocabulary shard of logits.

    Args:
        logits: [N, V/tp] this rank's logits (fp32 / bf16 / fp16), column j = global id vocab_start + j.
        targets: [N] int64 global target ids in [0, vocab_size).
        temperature: T; the softmax is over logits / T (the rollout's sampling distribution).
        vocab_start: global id of this shard's first column.
        vocab_size: the TRUE vocabulary size; ids >= vocab_size are padding, excluded.
        tp_group: the tensor-parallel group the vocabulary is split over (None: one shard).
        with_entropy: also return the entropy of softmax(logits / T) [N].
        chunk_size: vocabulary columns per float32 working block (None: ~32 MiB per block).
        impl: "auto" | "triton" | "torch".

    Returns:
        logprob [N] float32, or (logprob [N], entropy [N]) float32. Backward returns d logits
        [N, V/tp] in the logits' dtype (zero on padding columns); no TP communication in backward.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [N, V/tp], got shape {tuple(logits.shape)}; flatten [B, T, V] first")
    _check_dtype("logits", logits)
    n_tokens, n_local = logits.shape
    _check_common(targets, n_tokens, n_local, temperature, vocab_start, vocab_size, tp_group)
    backend = resolve_impl(impl, logits.device)
    chunk = n_local if backend is not torch_backend else block_columns(n_tokens, n_local, chunk_size)
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    logprob, entropy = VocabParallelLogprob.apply(
        logits, targets, float(temperature), vocab_start, vocab_size, tp_group, with_entropy, chunk, backend
    )
    return (logprob, entropy) if with_entropy else logprob


def fused_linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float,
    vocab_start: int,
    vocab_size: int,
    tp_group: dist.ProcessGroup | None = None,
    chunk_size: int | None = None,
    with_entropy: bool = False,
    impl: str = "auto",
    reduce_hidden_grad: bool = True,
    keep_bytes: int = 0,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-probs (and entropy) of ``hidden @ weight^T`` without materialising [N, V/tp] logits.

    Args:
        hidden: [N, H] final hidden states (after the final norm), identical on every TP rank.
        weight: [V/tp, H] this rank's output-layer shard (same dtype as hidden), rows = global ids
            vocab_start + j; rows with id >= vocab_size are padding and are never multiplied.
        targets, temperature, vocab_start, vocab_size, tp_group, with_entropy, impl: as in
            :func:`vocab_parallel_logprobs`.
        chunk_size: vocabulary columns per block; each block costs one [N, block] buffer in the input
            dtype plus (torch path) two float32 ones. None: ~32 MiB per float32 block.
        reduce_hidden_grad: all-reduce d hidden across ``tp_group`` in backward. Keep True when
            ``hidden`` is a plain replicated activation (this function then plays the role of
            Megatron's ``copy_to_tensor_model_parallel_region`` in front of the column-parallel
            output layer). Set False if the caller already passed hidden through a Megatron region
            op whose backward reduces (``copy_to_tensor_model_parallel_region``, or
            ``gather_from_sequence_parallel_region`` with sequence parallelism), or the gradient is
            counted tp times.
        keep_bytes: memory the forward may spend keeping block logits (input dtype) for the
            backward, which then recomputes only the blocks that did not fit. Each kept block saves
            one of the four ``N × H × Vb`` block matmuls; 0 keeps none (the least memory).
            ``N · V/tp · itemsize`` or more keeps every block (no recompute, the materialised path's
            matmul count at a third of its working memory).

    Returns:
        logprob [N] float32, or (logprob, entropy) [N] float32. Backward gives d hidden [N, H] in
        hidden's dtype (float32 accumulation over blocks) and d weight [V/tp, H] in weight's dtype
        (one matmul per block over all tokens; zero on padding rows). No bias: Qwen2/Llama output
        layers have none.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"hidden must be [N, H] and weight [V/tp, H]; got {tuple(hidden.shape)} and {tuple(weight.shape)}"
        )
    _check_dtype("hidden", hidden)
    if weight.dtype != hidden.dtype:
        raise ValueError(f"hidden ({hidden.dtype}) and weight ({weight.dtype}) must share a dtype")
    n_tokens, n_local = hidden.shape[0], weight.shape[0]
    _check_common(targets, n_tokens, n_local, temperature, vocab_start, vocab_size, tp_group)
    if keep_bytes < 0:
        raise ValueError(f"keep_bytes={keep_bytes} must be >= 0 (bytes of block logits kept for backward)")
    if not (torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)):
        keep_bytes = 0  # no backward will read them
    backend = resolve_impl(impl, hidden.device)
    chunk = block_columns(n_tokens, n_local, chunk_size)
    logprob, entropy = FusedLinearLogprob.apply(
        hidden.contiguous(),
        weight,
        targets,
        float(temperature),
        vocab_start,
        vocab_size,
        tp_group,
        with_entropy,
        chunk,
        backend,
        reduce_hidden_grad,
        int(keep_bytes),
    )
    return (logprob, entropy) if with_entropy else logprob


def reference_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, *, temperature: float, vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 reference over full (unsharded) logits [N, V_padded]: (logprob [N], entropy [N]).

    ``log_softmax((logits / T)[:, :vocab_size]).gather(targets)``; differentiable, for tests and the
    unfused comparison path.
    """
    z = logits[:, :vocab_size].double() / temperature
    logp = torch.log_softmax(z, dim=-1)
    entropy = -(logp.exp() * logp).sum(dim=-1)
    return logp.gather(1, targets.unsqueeze(1)).squeeze(1), entropy
