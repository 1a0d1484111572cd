"""benchmarks/logprob_loss.py runs end to end at a tiny shape and ends with its headline line."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "logprob_loss.py"


def test_benchmark_prints_ratios() -> None:
    cmd = [sys.executable, str(BENCH), "--tokens", "256", "--hidden", "32", "--vocab", "2048", "--threads", "1"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.strip().splitlines()
    assert re.fullmatch(r"memory_ratio=\d+\.\d+ time_ratio=\d+\.\d+", lines[-1]), lines[-1]
    diffs = re.search(r"loss=(\S+) hidden_grad_norm=(\S+) weight_grad_norm=(\S+)", done.stdout)
    assert diffs is not None and all(float(x) < 1e-5 for x in diffs.groups()), done.stdout


GPU_CHECK = BENCH.parent / "gpu_kernels_check.py"


def test_gpu_check_runs_its_cpu_safe_parts_without_cuda() -> None:
    done = subprocess.run([sys.executable, str(GPU_CHECK), "--help"], capture_output=True, text=True, check=False)
    assert done.returncode == 0 and "Triton" in done.stdout, done.stderr[-2000:]


def test_gpu_check_reads_the_benchmark_ratios() -> None:
    spec = importlib.util.spec_from_file_location("gpu_kernels_check", GPU_CHECK)
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    out = "device=cuda ...\nwall_time_ratio=1.10\nmemory_ratio=31.25 time_ratio=1.07\n"
    assert check.benchmark_ratios(out) == {"memory_ratio": 31.25, "time_ratio": 1.07}
    with pytest.raises(ValueError, match="memory_ratio"):
        check.benchmark_ratios("worker failed\n")
