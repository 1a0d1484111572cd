"""Headroom-Drift Replay on the CPU demo task: standard GRPO without replay, with naive replay, with HDR;
and staged μ-GRPO without replay and with HDR across stages.

The first three run ``configs/demo_grpo_cpu.yaml`` (standard GRPO, μ = 4, 64 stages × 32 fresh groups
× 8 responses), the last two ``configs/demo_cpu.yaml`` (μ-GRPO, μ = 64, 4 stages × 512 groups), all
from one shared warm-started base model (the GRPO config inherits the demo's model and warm start),
so they spend the same fresh rollout budget (64 fresh responses per update) and make the same 256
updates; only what each update sees besides its fresh groups differs:

* ``grpo``:  no replay;
* ``naive``: replay of the K_rep most recently buffered mixed-outcome groups, no scoring, no gate
  (``replay.policy=recent``);
* ``hdr``:   Headroom-Drift Replay with the published defaults (τ = 1e-3, K_rep = 25% of the fresh
  groups, capacity 8 stages of groups);
* ``mu_grpo``: the μ-GRPO demo, no replay;
* ``mu_hdr_cross``: the μ-GRPO demo with HDR over references into earlier stages' stores
  (``replay.cross_stage``): a buffered group is at least 64 updates old when it is scored, so the
  gate has real drift to screen, unlike at μ = 4 where groups are 4 updates old.

Each method runs with ``--seeds`` seeds (``seed`` and ``stages.seed``: sampling, engine and
mini-batch order). The held-out accuracy (pass@1 over 4 samples on 256 problems) is read at every
evaluation (every 64 updates = 16 stages = 4096 fresh responses) and printed as mean ± std over the
seeds per fresh rollout budget, with the replay statistics. The last line is
``acc_grpo=<mean> acc_naive=<mean> acc_hdr=<mean> acc_mu_grpo=<mean> acc_mu_hdr_cross=<mean> seeds=<n>``
(final accuracy). Runs go one after another (each a `mugrpo train` subprocess) after one warm start
of the base model (1,500 steps). ``--methods`` runs a subset. ``--quick`` shrinks every run (2 stages
of 16 groups, a 20-step warm start, 16 evaluation problems) to check that the benchmark runs end to
end in a few minutes; its numbers mean nothing.

    .venv/bin/python benchmarks/replay.py [--seeds 3] [--methods grpo,hdr] [--quick] [--out DIR] [override ...]
"""

from __future__ import annotations

import math
import shutil
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a clone without installing

from common import mean_std, method_parser, methods_to_run, replay_summary, run_methods  # noqa: E402

CONFIG = ROOT / "configs" / "demo_grpo_cpu.yaml"
MU_CONFIG = ROOT / "configs" / "demo_cpu.yaml"
METHODS: dict[str, tuple[Path, list[str]]] = {
    "grpo": (CONFIG, []),
    "naive": (CONFIG, ["replay.enabled=true", "replay.policy=recent"]),
    "hdr": (CONFIG, ["replay.enabled=true", "replay.policy=hdr"]),
    # Evaluated at the GRPO runs' update counts (the demo itself evaluates only at the end).
    "mu_grpo": (MU_CONFIG, ["eval.every_updates=64"]),
    "mu_hdr_cross": (
        MU_CONFIG,
        ["eval.every_updates=64", "replay.enabled=true", "replay.policy=hdr", "replay.cross_stage=true"],
    ),
}
COMMON = ["parallel.micro_batch_size=8"]
"""8 rows per micro-batch: a multiple of G, so mini-batches with replayed groups are not padded."""
QUICK = [
    "warmstart.steps=20",
    "stages.num_stages=2",
    "stages.train_groups=16",
    "stages.mini_groups=4",
    "eval.every_updates=2",
    "eval.benchmarks.0.limit=16",
    "rollout.max_new_tokens=16",
    "eval.max_new_tokens=16",
]
"""``--quick``: every run a 2-stage, μ = 4 run of 16 groups per stage (a check that everything runs)."""
ACC = "eval/avg_pass@1"


