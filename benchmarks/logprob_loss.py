"""Fused vs naive log-prob + μ-GRPO loss, forward + backward, side by side: peak memory and time.

    python benchmarks/logprob_loss.py                    # CPU: 1024 tokens, float32
    python benchmarks/logprob_loss.py --tokens 4096      # GPU (picked when CUDA is visible): bfloat16

Shapes are Qwen2.5-7B's output layer: hidden 3584, vocabulary 151,936 (TP=1, the worst case).

* naive: logits = hidden @ W^T → float32 log_softmax(logits / T) → gather → μ-GRPO loss → backward.
* fused: ``megatron_mugrpo.kernels.fused_linear_logprobs`` (block-wise matmul + float32 statistics;
  the forward keeps the leading blocks' logits up to ``--keep-mib``, default
  ``kernels.logits_budget_mib``, and the backward recomputes the others) → the same loss → backward.

Where the time goes: naive costs three ``N × H × V`` matmuls (logits, d hidden, d W) plus a few
passes over [N, V] float32 buffers; fused costs the same three plus the recomputation of every
block it did not keep (a fourth matmul at ``--keep-mib 0``). On CPU both are matmul-bound, so the
time ratio follows roughly 3 / (4 - kept fraction); ``--profile`` prints each method's top
operators to check.

Each method runs in its own fresh process (``--worker``) and measures two peaks above the inputs
(hidden, weight, targets, behaviour log-probs):

* ``memory_ratio`` (the headline) compares the log-prob + loss working memory: a step with the
  output weight frozen, so only d hidden [N, H] is produced. This is the memory the fused kernel
  exists to remove; d W is excluded because it is one [V, H] buffer that *every* implementation
  must produce (Megatron even allocates it when accumulating into ``main_grad``), and at 1024
  tokens a float32 [151936, 3584] d W alone is larger than the naive logits.
* ``total_memory_ratio``: the full step (d hidden and d W), the same steps that are timed.

The frozen step runs first and doubles as the warm-up (Triton compilation, cuBLAS handles).
``time_ratio`` uses GPU wall time on CUDA, and on CPU the process's CPU time (user + system over
its threads), which other load on a shared machine does not inflate; CPU wall time is printed too.

The last line is ``memory_ratio=<naive peak / fused peak> time_ratio=<naive time / fused time>``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a clone without installing

from megatron_mugrpo.kernels import fused_linear_logprobs
from megatron_mugrpo.kernels.autograd import block_columns, kept_blocks
from megatron_mugrpo.kernels.config import DEFAULT_LOGITS_BUDGET_MIB
from megatron_mugrpo.kernels.policy import choose_logprob_path

RESPONSE_LEN = 256
"""Tokens per response: the loss averages per response, so the batch is tokens / 256 responses."""
TEMPERATURE = 1.0
MU_GRPO = {"clip_low": 0.0, "clip_high": 5.0, "veto_scope": "seq", "veto_threshold": 1e-4}
BEHAVIOUR_NOISE = 0.05
"""Stored behaviour log-probs = current ones + N(0, 0.05²): ratios near 1, as at a stage's start."""
MiB = 2**20


# ---------------------------------------------------------------------------------------------
# The loss: the project's registry when importable, else an equivalent μ-GRPO objective
# ---------------------------------------------------------------------------------------------


def _registry_loss() -> Callable[..., Any] | None:
    try:
        from megatron_mugrpo.algorithms.losses import policy_loss
    except ImportError:  # the GPU check machine has no omegaconf: use the inline objective below
        return None
    return policy_loss


