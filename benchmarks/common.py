"""Set-up the benchmarks share: a tiny model directory, its prompt pool, a free port, a best-of-N timer,
the summaries they print, and the loop of the benchmarks that compare training methods over seeds (each
run a `mugrpo train` subprocess).

Benchmarks run as scripts (``python benchmarks/<name>.py``), so Python puts this directory first on
``sys.path`` and they import it as ``common``. A policy loaded from a Hugging Face directory is
``megatron_mugrpo.conversion.load_hf_policy`` (the library's, since the trainer's warm start uses it too).

    model_dir = tiny_model_dir(tmp / "model", hidden=256, layers=2)
    prompts = prompt_pool(64)
    seconds, result = best_time(lambda: engine.generate(prompts, 1, params), repeats=3)
    results = run_methods(out, ["grpo", "hdr"], seeds=3, plan=plan, summarize=summarize, describe=describe)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch

T = TypeVar("T")

ROOT = Path(__file__).resolve().parents[1]
REPLAY_KEYS = ("replay/accepted", "replay/scored", "replay/acceptance_rate", "replay/drift_mean", "replay/age_mean")
"""The replay decision's statistics a stage logs (``replay/*``), summarised by ``replay_summary``."""

HEAD_DIM = 64
"""Attention head size of the tiny models: every SGLang attention backend supports 64 (vLLM's CPU
kernels refuse 16), so the same directory serves every engine."""


def tiny_model_dir(
    out_dir: Path,
    *,
    hidden: int,
    layers: int,
    heads: int | None = None,
    max_positions: int = 512,
    seed: int = 0,
    **fields: Any,
) -> Path:
    """A random float32 Qwen2 with the character tokenizer saved in ``out_dir``: ``heads`` query heads
    (default hidden / 64), half as many KV heads, an MLP 4× wide and tied embeddings; ``fields``
    override any config.json field."""
    from megatron_mugrpo.training.tiny import tiny_hf_dir

    heads = heads or hidden // HEAD_DIM
    shape = {
        "hidden_size": hidden,
        "intermediate_size": 4 * hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": max(1, heads // 2),
        "max_position_embeddings": max_positions,
        "tie_word_embeddings": True,
    }
    tiny_hf_dir(out_dir, seed=seed, **(shape | fields))
    return out_dir


def prompt_pool(count: int, *, task: str = "arithmetic", tokenizer: Any = None) -> list[list[int]]:
    """``count`` built-in ``task`` prompts (training split, seed 0) as token ids, in ``tokenizer`` (a
    Hugging Face tokenizer; default the character tokenizer the tiny models use)."""
    from megatron_mugrpo.char_tokenizer import build_char_tokenizer
    from megatron_mugrpo.rollout.tasks import builtin_problems, builtin_prompt

    tokenizer = tokenizer or build_char_tokenizer()
    rows = builtin_problems(task, count, seed=0, split="train")
    return [tokenizer(builtin_prompt(row["problem"]))["input_ids"] for row in rows]


