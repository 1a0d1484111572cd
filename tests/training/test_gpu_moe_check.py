"""benchmarks/gpu_moe_check.py without a GPU: it says it needs CUDA, its CPU part (routing replay on
gloo) passes, its grouped-GEMM name map is right; benchmarks/gpu_checks.py runs every gpu_*_check.py."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
SCRIPT = BENCHMARKS / "gpu_moe_check.py"


def _module(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_grouped_gemm_weights_map_to_sequential_expert_names() -> None:
    sequential_name = _module("gpu_moe_check").sequential_name
    grouped = "decoder.layers.1.mlp.experts.linear_fc2.weight7"
    assert sequential_name(grouped) == "decoder.layers.1.mlp.experts.local_experts.7.linear_fc2.weight"
    shared = "decoder.layers.1.mlp.router.weight"
    assert sequential_name(shared) == shared


def test_gpu_checks_runs_every_gpu_check_script() -> None:
    checks = _module("gpu_checks").CHECKS
    scripts = {check.argv[0] for check in checks}
    assert len({check.name for check in checks}) == len(checks)
    assert scripts == {path.name for path in BENCHMARKS.glob("gpu_*_check.py")}


def test_gpu_moe_check_without_a_gpu_says_so() -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "--router-std" in done.stdout
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the check itself runs there")
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "no CUDA device: nothing to check" in done.stdout, done.stdout + done.stderr


@pytest.mark.slow
def test_gpu_moe_check_cpu_part_replays_the_trainers_own_routes() -> None:
    small = ["--cpu", "--hidden", "64", "--prompts", "4"]
    done = subprocess.run([sys.executable, str(SCRIPT), *small], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    last = done.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"checks=3/3 skipped=a,c grouped_rel=na replay_agreement=1 sglang_route_agreement=na", last)
