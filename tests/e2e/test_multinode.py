"""End to end, two "nodes": two torchrun agents on loopback (``--nnodes 2``, c10d rendezvous), each with
one rank, its own CPU and the same run directory, as two hosts of a cluster share one filesystem.

A staged run with its tensor-parallel group spanning both nodes finishes; one node is then killed
mid-run (its agent and its rank, as when a host dies): the other stops at once with an ``error:`` that
names the lost rank, and a restart of both agents resumes the run to the uninterrupted run's weights
bit for bit. An async run whose rollout worker is the other node's rank finishes.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from e2e_runs import DEMO, ROOT, SMALL, final_weights, records

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.cluster, pytest.mark.timeout(1800)]
TIMEOUT_S = 900
STAGED = ["parallel.tensor_parallel=2", "stages.num_stages=1", *SMALL[1:], "eval.benchmarks=[]"]


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_nodes(*train_args: str) -> list[subprocess.Popen]:
    """Two torchrun agents, one rank each, rendezvous on loopback; each pinned to one CPU when it can be."""
    port = _free_port()
    agents = []
    for node in range(2):
        pin = ["taskset", "-c", str(node % (psutil.cpu_count() or 1))] if shutil.which("taskset") else []
        cmd = [*pin, sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1"]
        cmd += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"mn{port}"]
        cmd += ["-m", "megatron_mugrpo.cli", "train", *train_args]
        env = {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
        agents.append(
            subprocess.Popen(cmd, cwd=ROOT, env=_env(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    return agents


def _env(extra: dict[str, str]) -> dict[str, str]:
    import os

    env = dict(os.environ, **extra)
    env.pop("MUGRPO_CRASH_AT", None)
    return env


def finish(agents: list[subprocess.Popen]) -> list[tuple[int, str]]:
    """(exit code, stderr) of each agent once it ends."""
    stderrs = [a.communicate(timeout=TIMEOUT_S)[1] for a in agents]
    return [(a.returncode, stderr) for a, stderr in zip(agents, stderrs, strict=True)]


def kill_node(agent: subprocess.Popen) -> None:
    """SIGKILL an agent and every process under it, as when its host dies."""
    tree = psutil.Process(agent.pid)
    for proc in [*tree.children(recursive=True), tree]:
        proc.kill()


def updates(run_dir: Path) -> list[int]:
    try:
        return [r["step"] for r in records(run_dir) if "train/loss" in r]
    except (OSError, ValueError):
        return []


def test_tensor_parallelism_across_two_nodes_survives_a_lost_node(tmp_path: Path, base_model: Path):
    full = tmp_path / "full"
    args = ["--config", str(DEMO), "--run-dir", str(full), f"model.hf_dir={base_model}", *STAGED]
    for code, stderr in finish(start_nodes(*args)):
        assert code == 0, stderr[-4000:]
    steps = [r for r in records(full) if "train/loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert steps[0]["train/rollout_logprob_abs_diff_max"] < 1e-4  # TP across nodes: π_θ = β at update 1

    killed = tmp_path / "killed"
    args = ["--config", str(DEMO), "--run-dir", str(killed), f"model.hf_dir={base_model}", *STAGED]
    agents = start_nodes(*args)
    deadline = time.monotonic() + TIMEOUT_S
    while len(updates(killed)) < 1:
        assert time.monotonic() < deadline and all(a.poll() is None for a in agents), "the run ended early"
        time.sleep(0.2)
    kill_node(agents[1])
    survivor = agents[0].communicate(timeout=300)[1]  # no hang: it stops by itself
    agents[1].communicate()
    assert agents[0].returncode != 0
    errors = [line for line in survivor.splitlines() if "error: lost rank" in line]
    assert errors, survivor[-4000:]
    assert "collective failed while" in errors[0] and "--resume" in errors[0]

    for code, stderr in finish(start_nodes("--resume", str(killed))):
        assert code == 0, stderr[-4000:]
    assert updates(killed) == [1, 2, 3, 4]
    expected, got = final_weights(full), final_weights(killed)
    for name in expected:
        assert torch.equal(expected[name], got[name]), f"{name} differs after a lost node and a restart"


def test_an_async_run_with_its_worker_on_the_other_node(tmp_path: Path, base_model: Path):
    run_dir = tmp_path / "async"
    small = [o for o in SMALL if not o.startswith(("rollout.shard_groups", "logging.tensorboard"))]
    args = ["--config", str(ROOT / "configs" / "demo_async_cpu.yaml"), "--run-dir", str(run_dir)]
    args += [f"model.hf_dir={base_model}", *small, "async.batch_groups=4", "async.queue_groups=8", "eval.benchmarks=[]"]
    for code, stderr in finish(start_nodes(*args)):
        assert code == 0, stderr[-4000:]
    assert updates(run_dir) == list(range(1, 9))
    assert list((run_dir / "rollouts" / "queue").glob("w000_b*.json")), "the rollout worker wrote nothing"
