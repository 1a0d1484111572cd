"""Triton path vs the float64 reference, run by the Triton interpreter on CPU (small shapes).

``TRITON_INTERPRET=1`` must be set before ``triton.jit`` decorates the kernels, i.e. before
``megatron_mugrpo.kernels.triton_backend`` is first imported; on a CUDA machine the same tests run
the compiled kernels on the GPU.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kernel_cases import (
    DTYPES,
    assert_grads_close,
    assert_values_close,
    make_case,
    make_targets,
    reference_linear,
)

from megatron_mugrpo.kernels import fused_linear_logprobs, vocab_parallel_logprobs

try:
    from megatron_mugrpo.kernels import triton_backend
except Exception as exc:  # triton missing, or its interpreter failing to load (e.g. no numpy)
    pytest.skip(f"triton is not usable here: {exc}", allow_module_level=True)

if not torch.cuda.is_available() and not triton_backend.INTERPRETED:
    pytest.skip("triton_backend was imported before TRITON_INTERPRET=1 was set", allow_module_level=True)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
N, H, VOCAB, PADDED = 64, 16, 500, 512  # 64×512: seconds under the interpreter
TEMPERATURE = 0.7


def _run(fn, inputs: list[torch.Tensor], g_lp: torch.Tensor, g_ent: torch.Tensor, **kwargs):
    leaves = [t.to(DEVICE).requires_grad_() for t in inputs]
    logprob, entropy = fn(*leaves, with_entropy=True, **kwargs)
    ((logprob * g_lp.float().to(DEVICE)).sum() + (entropy * g_ent.float().to(DEVICE)).sum()).backward()
    return logprob.cpu(), entropy.cpu(), [leaf.grad.cpu() for leaf in leaves]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_vocab_parallel_matches_float64_reference(dtype: torch.dtype) -> None:
    h, w, g_lp, g_ent = make_case(N, H, PADDED, dtype, seed=3)
    targets = make_targets(N, VOCAB, seed=3)
    logits = (h.double() @ w.double().T).to(dtype)
    ref = reference_linear(logits, torch.eye(PADDED, dtype=dtype), targets, TEMPERATURE, VOCAB, g_lp, g_ent)
    logprob, entropy, (d_logits,) = _run(
        vocab_parallel_logprobs,
        [logits],
        g_lp,
        g_ent,
        targets=targets.to(DEVICE),
        temperature=TEMPERATURE,
        vocab_start=0,
        vocab_size=VOCAB,
        impl="triton",
    )
    assert_values_close(logprob, ref["logprob"], torch.float32, ref["zmax"])
    assert_values_close(entropy, ref["entropy"], torch.float32, ref["zmax"])
    assert_grads_close(d_logits, ref["logits"], dtype)
    assert torch.count_nonzero(d_logits[:, VOCAB:]) == 0


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_triton_fused_linear_matches_float64_reference(dtype: torch.dtype) -> None:
    h, w, g_lp, g_ent = make_case(N, H, PADDED, dtype, seed=4)
    targets = make_targets(N, VOCAB, seed=4)
    ref = reference_linear(h, w, targets, TEMPERATURE, VOCAB, g_lp, g_ent)
    logprob, entropy, (d_hidden, d_weight) = _run(
        fused_linear_logprobs,
        [h, w],
        g_lp,
        g_ent,
        targets=targets.to(DEVICE),
        temperature=TEMPERATURE,
        vocab_start=0,
        vocab_size=VOCAB,
        chunk_size=200,
        impl="triton",
    )
    assert_values_close(logprob, ref["logprob"], dtype, ref["zmax"])
    assert_values_close(entropy, ref["entropy"], dtype, ref["zmax"])
    assert_grads_close(d_hidden, ref["hidden"], dtype)
    assert_grads_close(d_weight, ref["weight"], dtype)


def test_triton_equals_torch_path_without_entropy() -> None:
    h, w, g_lp, _ = make_case(N, H, PADDED, torch.float32, seed=5)
    targets = make_targets(N, VOCAB, seed=5).to(DEVICE)
    outs = {}
    for impl in ("triton", "torch"):
        hh, ww = h.to(DEVICE).requires_grad_(), w.to(DEVICE).requires_grad_()
        lp = fused_linear_logprobs(
            hh, ww, targets, temperature=1.0, vocab_start=0, vocab_size=VOCAB, chunk_size=128, impl=impl
        )
        (lp * g_lp.float().to(DEVICE)).sum().backward()
        outs[impl] = (lp, hh.grad, ww.grad)
    for a, b in zip(outs["triton"], outs["torch"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_triton_online_softmax_across_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows longer than one tile: the kernel's own online max / sum-exp rescaling is exercised."""
    monkeypatch.setattr(triton_backend, "MAX_BLOCK_V", 64)  # 512 columns = 8 tiles per row
    h, w, g_lp, g_ent = make_case(N, H, PADDED, torch.float32, seed=6)
    targets = make_targets(N, VOCAB, seed=6)
    logits = h @ w.T
    ref = reference_linear(logits, torch.eye(PADDED), targets, TEMPERATURE, VOCAB, g_lp, g_ent)
    logprob, entropy, (d_logits,) = _run(
        vocab_parallel_logprobs,
        [logits],
        g_lp,
        g_ent,
        targets=targets.to(DEVICE),
        temperature=TEMPERATURE,
        vocab_start=0,
        vocab_size=VOCAB,
        impl="triton",
    )
    assert_values_close(logprob, ref["logprob"], torch.float32, ref["zmax"])
    assert_values_close(entropy, ref["entropy"], torch.float32, ref["zmax"])
    assert_grads_close(d_logits, ref["logits"], torch.float32)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_triton_kept_blocks_and_zero_gradient_rows_match_float64(dtype: torch.dtype) -> None:
    """Kept block logits (gradient written beside them, not over them) and skipped zero-gradient rows."""
    h, w, g_lp, g_ent = make_case(N, H, PADDED, dtype, seed=7)
    targets = make_targets(N, VOCAB, seed=7)
    g_lp[::4] = 0.0
    g_ent[::4] = 0.0
    ref = reference_linear(h, w, targets, TEMPERATURE, VOCAB, g_lp, g_ent)
    logprob, entropy, (d_hidden, d_weight) = _run(
        fused_linear_logprobs,
        [h, w],
        g_lp,
        g_ent,
        targets=targets.to(DEVICE),
        temperature=TEMPERATURE,
        vocab_start=0,
        vocab_size=VOCAB,
        chunk_size=200,
        impl="triton",
        keep_bytes=N * 200 * h.element_size(),  # the first of three blocks
    )
    assert_values_close(logprob, ref["logprob"], dtype, ref["zmax"])
    assert_values_close(entropy, ref["entropy"], dtype, ref["zmax"])
    assert_grads_close(d_hidden, ref["hidden"], dtype)
    assert_grads_close(d_weight, ref["weight"], dtype)
    assert torch.count_nonzero(d_hidden[::4]) == 0
