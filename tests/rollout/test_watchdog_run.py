"""`mugrpo train` with a rollout engine that $MUGRPO_ENGINE_FAULT kills, then hangs, in the middle of
stage 0's generation: the watchdog rebuilds the engine from the host's copy of the stage's weights
(loop/engines.py), the run finishes, and the restarts are in the stage's metrics. One small CLI run
(~20 s); the bitwise equality of the restarted shards is tests/rollout/test_watchdog_transformers.py's.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from megatron_mugrpo.commands import mugrpo_argv

ROOT = Path(__file__).resolve().parents[2]
TINY = [
    "warmstart.steps=1",
    "stages.num_stages=1",
    "stages.train_groups=4",
    "stages.mini_groups=2",
    "parallel.micro_batch_size=4",
    "rollout.shard_groups=2",
    "rollout.group_size=2",
    "rollout.max_new_tokens=8",
    "rollout.transformers.batch_size=4",  # one batch per shard and per evaluation
    "eval.benchmarks.0.limit=4",
    "eval.benchmarks.0.k=1",
    "logging.progress_bars=false",
    "logging.report=false",
    "rollout.cpu_threads=1",
]
FAULTS = "raise:1,hang:3"
"""Batch 0 is the evaluation before training; 1 is shard 0's (dies), 2 its retry, 3 shard 1's (hangs), 4 its retry."""


def test_a_run_survives_an_engine_killed_then_hung_mid_stage(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", MUGRPO_ENGINE_FAULT=FAULTS)
    env.pop("MUGRPO_CRASH_AT", None)
    run_dir = tmp_path / "run"
    args = ["train", "--config", "configs/demo_cpu.yaml", "--run-dir", str(run_dir), *TINY]
    proc = subprocess.run(
        mugrpo_argv(*args, "rollout.progress_timeout_s=2"), cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "died in stage 0" in proc.stderr and "injected: the engine died in the middle of batch 1" in proc.stderr
    assert "hung in stage 0: no row finished for" in proc.stderr
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    restarts = [r["perf/rollout_engine_restarts"] for r in records if "perf/rollout_engine_restarts" in r]
    assert restarts == [2.0]
    assert sorted(p.name for p in (run_dir / "rollouts" / "stage_000").glob("shard_*.arrow")) == [
        "shard_00000.arrow",
        "shard_00001.arrow",
    ]
