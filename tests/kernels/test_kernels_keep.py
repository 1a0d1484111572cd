"""Fused log-prob backward with kept block logits and skipped zero-gradient tokens vs float64 (CPU).

``keep_bytes`` lets the forward keep the leading blocks' logits so the backward recomputes only the
rest; tokens whose upstream gradients are zero are left out of every backward matmul. Both must
leave the results exactly what the all-recompute path computes, up to the float64 tolerances of
``kernel_cases``.
"""

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

from megatron_mugrpo.kernels import fused_linear_logprobs
from megatron_mugrpo.kernels.autograd import kept_blocks

N, H, VOCAB, PADDED = 48, 32, 1000, 1024
CHUNK = 256  # blocks [0,256) [256,512) [512,768) [768,1000): the last one stops at the true vocabulary


def _keep(n_blocks: int, dtype: torch.dtype) -> int:
    """Bytes that fit exactly the first ``n_blocks`` blocks of CHUNK columns."""
    return N * CHUNK * n_blocks * torch.finfo(dtype).bits // 8


def _fused(h, w, targets, temperature, keep_bytes, g_lp, g_ent):
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
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
        keep_bytes=keep_bytes,
    )
    ((logprob * g_lp.float()).sum() + (entropy * g_ent.float()).sum()).backward()
    return logprob.detach(), entropy.detach(), h.grad, w.grad


def test_kept_blocks_counts_what_fits() -> None:
    blocks = [(0, 256), (256, 512), (512, 768), (768, 1000)]
    assert kept_blocks(N, blocks, 4, 0) == 0
    assert kept_blocks(N, blocks, 4, N * 256 * 4 - 1) == 0
    assert kept_blocks(N, blocks, 4, N * 256 * 4 * 2) == 2
    assert kept_blocks(N, blocks, 2, N * 1000 * 2) == 4  # bf16: every block, the short last one included
    assert kept_blocks(N, blocks, 4, 10**12) == 4


@pytest.mark.parametrize("temperature", (1.0, 0.7))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n_kept", (1, 4))
def test_kept_logits_match_float64_reference(dtype: torch.dtype, temperature: float, n_kept: int) -> None:
    h, w, g_lp, g_ent = make_case(N, H, PADDED, dtype, seed=5)
    targets = make_targets(N, VOCAB, seed=5)
    ref = reference_linear(h, w, targets, temperature, VOCAB, g_lp, g_ent)
    logprob, entropy, d_hidden, d_weight = _fused(h, w, targets, temperature, _keep(n_kept, dtype), g_lp, g_ent)
    assert_values_close(logprob, ref["logprob"], dtype, ref["zmax"])
    assert_values_close(entropy, ref["entropy"], dtype, ref["zmax"])
    assert_grads_close(d_hidden, ref["hidden"], dtype)
    assert_grads_close(d_weight, ref["weight"], dtype)
    assert torch.count_nonzero(d_weight[VOCAB:]) == 0, "padding rows must get no gradient"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n_kept", (0, 2))
def test_zero_gradient_tokens_are_skipped_exactly(dtype: torch.dtype, n_kept: int) -> None:
    h, w, g_lp, g_ent = make_case(N, H, PADDED, dtype, seed=6)
    targets = make_targets(N, VOCAB, seed=6)
    g_lp[::3] = 0.0  # prompt / padding / zero-advantage tokens: no gradient at all
    g_ent[::3] = 0.0
    g_ent[1::3] = 0.0  # entropy-free but log-prob-carrying tokens stay in
    ref = reference_linear(h, w, targets, 0.8, VOCAB, g_lp, g_ent)
    _, _, d_hidden, d_weight = _fused(h, w, targets, 0.8, _keep(n_kept, dtype), g_lp, g_ent)
    assert_grads_close(d_hidden, ref["hidden"], dtype)
    assert_grads_close(d_weight, ref["weight"], dtype)
    assert torch.count_nonzero(d_hidden[::3]) == 0


def test_all_zero_upstream_gives_zero_gradients() -> None:
    h, w, g_lp, g_ent = make_case(N, H, PADDED, torch.float32)
    targets = make_targets(N, VOCAB)
    _, _, d_hidden, d_weight = _fused(h, w, targets, 1.0, _keep(1, torch.float32), 0 * g_lp, 0 * g_ent)
    assert torch.count_nonzero(d_hidden) == 0 and torch.count_nonzero(d_weight) == 0


def test_keeping_does_not_change_the_result() -> None:
    """Kept and recomputed blocks are the same matmul: results agree to float32 summation order."""
    h, w, g_lp, g_ent = make_case(N, H, PADDED, torch.float32, seed=7)
    targets = make_targets(N, VOCAB, seed=7)
    results = [_fused(h, w, targets, 0.9, _keep(n, torch.float32), g_lp, g_ent) for n in (0, 1, 3, 4)]
    for other in results[1:]:
        for a, b in zip(results[0], other):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_kept_logits_survive_a_second_backward() -> None:
    """retain_graph: the backward reads kept blocks without overwriting them."""
    h, w, g_lp, _ = make_case(N, H, PADDED, torch.float32, seed=8)
    targets = make_targets(N, VOCAB, seed=8)
    h.requires_grad_()
    w.requires_grad_()
    kwargs = {"temperature": 1.0, "vocab_start": 0, "vocab_size": VOCAB, "chunk_size": CHUNK, "impl": "torch"}
    logprob = fused_linear_logprobs(h, w, targets, keep_bytes=10**9, **kwargs)
    loss = (logprob * g_lp.float()).sum()
    loss.backward(retain_graph=True)
    first = (h.grad.clone(), w.grad.clone())
    h.grad, w.grad = None, None
    loss.backward()
    torch.testing.assert_close(h.grad, first[0], rtol=0, atol=0)
    torch.testing.assert_close(w.grad, first[1], rtol=0, atol=0)


def _saved_bytes(keep_bytes: int) -> int:
    """Bytes of [N, block] logits the fused forward saves for backward (inputs and [N] statistics aside)."""
    h, w, _, _ = make_case(N, H, PADDED, torch.bfloat16, seed=9)
    h.requires_grad_()
    w.requires_grad_()
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fused_linear_logprobs(
            h,
            w,
            make_targets(N, VOCAB),
            temperature=1.0,
            vocab_start=0,
            vocab_size=VOCAB,
            chunk_size=CHUNK,
            impl="torch",
            keep_bytes=keep_bytes,
        )
    blocks = [t for t in saved if t.dim() == 2 and t.shape[0] == N and H < t.shape[1] <= CHUNK]
    return sum(t.numel() * t.element_size() for t in blocks)


def test_forward_keeps_no_more_than_the_budget() -> None:
    block = N * CHUNK * 2  # bf16
    assert _saved_bytes(0) == 0
    assert _saved_bytes(block - 1) == 0
    assert _saved_bytes(2 * block + block // 2) == 2 * block
    assert _saved_bytes(10**9) == N * VOCAB * 2  # every real column, never the padding rows


def test_negative_keep_is_an_error() -> None:
    h, w, _, _ = make_case(4, H, PADDED, torch.float32)
    with pytest.raises(ValueError, match="keep_bytes"):
        fused_linear_logprobs(
            h, w, torch.zeros(4, dtype=torch.long), temperature=1.0, vocab_start=0, vocab_size=VOCAB, keep_bytes=-1
        )