def mu_grpo_loss(logprobs: torch.Tensor, behaviour: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
    """μ-GRPO on [B, T] log-probs with full response masks: clip [0, 5], NAV (seq), Eq. 2 aggregation."""
    policy_loss = _registry_loss()
    mask = torch.ones_like(logprobs)
    if policy_loss is not None:
        out = policy_loss(
            "mu_grpo", logprobs, behaviour, advantages, mask, aggregation="seq_mean_token_mean", **MU_GRPO
        )
        return out.loss_sum / out.normaliser
    ratio = torch.exp(logprobs - behaviour)
    adv = advantages.unsqueeze(1)
    objective = torch.minimum(ratio * adv, ratio.clamp(MU_GRPO["clip_low"], MU_GRPO["clip_high"]) * adv)
    vetoed = ((adv < 0) & (ratio < MU_GRPO["veto_threshold"])).any(dim=1, keepdim=True)
    keep = (~vetoed).float() * mask
    return -((objective * keep).sum(1) / mask.sum(1)).mean()


# ---------------------------------------------------------------------------------------------
# One method in one process
# ---------------------------------------------------------------------------------------------


def naive_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """[N] float32: materialised logits, float32 log_softmax, gather."""
    logits = hidden @ weight.T
    logp = torch.log_softmax(logits.float() / TEMPERATURE, dim=-1)
    return logp.gather(1, targets.unsqueeze(1)).squeeze(1)


def _inputs(args: argparse.Namespace, device: torch.device) -> dict[str, torch.Tensor]:
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator(device="cpu").manual_seed(0)
    hidden = torch.randn(args.tokens, args.hidden, generator=gen).to(device, dtype)
    weight = (0.02 * torch.randn(args.vocab, args.hidden, generator=gen)).to(device, dtype)
    targets = torch.randint(0, args.vocab, (args.tokens,), generator=gen).to(device)
    n_resp = args.tokens // RESPONSE_LEN
    advantages = torch.where(torch.rand(n_resp, generator=gen) < 0.5, -1.0, 1.0).to(device)
    with torch.no_grad():
        current = fused_linear_logprobs(
            hidden,
            weight,
            targets,
            temperature=TEMPERATURE,
            vocab_start=0,
            vocab_size=args.vocab,
            impl=args.impl,
        )
    noise = BEHAVIOUR_NOISE * torch.randn(args.tokens, generator=gen).to(device)
    behaviour = (current + noise).view(n_resp, RESPONSE_LEN)
    weight.requires_grad_()
    return {
        "hidden": hidden,
        "weight": weight,
        "targets": targets,
        "behaviour": behaviour,
        "advantages": advantages,
    }


def _step(method: str, x: dict[str, torch.Tensor], args: argparse.Namespace) -> tuple[float, float, float]:
    """One forward + backward; returns (loss, ||d hidden||, ||d W|| or 0 when W is frozen)."""
    hidden = x["hidden"].detach().requires_grad_()
    weight = x["weight"]
    weight.grad = None
    if method == "naive":
        logprobs = naive_logprobs(hidden, weight, x["targets"])
    else:
        logprobs = fused_linear_logprobs(
            hidden,
            weight,
            x["targets"],
            temperature=TEMPERATURE,
            vocab_start=0,
            vocab_size=args.vocab,
            impl=args.impl,
            keep_bytes=int(args.keep_mib * MiB),
        )
    loss = mu_grpo_loss(logprobs.view_as(x["behaviour"]), x["behaviour"], x["advantages"])
    loss.backward()
    weight_norm = weight.grad.float().norm().item() if weight.grad is not None else 0.0
    return loss.item(), hidden.grad.float().norm().item(), weight_norm


def _rss(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"{field}:\s+(\d+)", f.read()).group(1)) * 1024


class _PeakMeter:
    """Peak bytes above the level at ``start()``: CUDA allocator stats, or peak RSS on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def start(self) -> None:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")  # reset VmHWM to the current RSS
            except OSError as exc:
                raise SystemExit(f"CPU peak memory needs a writable /proc/self/clear_refs (Linux): {exc}") from exc
            self.base = _rss("VmRSS")

    def peak(self) -> int:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - self.base
        return _rss("VmHWM") - self.base


def worker(args: argparse.Namespace) -> None:
    """Run ``args.worker`` (naive | fused): a frozen-weight step, then timed full steps; print JSON."""
    device = torch.device(args.device)
    x = _inputs(args, device)
    meter = _PeakMeter(device)
    x["weight"].requires_grad_(False)  # log-prob + loss working memory: only d hidden is produced
    meter.start()
    _step(args.worker, x, args)
    working = meter.peak()
    x["weight"].requires_grad_(True)
    times, cpu_times, total = [], [], 0
    for _ in range(args.repeats):
        x["weight"].grad = None
        meter.start()
        begin, cpu_begin = time.perf_counter(), time.process_time()
        loss, hidden_norm, weight_norm = _step(args.worker, x, args)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - begin)
        cpu_times.append(time.process_time() - cpu_begin)
        total = max(total, meter.peak())
    result = {"working": working, "total": total, "time": min(times), "cpu_time": min(cpu_times), "loss": loss}
    if args.profile:
        _print_profile(args.worker, x, args)
    print(json.dumps(result | {"hidden_grad_norm": hidden_norm, "weight_grad_norm": weight_norm}))


def _print_profile(method: str, x: dict[str, torch.Tensor], args: argparse.Namespace) -> None:
    """One more full step under torch.profiler; its top operators by self time go to stderr."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device.startswith("cuda") else [])
    x["weight"].grad = None
    with profile(activities=activities) as prof:
        _step(method, x, args)
    key = "self_cuda_time_total" if args.device.startswith("cuda") else "self_cpu_time_total"
    print(f"--- {method}: top operators of one full step", file=sys.stderr)
    print(prof.key_averages().table(sort_by=key, row_limit=12), file=sys.stderr)