def free_port() -> int:
    """A TCP port free on this host now (for a launcher's ``--master_port``)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def best_time(
    fn: Callable[[], T], repeats: int, *, cuda: bool = False, cleanup: Callable[[], object] | None = None
) -> tuple[float, T]:
    """(fastest wall seconds of ``repeats`` calls, the last call's result). The machines are shared, so
    the minimum is the signal; ``cuda`` waits for the device before and after each call; ``cleanup``
    runs untimed after each call (e.g. removes what it wrote, so the next call writes afresh)."""
    if repeats < 1:
        raise ValueError(f"repeats={repeats} must be >= 1")
    best, result = float("inf"), None
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        result = fn()
        if cuda:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
        if cleanup is not None:
            cleanup()
    return best, result  # type: ignore[return-value]


def mean(values: list[float]) -> float:
    """The mean, 0.0 for no values (a run that logged none of a metric)."""
    return statistics.fmean(values) if values else 0.0


def mean_std(values: list[float], fmt: str = ".3f") -> str:
    """``"mean ± std"`` (sample std; 0 for one value; ``-`` for none)."""
    if not values:
        return "-"
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.fmean(values):{fmt}} ± {std:{fmt}}"


def replay_summary(records: Sequence[dict]) -> dict[str, float]:
    """Mean over stages with a non-empty buffer of the replay decision's statistics (``REPLAY_KEYS``; NaN-free
    means, NaN when no stage had one: a run without replay)."""
    plans = [r for r in records if "replay/accepted" in r and r["replay/buffer_groups"] > 0]
    out = {}
    for key in REPLAY_KEYS:
        values = [r[key] for r in plans if not math.isnan(r[key])]
        out[key] = statistics.fmean(values) if values else math.nan
    return out


def train_records(config: Path, run_dir: Path, overrides: Sequence[str]) -> list[dict]:
    """One `mugrpo train` in a subprocess (no progress bars, no TensorBoard, its stdout dropped); returns its
    metrics records. A failed run raises ``CalledProcessError`` (its stderr is left on the console)."""
    from megatron_mugrpo.commands import train_argv

    cmd = train_argv(config, run_dir, ["logging.progress_bars=false", "logging.tensorboard=false", *overrides])
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    subprocess.run(cmd, cwd=ROOT, check=True, env=env, stdout=subprocess.DEVNULL)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def method_parser(doc: str, out: Path, methods: Sequence[str]) -> argparse.ArgumentParser:
    """The command line of a method comparison: ``--out``, ``--seeds``, ``--methods``, ``--quick`` and dotted
    overrides applied to every run; a benchmark adds its own flags. ``methods_to_run`` checks the first two."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=out)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--methods", default=",".join(methods), help=f"comma-separated subset of {list(methods)}")
    parser.add_argument("--quick", action="store_true", help="tiny runs: check that the benchmark runs")
    parser.add_argument("overrides", nargs="*", help="dotted overrides applied to every run")
    return parser


def methods_to_run(parser: argparse.ArgumentParser, args: argparse.Namespace, methods: Sequence[str]) -> list[str]:
    """``--methods`` as a list, in the order given; a bad ``--seeds`` or an unknown method exits 2 (parser.error)."""
    if args.seeds < 1:
        parser.error("--seeds must be >= 1")
    chosen = [m for m in args.methods.split(",") if m]
    if unknown := [m for m in chosen if m not in methods]:
        parser.error(f"--methods: {unknown} unknown; choose from {list(methods)}")
    return chosen


def run_methods(
    out: Path,
    methods: Sequence[str],
    *,
    seeds: int,
    plan: Callable[[str, int], tuple[Path, list[str]]],
    summarize: Callable[[Path, list[str], list[dict]], dict],
    describe: Callable[[dict], str],
    train: Callable[[Path, Path, Sequence[str]], list[dict]] = train_records,
) -> dict[str, list[dict]]:
    """Every method at seeds 0 .. ``seeds`` - 1, seed by seed (so a cut-short benchmark has whole seeds), each run
    in ``out/<method>_seed<seed>``: ``plan(method, seed)`` gives its config and overrides (``seed`` and
    ``stages.seed`` are appended: sampling, engine and mini-batch order), ``summarize(config, overrides,
    records)`` what is kept of it and ``describe(summary)`` its progress line. Returns the summaries by method,
    also written to ``out/results.json`` after every run."""
    results: dict[str, list[dict]] = {name: [] for name in methods}
    with sigterm_reaps_children():
        for seed in range(seeds):
            for name in methods:
                config, overrides = plan(name, seed)
                overrides = [*overrides, f"seed={seed}", f"stages.seed={seed}"]
                records = train(config, out / f"{name}_seed{seed}", overrides)
                results[name].append(summarize(config, overrides, records))
                (out / "results.json").write_text(json.dumps(results, indent=2))  # a cut-short run keeps its seeds
                print(f"{name} seed {seed}: {describe(results[name][-1])}", flush=True)
    return results


@contextlib.contextmanager
def sigterm_reaps_children() -> Iterator[None]:
    """Inside, SIGTERM exits through ``SystemExit`` (status 143) instead of killing this process outright, so
    ``subprocess.run`` kills and waits for the running ``mugrpo train`` before the benchmark exits. A child left
    behind would go on with its graceful preemption and write ``preempted.json`` into the ``--out`` that a
    restarted benchmark has just emptied, and the restarted run would refuse to start."""

    def exit_143(signum: int, frame: Any) -> None:
        sys.exit(128 + signal.SIGTERM)

    previous = signal.signal(signal.SIGTERM, exit_143)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
