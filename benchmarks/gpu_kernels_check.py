"""GPU check of the Triton log-prob kernels against the torch path, then the benchmark, on one CUDA GPU.

    python benchmarks/gpu_kernels_check.py            # exits non-zero if a check fails

Imports only torch, triton and ``megatron_mugrpo.kernels`` (no megatron-core, no omegaconf), so it
runs on a bare GPU machine from a clone. Checks, in bf16 at Qwen2.5-7B's output-layer shape
(hidden 3584, 151,936 rows of which the last 271 are padding beyond the tokenizer's 151,665):

1. fused_linear_logprobs: Triton vs torch path (log-prob, entropy, d hidden, d W);
2. the same against a float64 log_softmax + gather reference on a slice of tokens;
3. vocab_parallel_logprobs on materialised logits: Triton vs torch (log-prob, entropy, d logits);
4. forward + backward times of Triton-fused, torch-fused and naive (``time_ratio`` = naive / Triton);
5. which FP8 recipes this machine can run (a ConfigError names the reason when it cannot);

then runs ``benchmarks/logprob_loss.py --impl triton`` at 4096 and 16384 tokens and repeats each
run's ``memory_ratio`` and ``time_ratio`` (Triton-fused vs naive) on one line,
``triton_vs_naive tokens=<n> memory_ratio=<x> time_ratio=<y>``. Last line: ``checks=<passed>/<total>``.
Without CUDA it only says so and exits 0 (``--help`` works anywhere).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from common import best_time
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megatron_mugrpo.kernels import (
    FP8_RECIPES,
    check_fp8_available,
    fused_linear_logprobs,
    reference_logprobs,
    vocab_parallel_logprobs,
)

TOKENS, HIDDEN, PADDED_VOCAB, VOCAB = 2048, 3584, 151936, 151665
TEMPERATURE = 0.9
VALUE_ATOL = 2e-4
"""Triton vs torch log-prob / entropy: same bf16 logit blocks, float32 statistics in another order."""
GRAD_RTOL = 2e-2
"""max |Δ grad| / max |grad|: both round d logits to bf16, so a few bf16 ulps."""
REFERENCE_ATOL = 0.05
"""vs float64 logits: the bf16 rounding of each logit (|z| <~ 6, eps 2^-8) bounds the difference."""
REFERENCE_ROWS = 64
BENCH_TOKENS = (4096, 16384)
CHECKS: list[tuple[str, bool]] = []
Upstream = tuple[Tensor, Tensor]


def check(name: str, value: float, limit: float) -> None:
    ok = value <= limit
    CHECKS.append((name, ok))
    print(f"{'PASS' if ok else 'FAIL'} {name}: {value:.3e} (limit {limit:.1e})")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


def fused(impl: str, h: Tensor, w: Tensor, t: Tensor, g: Upstream) -> tuple[Tensor, ...]:
    """(logprob, entropy, d hidden, d W) of Σ g0·logprob + Σ g1·entropy."""
    h, w = h.detach().requires_grad_(), w.detach().requires_grad_()
    lp, ent = fused_linear_logprobs(
        h, w, t, temperature=TEMPERATURE, vocab_start=0, vocab_size=VOCAB, with_entropy=True, impl=impl
    )
    ((lp * g[0]).sum() + (ent * g[1]).sum()).backward()
    return lp.detach(), ent.detach(), h.grad, w.grad


def materialised(impl: str, logits: Tensor, t: Tensor, g: Upstream) -> tuple[Tensor, ...]:
    """(logprob, entropy, d logits) of Σ g0·logprob + Σ g1·entropy."""
    logits = logits.detach().requires_grad_()
    lp, ent = vocab_parallel_logprobs(
        logits, t, temperature=TEMPERATURE, vocab_start=0, vocab_size=VOCAB, with_entropy=True, impl=impl
    )
    ((lp * g[0]).sum() + (ent * g[1]).sum()).backward()
    return lp.detach(), ent.detach(), logits.grad


def timed(fn: Callable[[], object], repeats: int = 5) -> float:
    """Best of ``repeats`` calls after one untimed warm-up (Triton compiles on the first)."""
    fn()
    return best_time(fn, repeats, cuda=True)[0]


def benchmark_ratios(stdout: str) -> dict[str, float]:
    """``memory_ratio`` and ``time_ratio`` from the last line of benchmarks/logprob_loss.py's output."""
    lines = stdout.strip().splitlines()
    found = dict(re.findall(r"(memory_ratio|time_ratio)=(\d+(?:\.\d+)?)", lines[-1] if lines else ""))
    if set(found) != {"memory_ratio", "time_ratio"}:
        raise ValueError(f"no 'memory_ratio=... time_ratio=...' last line in the benchmark output: {lines[-1:]}")
    return {key: float(value) for key, value in found.items()}