# ---------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------


def _run_worker(method: str, args: argparse.Namespace) -> dict[str, float]:
    cmd = [sys.executable, __file__, "--worker", method]
    for key in ("tokens", "hidden", "vocab", "dtype", "repeats", "device", "impl", "threads", "keep_mib"):
        cmd += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    cmd += ["--profile"] if args.profile else []
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{method} worker failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    if args.profile:
        print(done.stderr, end="")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _parse() -> argparse.Namespace:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=4096 if cuda else 1024)
    p.add_argument("--hidden", type=int, default=3584)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--dtype", default="bfloat16" if cuda else "float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--repeats", type=int, default=3 if cuda else 1, help="timed full steps")
    p.add_argument("--device", default="cuda" if cuda else "cpu")
    p.add_argument("--impl", default="auto", choices=["auto", "triton", "torch"], help="fused implementation")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument(
        "--keep-mib",
        type=float,
        default=DEFAULT_LOGITS_BUDGET_MIB,
        help="block logits (MiB) the fused forward keeps for backward (kernels.logits_budget_mib)",
    )
    p.add_argument("--profile", action="store_true", help="print each method's top operators of one more step")
    p.add_argument("--worker", choices=["naive", "fused"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.tokens % RESPONSE_LEN:
        p.error(f"--tokens must be a multiple of {RESPONSE_LEN} (tokens per response)")
    return args


def _keep_summary(args: argparse.Namespace) -> str:
    """What the fused path keeps at this shape, and which path kernels.logprob_impl=auto would take."""
    width = block_columns(args.tokens, args.vocab, None)
    blocks = [(v0, min(v0 + width, args.vocab)) for v0 in range(0, args.vocab, width)]
    itemsize = getattr(torch, args.dtype).itemsize
    kept = sum(v1 - v0 for v0, v1 in blocks[: kept_blocks(args.tokens, blocks, itemsize, int(args.keep_mib * MiB))])
    device = torch.device(args.device)
    auto = choose_logprob_path(
        "auto", n_tokens=args.tokens, n_columns=args.vocab, device=device, budget_bytes=int(args.keep_mib * MiB)
    )
    return (
        f"fused keeps {kept}/{args.vocab} columns ({kept / args.vocab:.0%}) in {len(blocks)} blocks of {width}; "
        f"float32 logits are {args.tokens * args.vocab * 4 / MiB:.1f} MiB; kernels.logprob_impl=auto would run {auto}"
    )


def main() -> None:
    args = _parse()
    torch.set_num_threads(args.threads)
    if args.worker:
        worker(args)
        return
    print(
        f"device={args.device} dtype={args.dtype} tokens={args.tokens} hidden={args.hidden} "
        f"vocab={args.vocab} fused_impl={args.impl} threads={args.threads} keep_mib={args.keep_mib:g}"
    )
    print(_keep_summary(args))
    results = {method: _run_worker(method, args) for method in ("naive", "fused")}
    print(f"{'method':<8}{'working MiB':>13}{'full step MiB':>15}{'wall s':>9}{'cpu s':>9}{'loss':>12}")
    for method, r in results.items():
        print(
            f"{method:<8}{r['working'] / MiB:>13.1f}{r['total'] / MiB:>15.1f}"
            f"{r['time']:>9.3f}{r['cpu_time']:>9.3f}{r['loss']:>12.6f}"
        )
    naive, fused = results["naive"], results["fused"]
    keys = ("loss", "hidden_grad_norm", "weight_grad_norm")
    diffs = " ".join(f"{k}={abs(naive[k] - fused[k]) / max(abs(naive[k]), 1e-12):.2e}" for k in keys)
    print(f"relative difference fused vs naive: {diffs}")
    print(f"total_memory_ratio={naive['total'] / fused['total']:.2f} (full step, including d W)")
    memory_ratio = naive["working"] / max(fused["working"], 1)
    time_key = "time" if args.device.startswith("cuda") else "cpu_time"
    print(f"wall_time_ratio={naive['time'] / fused['time']:.2f}")
    print(f"memory_ratio={memory_ratio:.2f} time_ratio={naive[time_key] / fused[time_key]:.2f}")


if __name__ == "__main__":
    main()
