"""Helpers of the end-to-end tests: the `mugrpo` CLI in a subprocess, a small run's overrides, records.

Runs go through the CLI in subprocesses, as a user would, so tests can SIGKILL them at named points
($MUGRPO_CRASH_AT) and continue with `--resume`. The shared fixtures (a warm-started base model, one
finished run) are in conftest.py.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from dist_utils import free_port
from safetensors.torch import load_file

from megatron_mugrpo.commands import mugrpo_argv

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "configs" / "demo_cpu.yaml"
EASY_TASK = "arithmetic_easy"
"""The one-digit built-in task: a short warm start already solves some of it (``easy_base_model``)."""
SMALL = [
    "stages.num_stages=2",
    "stages.train_groups=16",
    "stages.mini_groups=4",
    "parallel.micro_batch_size=16",
    "rollout.shard_groups=8",
    "rollout.max_new_tokens=40",
    "eval.benchmarks.0.limit=16",
    "eval.benchmarks.0.k=2",
    "checkpoint.every_updates=2",
    "logging.progress_bars=false",
    "logging.tensorboard=true",
    "logging.report=false",  # the plots: the uninterrupted run and tests/test_report.py
    "optim.lr=1e-3",
    "rollout.cpu_threads=1",  # equal threads per engine whatever the engine count: comparable bits
]


def mugrpo(*args: str, crash_at: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env.pop("MUGRPO_CRASH_AT", None)
    if crash_at:
        env["MUGRPO_CRASH_AT"] = crash_at
    proc = subprocess.run(mugrpo_argv(*args), cwd=ROOT, env=env, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"mugrpo {' '.join(args)} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )
    return proc


def torchrun(
    *args: str, nproc: int = 2, crash_at: str | None = None, signal_at: str | None = None
) -> subprocess.CompletedProcess:
    """`mugrpo ARGS` on ``nproc`` ranks through torch.distributed.run (what launch/torchrun.sh does);
    ``crash_at`` / ``signal_at``: $MUGRPO_CRASH_AT / $MUGRPO_SIGNAL_AT, which every rank reads."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc)]
    cmd += ["--master_port", str(free_port()), "-m", "megatron_mugrpo.cli", *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    for name, value in (("MUGRPO_CRASH_AT", crash_at), ("MUGRPO_SIGNAL_AT", signal_at)):
        env.pop(name, None)
        if value:
            env[name] = value
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)


def train(
    run_dir: Path, base: Path, *extra: str, crash_at: str | None = None, check: bool | None = None
) -> subprocess.CompletedProcess:
    """A small run on the warm-started ``base`` model; checked for success unless it is crashed on purpose."""
    return mugrpo(
        "train",
        "--config",
        str(DEMO),
        "--run-dir",
        str(run_dir),
        f"model.hf_dir={base}",
        *SMALL,
        *extra,
        crash_at=crash_at,
        check=crash_at is None if check is None else check,
    )


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "hf_final" / "model.safetensors"))


@contextmanager
def built_once(tmp_path_factory: pytest.TempPathFactory, name: str) -> Iterator[Path]:
    """``name``'s directory, shared by every pytest-xdist worker of this session, held under an
    exclusive lock: build into it unless a finished build is there. Without xdist: this session's own."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # xdist gives each worker its own basetemp under one common parent
    path = root / name
    path.mkdir(parents=True, exist_ok=True)
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if the build fails
        yield path