def accuracy_by_budget(records: list[dict], responses_per_update: float) -> dict[int, float]:
    """Held-out accuracy keyed by the fresh responses generated before it was measured."""
    return {round(r["step"] * responses_per_update): r[ACC] for r in records if ACC in r}


def summarize(config: Path, overrides: list[str], records: list[dict]) -> dict:
    """A run's held-out accuracy by fresh-response budget, its replay statistics and its wall clock."""
    from megatron_mugrpo.config import load_config

    cfg = load_config(config, overrides)
    # Fresh responses per update: B_train prompts × G responses per stage, spread over μ updates.
    per_update = cfg.stages.train_groups * cfg.rollout.group_size / cfg.stages.updates_per_stage
    skipped = [r["replay/recheck_skipped"] for r in records if "replay/recheck_skipped" in r]
    return {
        "acc": accuracy_by_budget(records, per_update),
        "replay": replay_summary(records) | {"replay/recheck_skipped": float(sum(skipped))},
        "t_total_s": max(r.get("perf/t_total_s", 0.0) for r in records),
    }


def main() -> int:
    parser = method_parser(__doc__, ROOT / "runs" / "bench_replay", list(METHODS))
    args = parser.parse_args()
    methods = methods_to_run(parser, args, list(METHODS))
    user = [*(QUICK if args.quick else []), *args.overrides]
    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)

    from megatron_mugrpo.config import load_config
    from megatron_mugrpo.warmstart import prepare_base_model

    cfg = load_config(CONFIG, [*COMMON, *user])
    base = prepare_base_model(cfg, args.out / "base_model")  # one warm start shared by every run

    def plan(name: str, seed: int) -> tuple[Path, list[str]]:
        config, method = METHODS[name]
        # Method overrides first: the user's (and --quick's) apply on top of them.
        return config, [*COMMON, *method, *user, f"model.hf_dir={base}"]

    results = run_methods(
        args.out,
        methods,
        seeds=args.seeds,
        plan=plan,
        summarize=summarize,
        describe=lambda result: f"final acc {list(result['acc'].values())[-1]:.3f}",
    )

    budgets = sorted({b for name in methods for r in results[name] for b in r["acc"]})
    print(f"\nheld-out pass@1, mean ± std over {args.seeds} seeds (the machine may have been loaded)")
    print(f"{'fresh responses':>16}" + "".join(f"{name:>18}" for name in methods))
    for budget in budgets:
        row = "".join(
            f"{mean_std([r['acc'][budget] for r in results[name] if budget in r['acc']]):>18}" for name in methods
        )
        print(f"{budget:>16}{row}")
    print("\nper stage with a non-empty buffer (mean over stages and seeds; re-check skips: total per run)")
    print(
        f"{'method':<13}{'accepted':>10}{'scored':>8}{'accept rate':>13}{'drift':>11}{'age (upd)':>11}"
        f"{'skipped':>9}{'T_total s':>11}"
    )
    for name in methods:
        stats = {
            k: statistics.fmean(r["replay"].get(k, math.nan) for r in results[name]) for k in results[name][0]["replay"]
        }
        t_total = statistics.fmean(r["t_total_s"] for r in results[name])
        if math.isnan(stats["replay/accepted"]):  # no stage had a buffer: a method without replay
            print(f"{name:<13}{'-':>10}{'-':>8}{'-':>13}{'-':>11}{'-':>11}{'-':>9}{t_total:>11.0f}")
            continue
        print(
            f"{name:<13}{stats['replay/accepted']:>10.2f}{stats['replay/scored']:>8.2f}"
            f"{stats['replay/acceptance_rate']:>13.3f}{stats['replay/drift_mean']:>11.2e}"
            f"{stats['replay/age_mean']:>11.1f}{stats['replay/recheck_skipped']:>9.1f}{t_total:>11.0f}"
        )
    final = {name: statistics.fmean(list(r["acc"].values())[-1] for r in results[name]) for name in methods}
    print(" ".join(f"acc_{name}={value:.4f}" for name, value in final.items()) + f" seeds={args.seeds}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
