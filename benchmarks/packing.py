"""The optimizer phase at long-tailed response lengths: padded vs token-budget vs packed micro-batches.

    python benchmarks/packing.py                  # CPU (float32): a few minutes on 2 cores
    python benchmarks/packing.py --hidden 256     # a bigger model; on a GPU the script runs in bf16

One update of B_mini = 32 prompt groups × G = 8 responses. Response lengths are drawn from a
log-normal with median ``--max-len / 4`` and 95th percentile 0.9 × ``--max-len`` (σ = ln(3.6) / 1.645),
capped at ``--max-len`` (1,024) tokens, like reasoning traces: most responses are far shorter than
the longest of 256. Prompts are ``--prompt-len`` tokens.

The same update runs through ``training.train_step`` three ways, from identical weights:

* padded: fixed micro-batches of ``--micro-batch`` rows, each padded to the update's longest row;
* budget: ``parallel.micro_batch_tokens`` = ``--micro-batch`` × the longest possible row (the same peak
  activation memory as padded): rows sorted by length, each micro-batch padded to its own longest row;
* packed: the same budget, several sequences per row (``parallel.pack_sequences``): rows as wide as
  the longest row, block-diagonal attention through Megatron's local attention (which computes each
  packed row's full width² scores, so on CPU packing trims the linear layers' padding but not
  attention's).

Reported: ``padding_frac`` (share of the padded update's tokens that are padding), the speed-up
(median padded time per update / median budget or packed time, first updates included, the three
alternating update by update so load drift hits all), ``max_loss_err`` and ``max_grad_err`` (the
first update's loss and every gradient element, budget and packed vs padded, from the same
weights), and ``peak_mem_ratio`` (budget / padded peak memory of an update: CUDA's peak allocation
on a GPU; on CPU the growth of the process's peak RSS over the model's baseline, budget measured
first so that its peak is not the padded one's).
"""

from __future__ import annotations

import argparse
import math
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megatron_mugrpo.algorithms.config import AlgoConfig
from megatron_mugrpo.records import RolloutGroup, RolloutSample, TrainBatch, collate
from megatron_mugrpo.training.model import tiny_hf_config
from megatron_mugrpo.training.optimizer import OptimConfig

LR = 1e-6
P95_OVER_MAX = 0.9
"""The length distribution's 95th percentile, as a fraction of the maximum."""
Z95 = 1.6448536269514722
"""Standard normal 95th percentile."""


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=1000)
    parser.add_argument("--groups", type=int, default=32, help="prompt groups per update (B_mini)")
    parser.add_argument("--group-size", type=int, default=8, help="responses per prompt (G)")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-len", type=int, default=1024, help="longest response (the cap)")
    parser.add_argument("--micro-batch", type=int, default=4, help="rows per padded micro-batch")
    parser.add_argument("--updates", type=int, default=2, help="timed updates per side, after the first")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def response_lengths(count: int, max_len: int, gen: torch.Generator) -> list[int]:
    """Log-normal lengths: median max_len / 4, p95 0.9 · max_len, capped to [1, max_len]."""
    mu = math.log(max_len / 4)
    sigma = math.log(P95_OVER_MAX * 4) / Z95
    draws = torch.exp(mu + sigma * torch.randn(count, generator=gen, dtype=torch.float64))
    return [int(min(max_len, max(1.0, round(float(x))))) for x in draws]


def make_batch(args: argparse.Namespace) -> TrainBatch:
    gen = torch.Generator().manual_seed(args.seed)
    lengths = iter(response_lengths(args.groups * args.group_size, args.max_len, gen))
    groups = []
    for g in range(args.groups):
        prompt = torch.randint(3, args.vocab, (args.prompt_len,), generator=gen).tolist()
        samples = []
        for _ in range(args.group_size):
            n = next(lengths)
            samples.append(
                RolloutSample(
                    response_ids=torch.randint(3, args.vocab, (n,), generator=gen).tolist(),
                    behaviour_logprobs=(-math.log(args.vocab) + 0.3 * torch.randn(n, generator=gen)).tolist(),
                    finish_reason="stop" if n < args.max_len else "length",
                    advantage=float(torch.randn((), generator=gen)),
                )
            )
        groups.append(RolloutGroup(prompt_id=str(g), prompt_ids=prompt, answer="", samples=samples))
    return collate(groups, pad_id=0)


