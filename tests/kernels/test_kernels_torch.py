"""Chunked torch path of the fused log-prob vs a float64 log_softmax + gather reference (CPU)."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import (
    DTYPES,
    assert_grads_close,
    assert_values_close,
    make_case,
    make_targets,
    reference_linear,
)
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_mugrpo.kernels import (
    fused_linear_logprobs,
    resolve_impl,
    torch_backend,
    vocab_parallel_logprobs,
)

N, H, VOCAB, PADDED = 48, 32, 1000, 1024
CHUNK = 256  # four blocks, the last one partly padding
TEMPERATURES = (1.0, 0.7)


def _backward(logprob: torch.Tensor, entropy: torch.Tensor, g_lp: torch.Tensor, g_ent: torch.Tensor) -> None:
    ((logprob * g_lp.float()).sum() + (entropy * g_ent.float()).sum()).backward()


@pytest.mark.parametrize("temperature", TEMPERATURES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_linear_matches_float64_reference(dtype: torch.dtype, temperature: float) -> None:
    h, w, g_lp, g_ent = make_case(N, H, PADDED, dtype)
    targets = make_targets(N, VOCAB)
    ref = reference_linear(h, w, targets, temperature, VOCAB, g_lp, g_ent)
    h.requires_grad_()
    w.requires_grad_()
    logprob, entropy = fused_linear_logprobs(
        h,
        w,
        targets,
        temperature=temperature,
        vocab_start=0,
        vocab_size=VOCAB,
        with_entropy=True,
        chunk_size=CHUNK,
        impl="torch",
    )
    assert logprob.dtype == entropy.dtype == torch.float32
    _backward(logprob, entropy, g_lp, g_ent)
    assert_values_close(logprob, ref["logprob"], dtype, ref["zmax"])
    assert_values_close(entropy, ref["entropy"], dtype, ref["zmax"])
    assert_grads_close(h.grad, ref["hidden"], dtype)
    assert_grads_close(w.grad, ref["weight"], dtype)
    assert torch.count_nonzero(w.grad[VOCAB:]) == 0, "padding rows must get no gradient"


@pytest.mark.parametrize("temperature", TEMPERATURES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_vocab_parallel_matches_float64_reference(dtype: torch.dtype, temperature: float) -> None:
    h, w, g_lp, g_ent = make_case(N, H, PADDED, dtype)
    targets = make_targets(N, VOCAB)
    logits = (h.double() @ w.double().T).to(dtype)  # the dtype-rounded logits are the input here
    ref = reference_linear(logits, torch.eye(PADDED, dtype=dtype), targets, temperature, VOCAB, g_lp, g_ent)
    logits.requires_grad_()
    logprob, entropy = vocab_parallel_logprobs(
        logits,
        targets,
        temperature=temperature,
        vocab_start=0,
        vocab_size=VOCAB,
        with_entropy=True,
        chunk_size=CHUNK,
        impl="torch",
    )
    _backward(logprob, entropy, g_lp, g_ent)
    # Logits are exact inputs here, so only float32 statistics separate us from float64.
    assert_values_close(logprob, ref["logprob"], torch.float32, ref["zmax"])
    assert_values_close(entropy, ref["entropy"], torch.float32, ref["zmax"])
    assert_grads_close(logits.grad, ref["logits"], dtype)


def test_logprob_only_and_frozen_weight() -> None:
    h, w, g_lp, _ = make_case(N, H, PADDED, torch.float32)
    targets = make_targets(N, VOCAB)
    ref = reference_linear(h, w, targets, 0.9, VOCAB, g_lp, torch.zeros_like(g_lp))
    h.requires_grad_()
    logprob = fused_linear_logprobs(h, w, targets, temperature=0.9, vocab_start=0, vocab_size=VOCAB, impl="torch")
    assert isinstance(logprob, torch.Tensor) and logprob.shape == (N,)
    (logprob * g_lp.float()).sum().backward()
    assert w.grad is None
    assert_values_close(logprob, ref["logprob"], torch.float32, ref["zmax"])
    assert_grads_close(h.grad, ref["hidden"], torch.float32)


def test_padding_rows_never_enter_the_softmax() -> None:
    h, w, _, _ = make_case(N, H, PADDED, torch.float32)
    targets = make_targets(N, VOCAB)
    w[VOCAB:] = 1e4  # padding rows with enormous logits: any leak would dominate the softmax
    padded = fused_linear_logprobs(h, w, targets, temperature=1.0, vocab_start=0, vocab_size=VOCAB, impl="torch")
    exact = fused_linear_logprobs(
        h, w[:VOCAB].clone(), targets, temperature=1.0, vocab_start=0, vocab_size=VOCAB, impl="torch"
    )
    torch.testing.assert_close(padded, exact, rtol=0, atol=0)


def test_block_size_does_not_change_the_result() -> None:
    h, w, g_lp, g_ent = make_case(N, H, PADDED, torch.float32)
    targets = make_targets(N, VOCAB)
    results = []
    for chunk in (1, 100, 1024, None):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        lp, ent = fused_linear_logprobs(
            hh,
            ww,
            targets,
            temperature=0.8,
            vocab_start=0,
            vocab_size=VOCAB,
            with_entropy=True,
            chunk_size=chunk,
            impl="torch",
        )
        _backward(lp, ent, g_lp, g_ent)
        results.append((lp.detach(), ent.detach(), hh.grad, ww.grad))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)  # fp32 summation order only


class _LargestFloat32(TorchDispatchMode):
    """Records the largest float32 tensor any op produces."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                self.largest = max(self.largest, t.numel())
        return out


