"""Async μ-GRPO with and without partial rollouts (async.partial_rollout) on long-tailed response lengths.

Both runs are the CPU async demo (configs/demo_async_cpu.yaml: one rollout worker core, one trainer
core, weights published from memory every async.sync_every updates) from the same warm-started base
model, with the same updates, loss and seeds. Response lengths are forced to a long tail: the rollout
engine is the transformers engine with EOS off and a length cap per prompt (``LongTailed``): one
prompt in ``--long-every`` runs to ``rollout.max_new_tokens``, the others stop at a tenth of it. So a
worker batch lasts as long as its long responses, and publications land while they are in flight:

- whole (``async.partial_rollout=false``): the worker applies them between batches only;
- partial (``async.partial_rollout=true``, ``async.partial_kv=recompute`` unless overridden): between
  two decode steps, the in-flight sequences continued under the new weights.

Measured per run, from metrics.jsonl: the trainer's idle ratio (waiting for and assembling samples /
(that + training)) and the same after its first update ("idle 2+": without the start-up), the time
without evaluation, the worker's seconds generating (the queue records: what a KV-cache recompute at
each switch costs shows here), the mean per-token and per-group lag (updates between the weights that
sampled a token, or a group's oldest token, and the policy it trains) and the dropped groups. Last line:
``idle_partial=… idle_whole=… time_ratio=<whole time / partial time>``.

    .venv/bin/python benchmarks/partial_rollout.py [--out runs/bench_partial] [--base-model HF_DIR] [override ...]
    .venv/bin/python benchmarks/partial_rollout.py --small     # a short check that it runs end to end

The runs go through torchrun with this file as the entry point (``--child``), which registers the
``long_tailed`` engine in every process before the CLI reads its config.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Any

from common import free_port, mean

ROOT = Path(__file__).resolve().parents[1]
STAGED = ROOT / "configs" / "demo_cpu.yaml"
ASYNC = ROOT / "configs" / "demo_async_cpu.yaml"
CORES = 2
SHORT_FRACTION = 10
"""A short response's cap is max_new_tokens / SHORT_FRACTION: the long ones are ten times longer."""
LONG = ["rollout.max_new_tokens=160", "rollout.long_tailed.batch_size=2048"]
"""Responses of 16 and 160 tokens; engine batches as large as the demo's (configs/demo_cpu.yaml)."""
SMALL = [
    "warmstart.steps=100",
    "stages.num_stages=1",
    "stages.train_groups=128",
    "rollout.max_new_tokens=60",
    "async.batch_groups=32",
    "async.first_batch_groups=8",
    "async.queue_groups=32",
    "eval.benchmarks.0.limit=8",
    "eval.benchmarks.0.k=1",
]
"""``--small``: 16 updates (μ = 128 / 8), responses of 6 and 60 tokens: a check that the benchmark runs,
not a measurement."""


def _long_every() -> int:
    return int(os.environ.get("PARTIAL_BENCH_LONG_EVERY", "8"))


