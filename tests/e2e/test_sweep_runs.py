"""End to end: `mugrpo sweep` of 2 variants × 2 seeds on a tiny config, interrupted, resumed and re-run.

The session's ``easy_base_model`` (tests/e2e/conftest.py) is named in the sweep file as
``model.hf_dir``, so each run pays only for its two tiny stages. The two-digit ``base_model`` solves
almost none of this test's few problems, and all-zero accuracies would make the mean ± std checks
trivial; the one-digit task's model solves some.
"""

from __future__ import annotations

import csv
import json
import math
import os
import signal
import statistics
import subprocess
import time
from pathlib import Path

import pytest
from PIL import Image

from megatron_mugrpo.commands import mugrpo_argv

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "configs" / "demo_cpu.yaml"
DEMO_GRPO = ROOT / "configs" / "demo_grpo_cpu.yaml"
TINY = [
    "data.builtin_task=arithmetic_easy",
    "stages.num_stages=2",
    "stages.train_groups=4",
    "stages.mini_groups=2",
    "parallel.micro_batch_size=16",
    "rollout.shard_groups=4",
    "rollout.max_new_tokens=32",
    "eval.max_new_tokens=32",
    "eval.benchmarks.0.limit=8",
    "eval.benchmarks.0.k=2",
    "logging.progress_bars=false",
    "logging.tensorboard=false",
    "logging.report=false",  # each run's own plots; the sweep draws its summary plots regardless
    "optim.lr=1e-3",
]
RUNS = ["mu_grpo/seed_0", "mu_grpo/seed_1", "grpo/seed_0", "grpo/seed_1"]
WAIT_S = 600


def sweep_file(tmp_path: Path, base: Path) -> Path:
    path = tmp_path / "tiny_sweep.yaml"
    text = {
        "description": "tiny sweep",
        "base": str(DEMO),
        "overrides": [*TINY, f"model.hf_dir={base}"],
        "seeds": [0, 1],
        "variants": {
            "mu_grpo": [],
            # demo_grpo_cpu.yaml evaluates every 64 updates and checkpoints every 16 stages: not at this size
            "grpo": [f"inherit {DEMO_GRPO}", "eval.every_updates=0", "checkpoint.every_stages=1"],
        },
    }
    path.write_text(json.dumps(text))  # JSON is YAML
    return path


def sweep_command(path: Path, out: Path, parallel: int) -> list[str]:
    return mugrpo_argv("sweep", str(path), "--out", str(out), "--parallel", str(parallel))


def run_sweep(path: Path, out: Path, parallel: int) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    return subprocess.run(sweep_command(path, out, parallel), cwd=ROOT, env=env, capture_output=True, text=True)


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def figures_from_metrics(run_dir: Path) -> dict[str, float]:
    """The summary's per-run figures, computed here straight from metrics.jsonl."""
    recs = records(run_dir)
    evals = [r for r in recs if "eval/avg_pass@1" in r]
    acc = [r["eval/avg_pass@1"] for r in evals]
    updates = [r for r in recs if "train/response_tokens" in r]

    def rate(key: str) -> float:
        pairs = [(r[key], r["train/response_tokens"]) for r in updates if key in r]
        return sum(v * w for v, w in pairs) / sum(w for _, w in pairs) if pairs else math.nan

    return {
        "final_acc": acc[-1],
        "best_acc": max(acc),
        "acc_gain": acc[-1] - acc[0],
        "t_rollout_s": [r["perf/t_rollout_s"] for r in recs if "perf/t_rollout_s" in r][-1],
        "t_total_s": evals[-1]["perf/t_total_s"],
        "veto_rate": rate("train/nav_vetoed_frac"),
        "clip_low": rate("train/clip_frac_low"),
        "clip_high": rate("train/clip_frac_high"),
    }


