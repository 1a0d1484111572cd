"""Headroom-Drift Replay on the CPU demo task: standard GRPO without replay, with naive replay, with HDR.

All three run ``configs/demo_grpo_cpu.yaml`` (standard GRPO, μ = 4, 64 stages × 32 fresh groups × 8
responses) from one shared warm-started base model, so they spend the same fresh rollout budget and
make the same number of updates; only what each update sees besides its fresh groups differs:

* ``grpo``:  no replay;
* ``naive``: replay of the K_rep most recently buffered mixed-outcome groups, no scoring, no gate
  (``replay.policy=recent``);
* ``hdr``:   Headroom-Drift Replay with the published defaults (τ = 1e-3, K_rep = 25% of the fresh
  groups, capacity 8 stages of groups).

Each method runs with ``--seeds`` seeds (``seed`` and ``stages.seed``: sampling, engine and
mini-batch order). The held-out accuracy (pass@1 over 4 samples on 256 problems) is read at every
evaluation (every 64 updates = 16 stages = 4096 fresh responses) and printed as mean ± std over the
seeds per fresh rollout budget, with the replay statistics. The last line is
``acc_grpo=<mean> acc_naive=<mean> acc_hdr=<mean> seeds=<n>`` (final accuracy). Runs go one after
another (each a `mugrpo train` subprocess); on 2 CPU cores budget about 2 minutes per run on a quiet
machine, so the default 3 seeds × 3 methods take ~20 minutes.

    .venv/bin/python benchmarks/replay.py [--seeds 3] [--out runs/bench_replay] [override ...]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a clone without installing

from megatron_mugrpo.commands import train_argv  # noqa: E402

CONFIG = ROOT / "configs" / "demo_grpo_cpu.yaml"
METHODS = {
    "grpo": [],
    "naive": ["replay.enabled=true", "replay.policy=recent"],
    "hdr": ["replay.enabled=true", "replay.policy=hdr"],
}
COMMON = ["parallel.micro_batch_size=8"]
"""8 rows per micro-batch: a multiple of G, so mini-batches with replayed groups are not padded."""
ACC = "eval/avg_pass@1"


def run(run_dir: Path, overrides: list[str]) -> list[dict]:
    """One `mugrpo train` in a subprocess; returns its metrics records."""
    cmd = train_argv(CONFIG, run_dir, ["logging.progress_bars=false", "logging.tensorboard=false", *overrides])
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    subprocess.run(cmd, cwd=ROOT, check=True, env=env, stdout=subprocess.DEVNULL)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def accuracy_by_budget(records: list[dict], responses_per_update: float) -> dict[int, float]:
    """Held-out accuracy keyed by the fresh responses generated before it was measured."""
    return {round(r["step"] * responses_per_update): r[ACC] for r in records if ACC in r}


def replay_summary(records: list[dict]) -> dict[str, float]:
    """Mean over stages of the replay decision's statistics (NaN-free means; empty without replay)."""
    plans = [r for r in records if "replay/accepted" in r and r["replay/buffer_groups"] > 0]
    out = {}
    for key in ("replay/accepted", "replay/scored", "replay/acceptance_rate", "replay/drift_mean", "replay/age_mean"):
        values = [r[key] for r in plans if not math.isnan(r[key])]
        out[key] = statistics.fmean(values) if values else math.nan
    return out


def mean_std(values: list[float]) -> str:
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.fmean(values):.3f} ± {std:.3f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_replay")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("overrides", nargs="*", help="dotted overrides applied to every run")
    args = parser.parse_args()
    if args.seeds < 1:
        parser.error("--seeds must be >= 1")
    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)

    from megatron_mugrpo.config import load_config
    from megatron_mugrpo.warmstart import prepare_base_model

    cfg = load_config(CONFIG, [*COMMON, *args.overrides])
    base = prepare_base_model(cfg, args.out / "base_model")  # one warm start shared by every run
    # Fresh responses per update: B_train prompts × G responses per stage, spread over μ updates.
    per_update = cfg.stages.train_groups * cfg.rollout.group_size / cfg.stages.updates_per_stage

    results: dict[str, list[dict]] = {name: [] for name in METHODS}
    for seed in range(args.seeds):
        for name, method in METHODS.items():
            overrides = [*COMMON, *args.overrides, f"model.hf_dir={base}", f"seed={seed}", f"stages.seed={seed}"]
            records = run(args.out / f"{name}_seed{seed}", [*overrides, *method])
            results[name].append(
                {
                    "acc": accuracy_by_budget(records, per_update),
                    "replay": replay_summary(records),
                    "t_total_s": max(r.get("perf/t_total_s", 0.0) for r in records),
                }
            )
            print(f"{name} seed {seed}: final acc {list(results[name][-1]['acc'].values())[-1]:.3f}", flush=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=2))

    budgets = sorted(results["grpo"][0]["acc"])
    print(f"\nheld-out pass@1, mean ± std over {args.seeds} seeds (the machine may have been loaded)")
    print(f"{'fresh responses':>16}" + "".join(f"{name:>18}" for name in METHODS))
    for budget in budgets:
        row = "".join(f"{mean_std([r['acc'][budget] for r in results[name]]):>18}" for name in METHODS)
        print(f"{budget:>16}{row}")
    print("\nper stage with a non-empty buffer (mean over stages and seeds)")
    print(
        f"{'method':<8}{'accepted':>10}{'scored':>8}{'accept rate':>13}{'drift':>11}{'age (upd)':>11}{'T_total s':>11}"
    )
    for name in METHODS:
        stats = {
            k: statistics.fmean(r["replay"].get(k, math.nan) for r in results[name]) for k in results[name][0]["replay"]
        }
        t_total = statistics.fmean(r["t_total_s"] for r in results[name])
        if not stats:
            print(f"{name:<8}{'-':>10}{'-':>8}{'-':>13}{'-':>11}{'-':>11}{t_total:>11.0f}")
            continue
        print(
            f"{name:<8}{stats['replay/accepted']:>10.2f}{stats['replay/scored']:>8.2f}"
            f"{stats['replay/acceptance_rate']:>13.3f}{stats['replay/drift_mean']:>11.2e}"
            f"{stats['replay/age_mean']:>11.1f}{t_total:>11.0f}"
        )
    final = {name: statistics.fmean(r["acc"][budgets[-1]] for r in results[name]) for name in METHODS}
    print(f"acc_grpo={final['grpo']:.4f} acc_naive={final['naive']:.4f} acc_hdr={final['hdr']:.4f} seeds={args.seeds}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
