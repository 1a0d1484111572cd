"""End to end through a real Slurm: `sbatch launch/slurm.sbatch` on a single-host cluster (munge,
slurmctld, one slurmd; ``slurm_cluster.py``), as a cluster user submits a job.

A staged run on two ranks is preempted (``scancel --signal=USR1``, what ``--signal=USR1@180`` sends
before a time limit) after its second update: the ranks checkpoint, the script requeues the job, and
the requeued job, repeating its command, resumes the run to the end. An async run (a trainer and a
rollout worker) finishes. Debian's packages are installed here when missing (CI runs as root).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest
from e2e_runs import ROOT, SMALL, records
from slurm_cluster import LocalSlurm, ensure_installed

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.cluster, pytest.mark.timeout(1800)]
JOB_TIMEOUT_S = 900


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    why = ensure_installed()
    if why is not None:
        pytest.skip(why)
    with LocalSlurm(tmp_path_factory.mktemp("slurm")) as running:
        yield running


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def submit(cluster: LocalSlurm, run_dir: Path, config: str, *overrides: str) -> int:
    """`sbatch launch/slurm.sbatch` on one node with two ranks (the script's GPU defaults overridden)."""
    env = {
        "GPUS_PER_NODE": "2",
        "MASTER_ADDR": "127.0.0.1",  # the test node's name resolves nowhere
        "MASTER_PORT": str(_free_port()),
        "OMP_NUM_THREADS": "1",
        "PYTHONWARNINGS": "ignore",
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",  # this venv's torchrun
    }
    options = ["--nodes=1", "--gpus-per-node=0", f"--cpus-per-task={cluster.cpus}", "--time=30"]
    options += [f"--output={run_dir.parent / (run_dir.name + '-%j.out')}", "--job-name=mugrpo-test"]
    args = ["--config", str(ROOT / "configs" / config), "--run-dir", str(run_dir), *overrides]
    return cluster.sbatch([*options, str(ROOT / "launch" / "slurm.sbatch"), *args], env=env, cwd=ROOT)


def job_output(run_dir: Path) -> str:
    return "\n".join(p.read_text(errors="replace") for p in run_dir.parent.glob(f"{run_dir.name}-*.out"))


def updates_logged(run_dir: Path) -> int:
    try:
        return sum("train/loss" in r for r in records(run_dir))
    except (OSError, ValueError):
        return 0


def test_a_staged_run_is_preempted_requeued_and_finishes(cluster: LocalSlurm, base_model: Path, tmp_path: Path):
    run_dir = tmp_path / "staged"
    job = submit(cluster, run_dir, "demo_cpu.yaml", f"model.hf_dir={base_model}", *SMALL, "eval.benchmarks=[]")
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while updates_logged(run_dir) < 2:
        state, _ = cluster.state(job)
        assert state in {"PENDING", "RUNNING", "CONFIGURING"}, f"{state}\n{job_output(run_dir)[-4000:]}"
        assert time.monotonic() < deadline, job_output(run_dir)[-4000:]
        time.sleep(0.5)
    cluster.run("scancel", "--signal=USR1", str(job))  # every process of the job's steps, as --signal does

    state = cluster.wait(job, timeout_s=JOB_TIMEOUT_S)
    output = job_output(run_dir)
    assert state == "COMPLETED", f"{state}\n{output[-6000:]}\n{cluster.logs()}"
    assert cluster.state(job)[1] == 1, "the job was not requeued once"
    assert "preempted by SIGUSR1" in output and f"requeueing job {job}" in output, output[-4000:]
    assert not (run_dir / "preempted.json").exists()
    steps = [r["step"] for r in records(run_dir) if "train/loss" in r]
    assert steps == list(range(1, 9)), "each update is logged exactly once across the preemption"
    assert (run_dir / "hf_final" / "model.safetensors").is_file()


def test_an_async_run_finishes_under_sbatch(cluster: LocalSlurm, base_model: Path, tmp_path: Path):
    run_dir = tmp_path / "async"
    small = [o for o in SMALL if not o.startswith(("rollout.shard_groups", "logging.tensorboard"))]
    extra = ["async.batch_groups=4", "async.queue_groups=8", "eval.benchmarks=[]"]
    job = submit(cluster, run_dir, "demo_async_cpu.yaml", f"model.hf_dir={base_model}", *small, *extra)
    state = cluster.wait(job, timeout_s=JOB_TIMEOUT_S)
    output = job_output(run_dir)
    assert state == "COMPLETED", f"{state}\n{output[-6000:]}"
    steps = [r["step"] for r in records(run_dir) if "train/loss" in r]
    assert steps == list(range(1, 9))
    assert list((run_dir / "rollouts" / "queue").glob("w000_b*.json")), "the rollout worker wrote nothing"