def run_benchmark(tokens: int) -> dict[str, float] | None:
    """benchmarks/logprob_loss.py with the Triton path at ``tokens``; its ratios, or None if it failed."""
    bench = Path(__file__).resolve().parent / "logprob_loss.py"
    print(f"--- benchmarks/logprob_loss.py --impl triton --tokens {tokens}", flush=True)
    cmd = [sys.executable, str(bench), "--impl", "triton", "--tokens", str(tokens)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    print(done.stdout, end="")
    if done.returncode != 0:
        print(done.stderr[-4000:], end="")
        return None
    return benchmark_ratios(done.stdout)


def naive_step(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor, g: torch.Tensor) -> None:
    h, w = h.detach().requires_grad_(), w.detach().requires_grad_()
    logits = (h @ w.T)[:, :VOCAB].float() / TEMPERATURE
    lp = torch.log_softmax(logits, dim=-1).gather(1, t.unsqueeze(1)).squeeze(1)
    (lp * g).sum().backward()


def main() -> int:
    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check (the CPU tests cover the interpreter path)")
        return 0
    import triton

    print(f"device={torch.cuda.get_device_name()} torch={torch.__version__} triton={triton.__version__}")
    gen = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(TOKENS, HIDDEN, device="cuda", generator=gen).bfloat16()
    w = (0.02 * torch.randn(PADDED_VOCAB, HIDDEN, device="cuda", generator=gen)).bfloat16()
    t = torch.randint(0, VOCAB, (TOKENS,), device="cuda", generator=gen)
    g = (torch.randn(TOKENS, device="cuda", generator=gen), torch.randn(TOKENS, device="cuda", generator=gen))

    tri, ref = fused("triton", h, w, t, g), fused("torch", h, w, t, g)
    check("fused logprob triton vs torch (abs)", (tri[0] - ref[0]).abs().max().item(), VALUE_ATOL)
    check("fused entropy triton vs torch (abs)", (tri[1] - ref[1]).abs().max().item(), VALUE_ATOL)
    check("fused d hidden triton vs torch (rel)", rel_err(tri[2], ref[2]), GRAD_RTOL)
    check("fused d W triton vs torch (rel)", rel_err(tri[3], ref[3]), GRAD_RTOL)
    check("fused d W padding rows (abs)", tri[3][VOCAB:].float().abs().max().item(), 0.0)

    rows = slice(0, REFERENCE_ROWS)
    logits64 = h[rows].double() @ w.double().T
    lp64, ent64 = reference_logprobs(logits64, t[rows], temperature=TEMPERATURE, vocab_size=VOCAB)
    check(
        "fused logprob triton vs float64 (abs)",
        (tri[0][rows].double() - lp64).abs().max().item(),
        REFERENCE_ATOL,
    )
    check(
        "fused entropy triton vs float64 (abs)",
        (tri[1][rows].double() - ent64).abs().max().item(),
        REFERENCE_ATOL,
    )

    logits = h @ w.T
    mtri, mref = materialised("triton", logits, t, g), materialised("torch", logits, t, g)
    check("materialised logprob triton vs torch (abs)", (mtri[0] - mref[0]).abs().max().item(), VALUE_ATOL)
    check("materialised entropy triton vs torch (abs)", (mtri[1] - mref[1]).abs().max().item(), VALUE_ATOL)
    check("materialised d logits triton vs torch (rel)", rel_err(mtri[2], mref[2]), GRAD_RTOL)
    del logits, mtri, mref, tri, ref

    big = torch.randn(2 * TOKENS, HIDDEN, device="cuda", generator=gen).bfloat16()
    big_t = torch.randint(0, VOCAB, (2 * TOKENS,), device="cuda", generator=gen)
    big_g = (torch.randn(2 * TOKENS, device="cuda", generator=gen),) * 2
    times = {
        "fused_triton": timed(lambda: fused("triton", big, w, big_t, big_g)),
        "fused_torch": timed(lambda: fused("torch", big, w, big_t, big_g)),
        "naive": timed(lambda: naive_step(big, w, big_t, big_g[0])),
    }
    print(f"fwd+bwd at {2 * TOKENS} tokens (s): " + " ".join(f"{k}={v:.4f}" for k, v in times.items()))
    print(f"in-process time_ratio naive/fused_triton={times['naive'] / times['fused_triton']:.2f}")

    for recipe in FP8_RECIPES:
        try:
            check_fp8_available(recipe)
            print(f"fp8 recipe {recipe!r}: available")
        except ValueError as exc:
            print(f"fp8 recipe {recipe!r}: {exc}")

    ratios = {tokens: run_benchmark(tokens) for tokens in BENCH_TOKENS}
    for tokens, found in ratios.items():
        CHECKS.append((f"benchmark at {tokens} tokens ran", found is not None))
        if found is not None:
            print(
                f"triton_vs_naive tokens={tokens} memory_ratio={found['memory_ratio']:.2f} "
                f"time_ratio={found['time_ratio']:.2f}"
            )

    passed = sum(ok for _, ok in CHECKS)
    print(f"checks={passed}/{len(CHECKS)}")
    return 0 if passed == len(CHECKS) else 1


if __name__ == "__main__":
    sys.exit(main())