def register_long_tailed() -> None:
    """Register the ``long_tailed`` engine (its knobs: ``rollout.long_tailed.*``, the transformers engine's)."""
    from megatron_mugrpo.rollout.engine import Generation, ProgressCallback, SamplingParams, register_engine
    from megatron_mugrpo.rollout.transformers_engine import TransformersEngine, TransformersEngineConfig

    class LongTailed(TransformersEngine):
        """The transformers engine with EOS off: a prompt whose CRC32 is 0 modulo ``PARTIAL_BENCH_LONG_EVERY``
        runs to max_new_tokens, any other to a tenth of it (two engine calls, the short prompts first)."""

        name = "long_tailed"

        def __init__(self, hf_dir: str, **kwargs: Any) -> None:
            super().__init__(hf_dir, eos_token_ids=[], **kwargs)

        def generate(
            self,
            prompts: list[list[int]],
            n: int | list[int],
            params: SamplingParams,
            progress: ProgressCallback | None = None,
        ) -> list[list[Generation]]:
            counts = n if isinstance(n, list) else [n] * len(prompts)
            long = [zlib.crc32(str(p).encode()) % _long_every() == 0 for p in prompts]
            short_params = SamplingParams(
                max_new_tokens=max(1, params.max_new_tokens // SHORT_FRACTION),
                temperature=params.temperature,
                seed=params.seed,
            )
            out: list[list[Generation]] = [[] for _ in prompts]
            for wanted, call_params in ((False, short_params), (True, params)):
                chosen = [i for i, is_long in enumerate(long) if is_long == wanted and counts[i] > 0]
                if not chosen:
                    continue
                groups = super().generate(
                    [prompts[i] for i in chosen], [counts[i] for i in chosen], call_params, progress
                )
                for i, group in zip(chosen, groups):
                    out[i] = group
            return out

    register_engine("long_tailed", LongTailed, TransformersEngineConfig)


def run(run_dir: Path, overrides: list[str]) -> dict[str, float]:
    """One async run under torchrun (this file as the entry point); its figures from metrics.jsonl."""
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(CORES)]
    cmd += ["--master_port", str(free_port()), str(Path(__file__).resolve()), "--child", "train"]
    cmd += ["--config", str(ASYNC), "--run-dir", str(run_dir), "logging.progress_bars=false"]
    cmd += ["rollout.engine=long_tailed", f"async.rollout_ranks={CORES - 1}", *overrides]
    subprocess.run(cmd, cwd=ROOT, check=True, env=env, stdout=subprocess.DEVNULL)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = next(r for r in reversed(records) if "perf/t_total_s" in r)
    waiting, training = last["perf/t_rollout_s"], last["perf/t_optimize_s"]
    updates = [r for r in records if "rollout/token_lag_mean" in r]
    first = next(r["perf/sample_wait_s"] for r in updates if r["step"] == 1)
    shards = [json.loads(p.read_text()) for p in (run_dir / "rollouts" / "queue").glob("w*_b*.json")]
    return {
        "updates": float(len(updates)),
        "time_s": last["perf/t_total_s"] - last.get("perf/t_eval_s", 0.0),
        "idle": waiting / (waiting + training),
        "idle_after_first": (waiting - first) / (waiting - first + training),
        "generate_s": sum(shard["generate_s"] for shard in shards),
        "token_lag": mean([r["rollout/token_lag_mean"] for r in updates]),
        "group_lag": mean([r["rollout/lag_mean"] for r in updates]),
        "dropped": sum(r.get("rollout/dropped_groups", 0.0) for r in updates),
    }


def main() -> int:
    if "--child" in sys.argv:  # a torchrun process: the CLI, with the long_tailed engine registered
        register_long_tailed()
        from megatron_mugrpo.cli import main as cli_main

        return cli_main([a for a in sys.argv[1:] if a != "--child"])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_partial_rollout")
    parser.add_argument("--base-model", type=Path, help="an existing warm-started HF directory (default: build one)")
    parser.add_argument("--small", action="store_true", help="a short run (SMALL overrides) to check it works")
    parser.add_argument("--long-every", type=int, default=8, help="one prompt in this many gets a long response")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    os.environ["PARTIAL_BENCH_LONG_EVERY"] = str(args.long_every)
    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)
    overrides = [*LONG, *(SMALL if args.small else []), *args.overrides]
    register_long_tailed()  # its section (rollout.long_tailed.*) is in the overrides
    from megatron_mugrpo.config import load_config
    from megatron_mugrpo.warmstart import prepare_base_model

    cfg = load_config(STAGED, overrides)  # the shared base model is built once, outside both timings
    base = args.base_model or prepare_base_model(cfg, args.out / "base_model")
    overrides += [f"model.hf_dir={base}", f"eval.every_updates={cfg.stages.total_updates}"]
    results = {
        "whole": run(args.out / "whole", [*overrides, "async.partial_rollout=false"]),
        "partial": run(args.out / "partial", [*overrides, "async.partial_rollout=true"]),
    }
    header = f"{'mode':<9}{'updates':>9}{'time s':>9}{'idle':>8}{'idle 2+':>9}{'worker gen s':>14}"
    print(header + f"{'token lag':>11}{'group lag':>11}{'dropped':>9}")
    for mode, r in results.items():
        print(
            f"{mode:<9}{int(r['updates']):>9}{r['time_s']:>9.1f}{r['idle']:>8.3f}{r['idle_after_first']:>9.3f}"
            f"{r['generate_s']:>14.1f}{r['token_lag']:>11.2f}{r['group_lag']:>11.2f}{int(r['dropped']):>9}"
        )
    whole, partial = results["whole"], results["partial"]
    print(
        f"idle_partial={partial['idle']:.3f} idle_whole={whole['idle']:.3f} "
        f"time_ratio={whole['time_s'] / partial['time_s']:.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
