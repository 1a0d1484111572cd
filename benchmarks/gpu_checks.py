"""Every GPU check of the project in one call, for a lent GPU machine (under 10 minutes on one H100/H200).

    python benchmarks/gpu_checks.py                   # one summary line per check, then a total
    python benchmarks/gpu_checks.py --only kernels megatron

Runs each check below as its own process (a crash or a hang stays inside it; each has a time
limit) and prints one line per check::

    check=<name> status=<passed|failed|skipped|timeout> seconds=<s> detail=<the check's last line>

then ``gpu_checks passed=<n> failed=<n> skipped=<n>``; it exits non-zero if a check failed or
timed out. A check whose library is absent (SGLang, megatron-core, ModelOpt, Transformer Engine: a
GPU machine may have only torch, triton and transformers) says so and counts as skipped. The checks:

* ``kernels``  (torch, triton): the Triton log-prob kernels against the torch path, their benchmark,
  and which FP8 recipes Transformer Engine can run here (``gpu_kernels_check.py``);
* ``megatron`` (megatron-core): the Megatron policy on NCCL, log-probs against Hugging Face, one
  update, the export round trip (``gpu_megatron_check.py``);
* ``sglang_rollout`` (SGLang, megatron-core): a colocated SGLang engine next to the Megatron policy,
  weight sync in buckets inside SGLang's weight-update session, log-probs against the trainer,
  memory release and resume (``gpu_rollout_check.py``);
* ``sglang_fp8`` (SGLang, ModelOpt): the FP8 behaviour policy over two stages, a new engine for each,
  against the fake-quant model (``gpu_fp8_check.py``);
* ``moe`` (megatron-core; Transformer Engine and SGLang for two of its parts): a tiny Qwen3-MoE's
  grouped-GEMM experts against the sequential ones (logits, gradients), routing replay on the GPU,
  and SGLang's recorded routes against transformers' top-k (``gpu_moe_check.py``; a part whose
  library is absent prints ``SKIP`` and the others run).

Which of these have ever run on a GPU is recorded in the README ("GPU checks").
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
SKIP_MARKERS = ("nothing to check", "is not installed")


@dataclass(frozen=True)
class Check:
    name: str
    argv: tuple[str, ...]
    timeout_s: int


CHECKS = (
    Check("kernels", ("gpu_kernels_check.py",), 240),
    Check("megatron", ("gpu_megatron_check.py",), 120),
    Check("sglang_rollout", ("gpu_rollout_check.py",), 150),
    Check("sglang_fp8", ("gpu_fp8_check.py",), 150),
    Check("moe", ("gpu_moe_check.py",), 240),
)


def run_check(check: Check) -> tuple[str, float, str]:
    """(status, seconds, detail) of one check run in its own process."""
    started = time.perf_counter()
    try:
        done = subprocess.run(
            [sys.executable, str(HERE / check.argv[0]), *check.argv[1:]],
            capture_output=True,
            text=True,
            timeout=check.timeout_s,
            cwd=HERE.parent,
        )
    except subprocess.TimeoutExpired as exc:
        tail = (exc.stdout or b"")[-300:]
        detail = tail.decode(errors="replace") if isinstance(tail, bytes) else tail
        return "timeout", time.perf_counter() - started, _last_line(detail) or f"over {check.timeout_s} s"
    seconds = time.perf_counter() - started
    output = done.stdout + done.stderr
    print(output, file=sys.stderr)  # the full report, apart from the summary on stdout
    last = _last_line(done.stdout) or _last_line(done.stderr)
    if done.returncode != 0:
        return "failed", seconds, last
    if any(marker in done.stdout for marker in SKIP_MARKERS):
        return "skipped", seconds, last
    return "passed", seconds, last


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:200] if lines else ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="+", choices=[c.name for c in CHECKS], help="run these checks only")
    args = parser.parse_args()
    counts = {"passed": 0, "failed": 0, "skipped": 0, "timeout": 0}
    for check in CHECKS:
        if args.only and check.name not in args.only:
            continue
        status, seconds, detail = run_check(check)
        counts[status] += 1
        print(f"check={check.name} status={status} seconds={seconds:.0f} detail={detail}", flush=True)
    print(
        f"gpu_checks passed={counts['passed']} failed={counts['failed'] + counts['timeout']} "
        f"skipped={counts['skipped']}"
    )
    return 1 if counts["failed"] or counts["timeout"] else 0


if __name__ == "__main__":
    sys.exit(main())