def test_fused_path_never_builds_full_width_float32_logits() -> None:
    n, hidden, vocab = 64, 16, 4096
    h, w, g_lp, _ = make_case(n, hidden, vocab, torch.bfloat16)
    h.requires_grad_()
    w.requires_grad_()
    targets = make_targets(n, vocab)
    with _LargestFloat32() as mode:
        lp = fused_linear_logprobs(
            h, w, targets, temperature=1.0, vocab_start=0, vocab_size=vocab, chunk_size=512, impl="torch"
        )
        (lp * g_lp.float()).sum().backward()
    assert mode.largest <= n * 512, f"a float32 tensor of {mode.largest} elements exceeds one [N, block] buffer"


def test_errors_name_the_bad_input() -> None:
    h, w, _, _ = make_case(4, H, PADDED, torch.float32)
    kwargs = {"temperature": 1.0, "vocab_start": 0, "vocab_size": VOCAB, "impl": "torch"}
    with pytest.raises(ValueError, match="targets must be token ids"):
        fused_linear_logprobs(h, w, torch.tensor([0, 1, VOCAB, 2]), **kwargs)
    with pytest.raises(ValueError, match="no tensor-parallel group"):
        fused_linear_logprobs(h, w[:512], torch.zeros(4, dtype=torch.long), **kwargs)
    with pytest.raises(ValueError, match="must share a dtype"):
        fused_linear_logprobs(h, w.bfloat16(), torch.zeros(4, dtype=torch.long), **kwargs)
    with pytest.raises(ValueError, match="temperature"):
        fused_linear_logprobs(h, w, torch.zeros(4, dtype=torch.long), **(kwargs | {"temperature": 0.0}))
    with pytest.raises(ValueError, match="impl"):
        vocab_parallel_logprobs(h @ w.T, torch.zeros(4, dtype=torch.long), **(kwargs | {"impl": "cuda"}))


def test_auto_impl_is_torch_on_cpu() -> None:
    assert resolve_impl("auto", torch.device("cpu")) is torch_backend


def test_empty_batch() -> None:
    h, w, _, _ = make_case(0, H, PADDED, torch.float32)
    h.requires_grad_()
    lp = fused_linear_logprobs(h, w, torch.zeros(0, dtype=torch.long), temperature=1.0, vocab_start=0, vocab_size=VOCAB)
    lp.sum().backward()
    assert lp.shape == (0,) and h.grad.shape == (0, H)
