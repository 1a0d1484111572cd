"""Launch scripts: valid bash, and every argument reaches `mugrpo train` unchanged.

Fake `torchrun` / `srun` / `scontrol` / `nvidia-smi` executables first on PATH record what the
scripts would run, so no process group is started.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

LAUNCH = Path(__file__).resolve().parents[1] / "launch"
SCRIPTS = (LAUNCH / "torchrun.sh", LAUNCH / "slurm.sbatch")
USER_ARGS = ["--config", "configs/my run.yaml", "--run-dir", "runs/x", "algo.mu_grpo.clip_high=5", "model.hf_dir=/m"]
"""Includes a space, which only a correctly quoted "$@" keeps in one argument."""

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def _fake(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text(f"#!/usr/bin/env bash\n{body}\n")
    path.chmod(0o755)


@pytest.fixture
def fake_bin(tmp_path: Path) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _fake(bin_dir, "torchrun", 'printf "%s\\n" "$@"')  # one argument per line
    # srun: drop srun's own options, then run the command (what one task on one node would do).
    _fake(bin_dir, "srun", 'while [[ $# -gt 0 && $1 == -* ]]; do shift; done\nexec "$@"')
    _fake(bin_dir, "scontrol", 'printf "node-a\\nnode-b\\n"')
    return bin_dir


def _run(script: Path, fake_bin: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    # Only the fakes and the basic system tools: a real torchrun or nvidia-smi is never reached.
    full_env = {"PATH": f"{fake_bin}:/usr/bin:/bin", "HOME": os.environ.get("HOME", "/tmp"), **env}
    return subprocess.run(["bash", str(script), *USER_ARGS], env=full_env, capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_syntax_and_safety(script: Path) -> None:
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text()
    assert "set -euo pipefail" in text
    assert '"$@"' in text
    for forbidden in ("pkill", "killall"):
        assert forbidden not in text, f"{script.name} must not kill processes by name"


def test_torchrun_passes_arguments_through(fake_bin: Path) -> None:
    done = _run(LAUNCH / "torchrun.sh", fake_bin, {"NPROC_PER_NODE": "4", "MASTER_PORT": "31337"})
    assert done.returncode == 0, done.stderr
    args = done.stdout.splitlines()
    assert "--nproc-per-node=4" in args and "--master-port=31337" in args and "--nnodes=1" in args
    assert args[-len(USER_ARGS) - 3 :] == ["-m", "megatron_mugrpo.cli", "train", *USER_ARGS]


def test_torchrun_counts_gpus_by_default(fake_bin: Path) -> None:
    assert "--nproc-per-node=1" in _run(LAUNCH / "torchrun.sh", fake_bin, {}).stdout.splitlines()
    _fake(fake_bin, "nvidia-smi", 'printf "GPU 0: H100 (UUID: a)\\nGPU 1: H100 (UUID: b)\\n"')
    assert "--nproc-per-node=2" in _run(LAUNCH / "torchrun.sh", fake_bin, {}).stdout.splitlines()


def test_slurm_rendezvous_and_arguments(fake_bin: Path) -> None:
    text = (LAUNCH / "slurm.sbatch").read_text()
    assert "#SBATCH --nodes=" in text and "#SBATCH --ntasks-per-node=1" in text
    env = {"SLURM_JOB_NODELIST": "node-[a-b]", "SLURM_NNODES": "2", "SLURM_JOB_ID": "77"}
    env["SLURM_GPUS_ON_NODE"] = "8"
    done = _run(LAUNCH / "slurm.sbatch", fake_bin, env)
    assert done.returncode == 0, done.stderr
    args = done.stdout.splitlines()
    rendezvous = ["--rdzv-backend=c10d", "--rdzv-endpoint=node-a:29500", "--rdzv-id=77"]
    for expected in ("--nnodes=2", "--nproc-per-node=8", *rendezvous):
        assert expected in args
    assert args[-len(USER_ARGS) - 3 :] == ["-m", "megatron_mugrpo.cli", "train", *USER_ARGS]


def test_slurm_outside_a_job_says_so(fake_bin: Path) -> None:
    done = _run(LAUNCH / "slurm.sbatch", fake_bin, {})
    assert done.returncode != 0
    assert "run this script through sbatch" in done.stderr


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_other_verbs_run_on_every_rank(script: Path, fake_bin: Path) -> None:
    """`mugrpo generate` (D_k on every GPU) goes through the same launchers; a typo is refused."""
    env = {"SLURM_JOB_NODELIST": "node-a", "SLURM_NNODES": "1", "MUGRPO_VERB": "generate"}
    done = _run(script, fake_bin, env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-len(USER_ARGS) - 3 :] == ["-m", "megatron_mugrpo.cli", "generate", *USER_ARGS]
    refused = _run(script, fake_bin, env | {"MUGRPO_VERB": "generat"})
    assert refused.returncode == 2 and "expected train, generate" in refused.stderr


def test_slurm_requeues_a_preempted_run_and_passes_other_failures_on(fake_bin: Path, tmp_path: Path) -> None:
    """A run that stopped for a preemption leaves RUN_DIR/preempted.json: the script asks Slurm to requeue
    the job (the requeued job repeats the command, which resumes the run); any other failure keeps its
    exit status. torchrun runs with SIGUSR1 ignored (only the ranks handle Slurm's notice)."""
    text = (LAUNCH / "slurm.sbatch").read_text()
    assert "#SBATCH --signal=USR1@" in text and "#SBATCH --requeue" in text
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    calls = tmp_path / "scontrol.log"
    _fake(fake_bin, "scontrol", f'if [[ $1 == requeue ]]; then echo "$@" >> {calls}; else printf "node-a\\n"; fi')
    ignored = "$(( 16#$(awk '/^SigIgn/ {print $2}' /proc/$$/status) & (1 << 9) ))"  # bit 9: SIGUSR1 (10)
    marker = f'echo \'{{"signal": "SIGUSR1"}}\' > {run_dir}/preempted.json'
    _fake(fake_bin, "torchrun", f"[[ {ignored} -ne 0 ]] || exit 9\n{marker}\nexit 1")
    env = {"SLURM_JOB_NODELIST": "node-a", "SLURM_NNODES": "1", "SLURM_JOB_ID": "77"}
    args = ["--config", "c.yaml", "--run-dir", str(run_dir)]
    full_env = {"PATH": f"{fake_bin}:/usr/bin:/bin", "HOME": os.environ.get("HOME", "/tmp"), **env}
    done = subprocess.run(
        ["bash", str(LAUNCH / "slurm.sbatch"), *args], env=full_env, capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0, done.stderr
    assert calls.read_text().split() == ["requeue", "77"]
    assert "requeueing job 77" in done.stderr

    (run_dir / "preempted.json").unlink()
    _fake(fake_bin, "torchrun", "exit 3")  # a failure that is not a preemption
    done = subprocess.run(
        ["bash", str(LAUNCH / "slurm.sbatch"), *args], env=full_env, capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 3 and calls.read_text().split() == ["requeue", "77"]
