"""End to end, staged mode: a preempted run (SIGTERM / SIGUSR1, as Slurm sends before it kills a job)
stops at the next safe point, exits 75 with a marker, and the same command resumes it to the
uninterrupted run's weights bit for bit, losing no update."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from e2e_runs import DEMO, ROOT, SMALL, final_weights, records

from megatron_mugrpo.commands import mugrpo_argv
from megatron_mugrpo.loop.preemption import EXIT_PREEMPTED, MARKER


def train_signalled(run_dir: Path, base: Path, signal_at: str | None) -> subprocess.CompletedProcess:
    """The same `mugrpo train --config --run-dir` command each time, as a requeued Slurm job repeats it."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env.pop("MUGRPO_CRASH_AT", None)
    env.pop("MUGRPO_SIGNAL_AT", None)
    if signal_at:
        env["MUGRPO_SIGNAL_AT"] = signal_at
    args = ["train", "--config", str(DEMO), "--run-dir", str(run_dir), f"model.hf_dir={base}", *SMALL]
    return subprocess.run(mugrpo_argv(*args), cwd=ROOT, env=env, capture_output=True, text=True)


@pytest.mark.slow
def test_preempted_in_a_rollout_and_mid_update_then_requeued_equals_uninterrupted(
    tmp_path: Path, base_model: Path, uninterrupted: tuple[Path, subprocess.CompletedProcess]
):
    run_dir = tmp_path / "preempted"
    # SIGTERM after stage 0's first shard: generation stops there; the shard is kept.
    proc = train_signalled(run_dir, base_model, "shard:0:0=SIGTERM")
    assert proc.returncode == EXIT_PREEMPTED, proc.stderr[-3000:]
    assert "preempted by SIGTERM" in proc.stderr and "Traceback" not in proc.stderr
    assert json.loads((run_dir / MARKER).read_text())["signal"] == "SIGTERM"
    stage_0 = run_dir / "rollouts" / "stage_000"
    assert (stage_0 / "shard_00000.arrow").is_file() and not (stage_0 / "shard_00001.arrow").exists()

    # The same command resumes; SIGUSR1 while update 5 runs: it finishes, is checkpointed, nothing is lost.
    proc = train_signalled(run_dir, base_model, "update_start:5=SIGUSR1")
    assert proc.returncode == EXIT_PREEMPTED, proc.stderr[-3000:]
    assert "preempted by SIGUSR1" in proc.stderr and "checkpoint at update 5" in proc.stderr
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_00000005"
    assert [r["step"] for r in records(run_dir) if "train/loss" in r] == [1, 2, 3, 4, 5]

    proc = train_signalled(run_dir, base_model, None)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not (run_dir / MARKER).exists()
    assert [r["step"] for r in records(run_dir) if "train/loss" in r] == list(range(1, 9))
    expected, got = final_weights(uninterrupted[0]), final_weights(run_dir)
    assert expected.keys() == got.keys()
    for name in expected:
        assert torch.equal(expected[name], got[name]), f"{name} differs after two preemptions"


def test_a_preempted_run_refuses_a_different_config(tmp_path: Path, base_model: Path):
    run_dir = tmp_path / "preempted"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("")  # never read: the refusal comes first
    (run_dir / MARKER).write_text('{"signal": "SIGTERM", "global_update": 3}\n')
    history = {"config": {"optim": {"lr": 0.5}}}
    (run_dir / "config_history.json").write_text(json.dumps(history))
    proc = train_signalled(run_dir, base_model, None)
    assert proc.returncode == 2, proc.stderr[-2000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("error:") and "was preempted" in line and "optim.lr" in line and "--resume" in line
