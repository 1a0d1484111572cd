"""Staged vs asynchronous μ-GRPO on the CPU demo task, side by side on the same 2 cores.

Both runs start from the same warm-started base model and make the same number of optimizer
updates on the same task with the same loss (configs/demo_cpu.yaml: 4 × μ = 64 = 256 updates of
B_mini = 8 groups):

- staged: one process with 2 threads; each stage generates its 512 groups on both cores, then
  trains on both cores (the trainer idles while its data is generated);
- async (configs/demo_async_cpu.yaml): two processes of one thread each under torchrun, a rollout
  worker streaming groups through the bounded queue and a trainer, weights published every 4 updates.

Both evaluate only before training and after the last update (the same 256 held-out problems × 4
samples), so evaluation, identical work in both, does not dilute the comparison; the times below
exclude it (T_total − T_eval; totals with it are printed too).

    .venv/bin/python benchmarks/async_vs_sync.py [--out DIR] [--base-model HF_DIR] [--seed K] [override ...]

Trainer idle ratio = time waiting for and assembling samples / (that + training time): staged mode's
T_rollout / (T_rollout + T_optimize), async mode's summed sample waits over the same sum; "1st wait"
is the part spent before the first update (stage 0's generation; the worker's start-up and first
batch) and "idle 2+" the ratio without it. The last
line is ``idle_sync=… idle_async=… time_ratio=<staged time / async time> acc_sync=… acc_async=…``.
Extra arguments are dotted overrides applied to both runs (e.g. ``stages.num_stages=2``). The async
run publishes its weights from memory (``async.publish``'s default); ``async.publish=disk`` measures
the directory hand-over instead. ``--modes async`` runs one side alone (its own line then, e.g.
``idle_async=…``), for a quick check of the async pipeline. ``--seed K`` sets every seed of both runs
and of the base model to K, as ``mugrpo sweep`` does for its seed K (``seed``, ``stages.seed``,
``data.seed``: initialisation and warm start, rollout sampling and minibatch order, the problems drawn),
so that seeds differ as two machines would; without it the configs' seeds (0) stay.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from common import free_port, mean

from megatron_mugrpo.sweep import DEFAULT_SEED_KEYS

ROOT = Path(__file__).resolve().parents[1]
STAGED = ROOT / "configs" / "demo_cpu.yaml"
ASYNC = ROOT / "configs" / "demo_async_cpu.yaml"
CORES = 2


def command(mode: str, run_dir: Path, overrides: list[str]) -> tuple[list[str], dict[str, str]]:
    """The `mugrpo train` command of one run and its environment (threads per process)."""
    config = STAGED if mode == "staged" else ASYNC
    train = ["-m", "megatron_mugrpo.cli", "train", "--config", str(config), "--run-dir", str(run_dir)]
    train += ["logging.progress_bars=false", *overrides]
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    if mode == "staged":  # generation and training take both cores in turn
        env["OMP_NUM_THREADS"] = str(CORES)
        return [sys.executable, *train], env
    env["OMP_NUM_THREADS"] = "1"  # one core for the rollout worker, one for the trainer
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(CORES)]
    launcher += ["--master_port", str(free_port())]
    return [*launcher, *train, f"async.rollout_ranks={CORES - 1}"], env


def seed_overrides(seed: int | None, overrides: list[str]) -> list[str]:
    """``overrides`` with every key of ``DEFAULT_SEED_KEYS`` set to ``seed`` (unchanged when it is None).

    Raises ValueError when ``overrides`` already set one of those keys: the two would disagree.
    """
    if seed is None:
        return overrides
    taken = sorted({o.split("=", 1)[0] for o in overrides} & set(DEFAULT_SEED_KEYS))
    if taken:
        keys = ", ".join(DEFAULT_SEED_KEYS)
        raise ValueError(f"--seed {seed} sets {keys}; drop the override(s) of {', '.join(taken)} or --seed")
    return [*overrides, *(f"{key}={seed}" for key in DEFAULT_SEED_KEYS)]


def run(mode: str, run_dir: Path, overrides: list[str]) -> dict[str, float]:
    """One run in a subprocess; its times, idle ratio and accuracy from metrics.jsonl."""
    cmd, env = command(mode, run_dir, overrides)
    subprocess.run(cmd, cwd=ROOT, check=True, env=env, stdout=subprocess.DEVNULL)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "eval/avg_pass@1" in r]
    last = evals[-1]  # logged with the run's accumulated timers, after the last update
    waiting, training = last["perf/t_rollout_s"], last["perf/t_optimize_s"]
    first = _first_wait(mode, records)
    return {
        "updates": max(r["step"] for r in records),
        "time_s": last["perf/t_total_s"] - last["perf/t_eval_s"],
        "total_s": last["perf/t_total_s"],
        "idle": waiting / (waiting + training),
        "first_wait_s": first,
        "idle_after_first": (waiting - first) / (waiting - first + training),
        "acc_before": evals[0]["eval/avg_pass@1"],
        "acc": last["eval/avg_pass@1"],
        "dropped": sum(r.get("rollout/dropped_groups", 0.0) for r in records),
        "lag_mean": mean([r["rollout/lag_mean"] for r in records if "rollout/lag_mean" in r]),
    }


def _first_wait(mode: str, records: list[dict]) -> float:
    """Seconds the trainer waited before its first update: stage 0's generation (staged), the wait
    for the worker's first batch (async). In a short run this start-up weighs on the idle ratio."""
    if mode == "staged":
        return next(r["perf/t_rollout_s"] for r in records if r.get("perf/t_rollout_s", 0.0) > 0.0)
    return next(r["perf/sample_wait_s"] for r in records if r["step"] == 1 and "perf/sample_wait_s" in r)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_async_vs_sync")
    parser.add_argument("--base-model", type=Path, help="an existing warm-started HF directory (default: build one)")
    parser.add_argument("--modes", nargs="+", choices=("staged", "async"), default=["staged", "async"])
    parser.add_argument("--seed", type=int, help="seed, stages.seed and data.seed of both runs (default: the configs')")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    try:
        args.overrides = seed_overrides(args.seed, args.overrides)
    except ValueError as exc:
        parser.error(str(exc))
    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)
    # The shared base model is built (warm-started) once, outside both timings.
    from megatron_mugrpo.config import load_config
    from megatron_mugrpo.warmstart import prepare_base_model

    cfg = load_config(STAGED, args.overrides)
    base = args.base_model or prepare_base_model(cfg, args.out / "base_model")
    overrides = [*args.overrides, f"model.hf_dir={base}", f"eval.every_updates={cfg.stages.total_updates}"]
    results = {mode: run(mode, args.out / mode, overrides) for mode in args.modes}
    header = f"{'mode':<8}{'updates':>9}{'time s':>9}{'(+eval) s':>11}{'idle':>8}{'1st wait s':>12}{'idle 2+':>9}"
    print(header + f"{'acc before':>12}{'acc after':>11}{'lag mean':>10}{'dropped':>9}")
    for mode, r in results.items():
        print(
            f"{mode:<8}{r['updates']:>9}{r['time_s']:>9.1f}{r['total_s']:>11.1f}{r['idle']:>8.3f}"
            f"{r['first_wait_s']:>12.2f}{r['idle_after_first']:>9.3f}"
            f"{r['acc_before']:>12.3f}{r['acc']:>11.3f}{r['lag_mean']:>10.2f}{int(r['dropped']):>9}"
        )
    if len(results) == 1:
        ((mode, r),) = results.items()
        name = "sync" if mode == "staged" else "async"
        print(f"idle_{name}={r['idle']:.3f} time_s={r['time_s']:.1f} acc_{name}={r['acc']:.3f}")
        return 0
    staged, asynchronous = results["staged"], results["async"]
    print(
        f"idle_sync={staged['idle']:.3f} idle_async={asynchronous['idle']:.3f} "
        f"time_ratio={staged['time_s'] / asynchronous['time_s']:.2f} "
        f"acc_sync={staged['acc']:.3f} acc_async={asynchronous['acc']:.3f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