def hf_config(args: argparse.Namespace) -> dict:
    heads = max(4, args.hidden // 64)
    return tiny_hf_config(
        "qwen2",
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 8 // 3 // 8 * 8,
        num_hidden_layers=args.layers,
        num_attention_heads=heads,
        num_key_value_heads=heads // 2,
        max_position_embeddings=args.prompt_len + args.max_len,
        tie_word_embeddings=True,
    )


def peak_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


VARIANTS = ("budget", "padded", "packed")
"""Measured in this order: on CPU the peak RSS only grows, so budget's reading is its own and padded's
is its own when larger (``peak_mem_ratio`` compares those two); packed's is max(padded, packed)."""


def main() -> None:
    args = parse_args()
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("RANK", "0")
    from megatron_mugrpo.training.batching import padding_fraction, row_lengths
    from megatron_mugrpo.training.parallel import initialize_parallel, seed_everything
    from megatron_mugrpo.training.setup import build_policy
    from megatron_mugrpo.training.train_step import train_step, update_plan

    cuda = torch.cuda.is_available()
    device = torch.device("cuda") if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    batch = make_batch(args)
    lengths = [int(n) for n in batch.response_mask.sum(1).tolist()]
    budget = args.micro_batch * (args.prompt_len + args.max_len)
    options = {
        "padded": {"micro_batch_tokens": None},
        "budget": {"micro_batch_tokens": budget},
        "packed": {"micro_batch_tokens": budget, "pack_sequences": True},
    }
    groups = initialize_parallel(1, 1, seed=0)
    print(
        f"device={device.type} dtype={str(dtype).removeprefix('torch.')} threads={torch.get_num_threads()} "
        f"hidden={args.hidden} layers={args.layers} vocab={args.vocab} rows={batch.num_sequences} "
        f"prompt={args.prompt_len} response median={statistics.median(lengths):.0f} "
        f"p95={sorted(lengths)[int(0.95 * len(lengths))]} max={max(lengths)} width={batch.tokens.shape[1]}"
    )
    padding = {}
    for name in VARIANTS:
        plan = update_plan(batch, groups, args.micro_batch, **options[name])[0]
        padding[name] = padding_fraction([plan], row_lengths(batch.response_mask))
        print(
            f"{name:7s} {len(plan):3d} micro-batches, {sum(p.tokens for p in plan):7d} tokens computed, "
            f"padding {padding[name]:.3f}"
        )
    algo = AlgoConfig().loss_options()
    policies = {}
    for name in VARIANTS:
        seed_everything(0)  # identical initial weights on every side
        policies[name] = build_policy(hf_config(args), groups=groups, dtype=dtype, optim=OptimConfig(lr=LR))

    def step(name: str) -> Callable[[], dict[str, float]]:
        return lambda: train_step(
            policies[name],
            batch,
            loss_name="mu_grpo",
            loss_options=algo,
            temperature=1.0,
            micro_batch_size=args.micro_batch,
            **options[name],
        )

    # First update of each side from the same weights: exactness and peak memory (see VARIANTS).
    base = peak_bytes(device)
    first: dict[str, Any] = {}
    for name in VARIANTS:
        if cuda:
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        start = time.perf_counter()
        metrics = step(name)()
        grads = {n: p.main_grad.detach().float().clone() for n, p in policies[name].unwrapped()[0].named_parameters()}
        first[name] = (metrics, grads, peak_bytes(device) - base, time.perf_counter() - start)
        print(f"{name:7s} first update {first[name][3]:7.2f} s  peak memory +{first[name][2] / 2**20:8.1f} MiB")
    loss_err = grad_err = 0.0
    for name in ("budget", "packed"):
        loss_err = max(loss_err, abs(first[name][0]["train/loss"] - first["padded"][0]["train/loss"]))
        grad_err = max(grad_err, *(float((first[name][1][n] - g).abs().max()) for n, g in first["padded"][1].items()))
    mem_ratio = first["budget"][2] / first["padded"][2] if first["padded"][2] > 0 else float("nan")

    times: dict[str, list[float]] = {name: [first[name][3]] for name in VARIANTS}
    for _ in range(args.updates):
        for name in VARIANTS:
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            step(name)()
            if cuda:
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - start)
    median = {name: statistics.median(values) for name, values in times.items()}
    real = float(batch.response_mask.sum())
    for name, value in median.items():
        print(f"{name:7s} {value:7.2f} s/update  {real / value:9.0f} response tokens/s")
    print(
        f"padding_frac={padding['padded']:.3f} speedup_budget={median['padded'] / median['budget']:.2f} "
        f"speedup_packed={median['padded'] / median['packed']:.2f} max_loss_err={loss_err:.2e} "
        f"max_grad_err={grad_err:.2e} peak_mem_ratio={mem_ratio:.3f}"
    )


if __name__ == "__main__":
    main()
