"""The rollout benchmarks run: engine scaling end to end at a tiny size (identical D_k from 1 and 2
engines), and the GPU check's CLI on a machine without a GPU (its checks run when one is present)."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.mark.slow
@pytest.mark.multiprocess
def test_rollout_scaling_prints_identical_checksums() -> None:
    tiny = ["--shards", "4", "--shard-groups", "1", "--group-size", "2", "--max-new-tokens", "4"]
    cmd = [sys.executable, str(BENCHMARKS / "rollout_scaling.py"), *tiny, "--hidden", "32", "--layers", "1"]
    done = subprocess.run([*cmd, "--repeats", "1"], capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    last = done.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"engine_scaling=\d+\.\d+ identical=true", last), done.stdout


def test_gpu_rollout_check_cli_without_a_gpu() -> None:
    script = str(BENCHMARKS / "gpu_rollout_check.py")
    done = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "--mem-fraction" in done.stdout
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: test_gpu_rollout_check runs the checks")
    done = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "no CUDA device" in done.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="SGLang is not installed")
def test_gpu_rollout_check() -> None:
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "gpu_rollout_check.py")], capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert re.match(r"checks=(\d+)/\1 ", done.stdout.strip().splitlines()[-1]), done.stdout
