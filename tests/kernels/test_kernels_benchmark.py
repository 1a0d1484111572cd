"""benchmarks/logprob_loss.py runs end to end at a tiny shape and ends with its headline line."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "logprob_loss.py"


def test_benchmark_prints_ratios() -> None:
    cmd = [sys.executable, str(BENCH), "--tokens", "256", "--hidden", "32", "--vocab", "2048", "--threads", "1"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.strip().splitlines()
    assert re.fullmatch(r"memory_ratio=\d+\.\d+ time_ratio=\d+\.\d+", lines[-1]), lines[-1]
    diffs = re.search(r"loss=(\S+) hidden_grad_norm=(\S+) weight_grad_norm=(\S+)", done.stdout)
    assert diffs is not None and all(float(x) < 1e-5 for x in diffs.groups()), done.stdout