def interrupt_after_first_checkpoint(path: Path, out: Path) -> str:
    """Run the sweep one run at a time and SIGTERM it once its first run has checkpointed stage 0."""
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    proc = subprocess.Popen(
        sweep_command(path, out, 1), cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    latest = out / "mu_grpo" / "seed_0" / "checkpoints" / "latest"
    deadline = time.monotonic() + WAIT_S
    while not latest.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=WAIT_S)
    assert proc.returncode == 130, output[-4000:]
    return output


@pytest.mark.slow
def test_sweep_is_interrupted_resumed_summarised_and_skips_finished_runs(tmp_path: Path, easy_base_model: Path):
    path, out = sweep_file(tmp_path, easy_base_model), tmp_path / "sweep"
    first = out / "mu_grpo" / "seed_0"

    # 1. Interrupted while its first run is in stage 1: that run stops with no status, nothing else started.
    output = interrupt_after_first_checkpoint(path, out)
    assert "stopped mu_grpo/seed_0" in output and "resume" in output
    assert (first / "checkpoints" / "latest").is_file() and not (first / "sweep_status.json").exists()
    assert not (out / "mu_grpo" / "seed_1").exists()
    stage0 = (first / "rollouts" / "stage_000" / "manifest.json").read_bytes()

    # 2. The same command (two at a time) resumes it and runs the other three.
    proc = run_sweep(path, out, parallel=2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    attempts = [line for line in (first / "sweep.log").read_text().splitlines() if line.startswith("==== 20")]
    assert len(attempts) == 2 and "--config" in attempts[0] and f"--resume {first}" in attempts[1]
    assert (first / "rollouts" / "stage_000" / "manifest.json").read_bytes() == stage0, "stage 0 was regenerated"
    for name in RUNS:
        run_dir = out / name
        assert json.loads((run_dir / "sweep_status.json").read_text())["status"] == "finished"
        assert [r["step"] for r in records(run_dir) if "train/loss" in r] == [1, 2, 3, 4], name
        assert (run_dir / "hf_final").is_dir()
    assert not (out / "_base").exists(), "the sweep file names its own base model"
    plots = ["sweep_accuracy.png", "sweep_ratio_neg_adv.png", "sweep_veto_clip.png"]
    assert {p.name for p in out.iterdir()} >= {"mu_grpo", "grpo", "summary.csv", "summary.md", "runs.csv", *plots}
    for plot in plots:
        with Image.open(out / plot) as image:
            assert image.format == "PNG"

    # The summary's mean ± std are those of the per-run numbers in the runs' own metrics.
    summary = {row["variant"]: row for row in csv.DictReader((out / "summary.csv").open())}
    assert list(summary) == ["mu_grpo", "grpo"]
    for variant, row in summary.items():
        per_run = [figures_from_metrics(out / variant / f"seed_{s}") for s in (0, 1)]
        assert int(row["n"]) == 2
        for key in per_run[0]:
            values = [f[key] for f in per_run]
            if any(math.isnan(v) for v in values):  # e.g. the veto rate of GRPO, which has no veto
                assert math.isnan(float(row[f"{key}_mean"])), (variant, key)
                continue
            assert float(row[f"{key}_mean"]) == pytest.approx(statistics.mean(values)), (variant, key)
            assert float(row[f"{key}_std"]) == pytest.approx(statistics.stdev(values)), (variant, key)
    assert any(figures_from_metrics(out / name)["best_acc"] > 0 for name in RUNS), "all-zero accuracies test little"
    text = (out / "summary.md").read_text()
    assert "| mu_grpo | 2 |" in text and "| grpo | 2 |" in text and "- none" in text

    # 3. Once more: every run is finished, nothing is touched, the summary is rewritten.
    logged = {name: (out / name / "metrics.jsonl").stat().st_mtime_ns for name in RUNS}
    proc = run_sweep(path, out, parallel=2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "4 runs: 4 finished, 0 to run" in proc.stdout
    assert {name: (out / name / "metrics.jsonl").stat().st_mtime_ns for name in RUNS} == logged
