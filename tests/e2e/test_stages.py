"""End to end: the staged loop through the real engine, converter and Megatron backend (CPU).

A small base model is warm-started once per session (``base_model`` in conftest.py); runs point
`model.hf_dir` at it so each test pays only for its stages. Runs go through the `mugrpo` CLI in
subprocesses, as a user would, so the resume tests can SIGKILL them at named points
($MUGRPO_CRASH_AT) and continue with `--resume`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "configs" / "demo_cpu.yaml"
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
    "optim.lr=1e-3",
]


def mugrpo(*args: str, crash_at: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env.pop("MUGRPO_CRASH_AT", None)
    if crash_at:
        env["MUGRPO_CRASH_AT"] = crash_at
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_mugrpo.cli", *args], cwd=ROOT, env=env, capture_output=True, text=True
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"mugrpo {' '.join(args)} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )
    return proc


def train(run_dir: Path, base: Path, *extra: str, crash_at: str | None = None) -> subprocess.CompletedProcess:
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
        check=crash_at is None,
    )


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "hf_final" / "model.safetensors"))


@pytest.fixture(scope="session")
def uninterrupted(
    tmp_path_factory: pytest.TempPathFactory, base_model: Path
) -> tuple[Path, subprocess.CompletedProcess]:
    run_dir = tmp_path_factory.mktemp("runs") / "full"
    return run_dir, train(run_dir, base_model)


@pytest.mark.slow
def test_end_to_end_run_writes_everything(uninterrupted: tuple[Path, subprocess.CompletedProcess], base_model: Path):
    run_dir, proc = uninterrupted
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("acc_before=") and " acc_after=" in last and " t_total_s=" in last
    for stage in (0, 1):
        manifest = json.loads((run_dir / "rollouts" / f"stage_{stage:03d}" / "manifest.json").read_text())
        assert manifest["complete"] is True and manifest["num_groups"] == 16
    ckpts = run_dir / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step_00000008"
    best = json.loads((run_dir / "best.json").read_text())
    kept = {p.name for p in ckpts.iterdir() if p.name.startswith("step_")}
    # keep_last = 2 newest, plus the best evaluated step, which is never pruned
    assert (
        {"step_00000006", "step_00000008"}
        <= kept
        <= {"step_00000006", "step_00000008", f"step_{best['global_update']:08d}"}
    )
    assert best["checkpoint"] is not None and Path(best["checkpoint"]).is_dir()
    assert (run_dir / "config.yaml").is_file() and any((run_dir / "tensorboard").iterdir())
    assert {p.name for p in (run_dir / "report").glob("*.png")} >= {"eval_accuracy.png", "reward_per_stage.png"}

    recs = records(run_dir)
    updates = [r for r in recs if "train/loss" in r]
    assert [r["step"] for r in updates] == list(range(1, 9))
    # μ = B_train / B_mini = 4 updates per stage; the first update of each stage sees π_θ = β.
    for first in (updates[0], updates[4]):
        assert first["train/rollout_logprob_abs_diff_max"] < 1e-4
    assert any(abs(r["train/loss"]) > 0 for r in updates), "no update had a non-zero advantage"
    for key in (
        "train/clip_frac_low",
        "train/clip_frac_high",
        "train/nav_vetoed_frac",
        "train/nav_trigger_count",
        "train/ratio_mean_neg_adv",
        "train/ratio_p99",
        "train/grad_norm",
        "perf/t_total_s",
    ):
        assert any(key in r for r in recs), key
    for key in (
        "rollout/reward_mean",
        "rollout/solve_all_frac",
        "rollout/solve_none_frac",
        "rollout/response_len_mean",
        "eval/avg_pass@1",
        "perf/t_rollout_s",
    ):
        assert any(key in r for r in recs), key

    start, end = load_file(str(base_model / "model.safetensors")), final_weights(run_dir)
    assert start.keys() == end.keys()
    assert any(not torch.equal(start[k], end[k]) for k in start), "parameters did not change"


@pytest.mark.slow
def test_resume_after_sigkill_equals_uninterrupted(
    tmp_path: Path, base_model: Path, uninterrupted: tuple[Path, subprocess.CompletedProcess]
):
    """Killed after stage 0's generation, then mid-optimization of stage 1: same final weights."""
    run_dir = tmp_path / "killed"
    proc = train(run_dir, base_model, crash_at="rollout:0")
    assert proc.returncode == -signal.SIGKILL
    assert json.loads((run_dir / "rollouts" / "stage_000" / "manifest.json").read_text())["complete"]
    proc = mugrpo("train", "--resume", str(run_dir), crash_at="update:7", check=False)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    manifest_before = (run_dir / "rollouts" / "stage_001" / "manifest.json").read_bytes()
    mugrpo("train", "--resume", str(run_dir))
    # The complete D_1 was reused, not regenerated.
    assert (run_dir / "rollouts" / "stage_001" / "manifest.json").read_bytes() == manifest_before

    expected, got = final_weights(uninterrupted[0]), final_weights(run_dir)
    assert expected.keys() == got.keys()
    for name in expected:
        assert torch.equal(expected[name], got[name]), f"{name} differs after resume"
    steps = [r["step"] for r in records(run_dir) if "train/loss" in r]
    assert steps == list(range(1, 9)), "each update is logged exactly once after resume"


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_ranks_with_tensor_parallelism(tmp_path: Path, base_model: Path):
    """torchrun with TP=2: rank 0 owns the engine and the store, both ranks train; π_θ = β at update 1."""
    run_dir = tmp_path / "tp2"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(_free_port()),
        "-m",
        "megatron_mugrpo.cli",
        "train",
        "--config",
        str(DEMO),
        "--run-dir",
        str(run_dir),
        f"model.hf_dir={base_model}",
        "parallel.tensor_parallel=2",
        "stages.num_stages=1",
        *SMALL[1:],
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("acc_before=")
    updates = [r for r in records(run_dir) if "train/loss" in r]
    assert [r["step"] for r in updates] == [1, 2, 3, 4]
    assert updates[0]["train/rollout_logprob_abs_diff_max"] < 1e-4
    assert (run_dir / "hf_final" / "model.safetensors").is_file()


@pytest.mark.slow
def test_phase_verbs_replay_one_stage(tmp_path: Path, base_model: Path):
    """`generate` writes D_0 only; `optimize` then makes μ updates on it and checkpoints."""
    run_dir = tmp_path / "phases"
    common = ["--run-dir", str(run_dir), "--stage", "0"]
    mugrpo("generate", "--config", str(DEMO), *common, f"model.hf_dir={base_model}", *SMALL)
    assert json.loads((run_dir / "rollouts" / "stage_000" / "manifest.json").read_text())["complete"]
    assert not (run_dir / "checkpoints").exists()
    mugrpo("optimize", *common)
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_00000004"
    assert [r["step"] for r in records(run_dir) if "train/loss" in r] == [1, 2, 3, 4]
