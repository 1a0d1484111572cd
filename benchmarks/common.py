"""Set-up the benchmarks share: a tiny model directory, its prompt pool, a free port, a best-of-N timer,
and the summaries they print.

Benchmarks run as scripts (``python benchmarks/<name>.py``), so Python puts this directory first on
``sys.path`` and they import it as ``common``. A policy loaded from a Hugging Face directory is
``megatron_mugrpo.conversion.load_hf_policy`` (the library's, since the trainer's warm start uses it too).

    model_dir = tiny_model_dir(tmp / "model", hidden=256, layers=2)
    prompts = prompt_pool(64)
    seconds, result = best_time(lambda: engine.generate(prompts, 1, params), repeats=3)
"""

from __future__ import annotations

import socket
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

T = TypeVar("T")

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
