"""Shared cases and float64 references for the kernel tests.

Tolerances (stated once, used by every kernel test):

* values (log-prob, entropy): |fast - ref| <= VALUE_TOL_FACTOR · eps(dtype) · max|z| + 1e-6, z = logits / T.
  Rounding each logit to the input dtype moves z by <= eps/2 · |z|, and log-softmax moves by at most
  twice the largest shift; fp32 statistics add ~1e-6.
* gradients: max|fast - ref| <= GRAD_TOL_FACTOR[dtype] · eps(dtype) · max|ref| (normalised by the
  largest reference entry: gradients are rounded to the input dtype once per vocabulary block).

The reference is ``log_softmax`` + ``gather`` in float64 over logits computed in float64 from the
same (dtype-rounded) hidden states and weights.
"""

from __future__ import annotations

import torch

from megatron_mugrpo.kernels import reference_logprobs

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
VALUE_TOL_FACTOR = 4.0
GRAD_TOL_FACTOR = {torch.float32: 16.0, torch.bfloat16: 4.0, torch.float16: 4.0}


def make_case(
    n: int, hidden: int, padded_vocab: int, dtype: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(hidden [N, H], weight [V_pad, H], grad_logprob [N] f64, grad_entropy [N] f64), all seeded."""
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=gen).to(dtype)
    w = (0.3 * torch.randn(padded_vocab, hidden, generator=gen)).to(dtype)
    g_lp = torch.randn(n, generator=gen, dtype=torch.float64)
    g_ent = torch.randn(n, generator=gen, dtype=torch.float64)
    return h, w, g_lp, g_ent


def make_targets(n: int, vocab_size: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab_size, (n,), generator=torch.Generator().manual_seed(seed + 1))


def reference_linear(
    h: torch.Tensor,
    w: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    vocab_size: int,
    g_lp: torch.Tensor,
    g_ent: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """Float64 logprob, entropy, d hidden, d weight, d logits of Σ g_lp·logprob + Σ g_ent·entropy."""
    hr = h.double().requires_grad_()
    wr = w.double().requires_grad_()
    logits = hr @ wr.T
    logits.retain_grad()
    logprob, entropy = reference_logprobs(logits, targets, temperature=temperature, vocab_size=vocab_size)
    ((logprob * g_lp).sum() + (entropy * g_ent).sum()).backward()
    return {
        "logprob": logprob.detach(),
        "entropy": entropy.detach(),
        "hidden": hr.grad,
        "weight": wr.grad,
        "logits": logits.grad,
        "zmax": (logits.detach()[:, :vocab_size].abs().max() / temperature).item(),
    }


def assert_values_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, zmax: float) -> None:
    tol = VALUE_TOL_FACTOR * torch.finfo(dtype).eps * zmax + 1e-6
    err = (actual.double() - expected).abs().max().item()
    assert err <= tol, f"{dtype}: max value error {err:.3g} > tolerance {tol:.3g}"


def assert_grads_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert actual.dtype == dtype, f"gradient dtype {actual.dtype} != input dtype {dtype}"
    scale = expected.abs().max().item()
    tol = GRAD_TOL_FACTOR[dtype] * torch.finfo(dtype).eps * scale
    err = (actual.double() - expected).abs().max().item()
    assert err <= tol, f"{dtype}: max gradient error {err:.3g} > tolerance {tol:.3g} (scale {scale:.3g})"
