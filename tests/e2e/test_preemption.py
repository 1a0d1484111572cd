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
from e2e_runs import DEMO, ROOT, SMALL, final_weights, records, torchrun

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


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_host_signalled_alone_in_a_rollout_stops_every_rank_at_one_safe_point(tmp_path: Path, base_model: Path):
    """Two ranks host two engines; only the one that writes stage 0's shard 1 is signalled (the other
    may be waiting where generation ends by then, as in a Slurm job whose notice reaches the ranks at
    different moments). The signalled host claims no further shard, the other finishes the store, and
    both stop together after the first update: exit 75, no rank stranded in a collective until the
    grace timer. The same command then finishes the run."""
    run_dir = tmp_path / "two_hosts"
    args = ["train", "--config", str(DEMO), "--run-dir", str(run_dir), f"model.hf_dir={base_model}", *SMALL]
    args += ["rollout.shard_groups=4", "checkpoint.preempt_grace_s=60"]  # 4 shards; a stranded rank ends in 60 s
    proc = torchrun(*args, signal_at="shard:0:1=SIGUSR1")
    assert "exitcode  : 75" in proc.stderr, proc.stderr[-6000:]  # torchrun may then SIGTERM the other, at its exit
    assert proc.stderr.count("stopped at a safe point (checkpoint at update 1)") == 2, proc.stderr[-6000:]  # each rank
    assert "no checkpoint within" not in proc.stderr and "lost rank" not in proc.stderr, proc.stderr[-6000:]
    assert json.loads((run_dir / MARKER).read_text())["global_update"] == 1
    assert json.loads((run_dir / "rollouts" / "stage_000" / "manifest.json").read_text())["complete"]
    assert [r["step"] for r in records(run_dir) if "train/loss" in r] == [1]

    proc = torchrun(*args)
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert not (run_dir / MARKER).exists()
    assert [r["step"] for r in records(run_dir) if "train/loss" in r] == list(range(1, 9))
