"""End to end on the long-reasoning demo's config: the running-sum task, IcePop as defined (log π_old of
the stage's start through the stage reference pass) and the drift diagnostics in metrics.jsonl and the report.

One small `mugrpo train` (a barely warm-started model, one stage of two updates): what is checked is the
plumbing, not learning."""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

from megatron_mugrpo.algorithms.diagnostics import DRIFT_METRICS
from megatron_mugrpo.commands import mugrpo_argv

ROOT = Path(__file__).resolve().parents[1]
SMALL = [
    "warmstart.steps=20",
    "stages.num_stages=1",
    "stages.train_groups=4",
    "stages.mini_groups=2",
    "rollout.group_size=4",
    "rollout.shard_groups=4",
    "rollout.max_new_tokens=32",
    "rollout.cpu_threads=1",
    "parallel.micro_batch_size=8",
    "eval.max_new_tokens=32",
    "eval.benchmarks.0.limit=4",
    "eval.benchmarks.0.k=1",
    "logging.progress_bars=false",
    "logging.tensorboard=false",
    "algo.loss=icepop",
]


def test_long_demo_trains_icepop_and_logs_the_drift_diagnostics(tmp_path: Path) -> None:
    run = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    argv = mugrpo_argv("train", "--config", str(ROOT / "configs" / "demo_long_cpu.yaml"), "--run-dir", str(run), *SMALL)
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    updates = [r for r in records if "train/stage" in r]
    assert len(updates) == 2
    for record in updates:
        assert {f"train/{name}" for name in DRIFT_METRICS} <= record.keys()
        # π_old was scored by the trainer at the stage's start; the transformers engine's β agrees with it
        # to float32 noise, so IcePop's weight is 1 and nothing is masked.
        assert math.isclose(record["train/icepop_weight_mean"], 1.0, abs_tol=1e-3)
        assert record["train/icepop_masked_frac"] == 0.0
    assert list((run / "rollouts").rglob("old_logprobs_*.arrow")), "the stage reference pass stored log π_old"
    report = subprocess.run(
        mugrpo_argv("report", str(run), "--out", str(tmp_path / "report")), cwd=ROOT, env=env, capture_output=True
    )
    assert report.returncode == 0 and (tmp_path / "report" / "drift_run.png").is_file()
