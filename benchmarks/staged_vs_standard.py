"""μ-GRPO vs standard GRPO on the CPU demo task, side by side: the paper's headline measurement.

Both runs start from the same warm-started base model and make the same number of optimizer
updates (demo_cpu.yaml: 4 stages × μ = 64; demo_grpo_cpu.yaml: 64 stages × μ = 4). Standard GRPO
pays a weight sync, an engine start-up and a small generation batch per 4 updates; μ-GRPO pays them
4 times per run and generates in large batches.

    .venv/bin/python benchmarks/staged_vs_standard.py [--out runs/bench_staged] [override ...]

Prints T_rollout, T_total and final accuracy for both and the ratios; the last line is
``rollout_speedup=… total_speedup=… acc_mugrpo=… acc_grpo=…``. Extra arguments are dotted overrides
applied to both runs (e.g. ``warmstart.steps=300``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a clone without installing

from megatron_mugrpo.commands import train_argv  # noqa: E402

CONFIGS = {"mu_grpo": ROOT / "configs" / "demo_cpu.yaml", "grpo": ROOT / "configs" / "demo_grpo_cpu.yaml"}


def run(config: Path, run_dir: Path, overrides: list[str]) -> dict[str, float]:
    """One `mugrpo train` in a subprocess; returns its final timers and last evaluation."""
    cmd = train_argv(config, run_dir, ["logging.progress_bars=false", *overrides])
    subprocess.run(cmd, cwd=ROOT, check=True, env=dict(os.environ, PYTHONWARNINGS="ignore"), stdout=subprocess.DEVNULL)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "eval/avg_pass@1" in r]
    last = records[-1]
    return {
        "t_rollout_s": last["perf/t_rollout_s"],
        "t_total_s": last["perf/t_total_s"],
        "acc_before": evals[0]["eval/avg_pass@1"],
        "acc": evals[-1]["eval/avg_pass@1"],
        "updates": max(r["step"] for r in records),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_staged_vs_standard")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)
    # Build the shared base model once (warm start), outside both timings.
    from megatron_mugrpo.config import load_config
    from megatron_mugrpo.warmstart import prepare_base_model

    base = prepare_base_model(load_config(CONFIGS["mu_grpo"], args.overrides), args.out / "base_model")
    overrides = [*args.overrides, f"model.hf_dir={base}"]
    results = {name: run(config, args.out / name, overrides) for name, config in CONFIGS.items()}
    print(f"{'method':<10}{'updates':>9}{'T_rollout s':>13}{'T_total s':>11}{'acc before':>12}{'acc after':>11}")
    for name, r in results.items():
        print(
            f"{name:<10}{r['updates']:>9}{r['t_rollout_s']:>13.1f}{r['t_total_s']:>11.1f}"
            f"{r['acc_before']:>12.3f}{r['acc']:>11.3f}"
        )
    mu, grpo = results["mu_grpo"], results["grpo"]
    print(
        f"rollout_speedup={grpo['t_rollout_s'] / mu['t_rollout_s']:.2f} "
        f"total_speedup={grpo['t_total_s'] / mu['t_total_s']:.2f} "
        f"acc_mugrpo={mu['acc']:.3f} acc_grpo={grpo['acc']:.3f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
