"""Generated tokens/s of the transformers rollout engine at batch sizes 8 … 256 on a small model.

Large stages buy throughput: a frozen policy can generate its whole static dataset in big
batches. This prints tokens/s per batch size and the ratio largest / smallest batch.

    python benchmarks/rollout_throughput.py                    # CPU default, < 2 minutes
    python benchmarks/rollout_throughput.py --device cuda --hidden 512 --layers 8

The model is a randomly initialised Qwen2 over the built-in character tokenizer; EOS is disabled
so that every row generates exactly --max-new-tokens tokens and the token count is exact.
Last line: ``batch_speedup=<tokens/s at the largest batch / at the smallest>``.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from megatron_mugrpo.rollout.engine import SamplingParams
from megatron_mugrpo.rollout.tasks import build_char_tokenizer, builtin_problems, builtin_prompt
from megatron_mugrpo.rollout.transformers_engine import TransformersEngine
from megatron_mugrpo.training.tiny import tiny_hf_dir


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 16, 32, 64, 128, 256])
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--repeats", type=int, default=2, help="best of N runs per batch size (noise)")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    return parser.parse_args()


def build_model_dir(out_dir: Path, args: argparse.Namespace) -> list[list[int]]:
    """Save a random small Qwen2 + char tokenizer in out_dir; return the tokenized prompt pool."""
    tiny_hf_dir(
        out_dir,
        seed=0,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=max(1, args.heads // 2),
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )
    tokenizer = build_char_tokenizer()
    rows = builtin_problems("arithmetic", max(args.batch_sizes), seed=0, split="train")
    return [tokenizer(builtin_prompt(r["problem"]))["input_ids"] for r in rows]


def measure(engine: TransformersEngine, prompts: list[list[int]], params: SamplingParams) -> tuple[float, float]:
    """Generated tokens per wall-clock second and per CPU second (process time, all threads) for
    one call on len(prompts) rows; the CPU figure is the steadier one on a shared machine."""
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    wall, cpu = time.perf_counter(), time.process_time()
    groups = engine.generate(prompts, 1, params)
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    tokens = sum(len(g.response_ids) for group in groups for g in group)
    return tokens / wall, tokens / max(cpu, 1e-9)


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0, seed=0)
    with tempfile.TemporaryDirectory() as tmp:
        prompts = build_model_dir(Path(tmp), args)
        engine = TransformersEngine(
            tmp, dtype=args.dtype, device=args.device, batch_size=max(args.batch_sizes), eos_token_ids=[]
        )
        measure(engine, prompts[: min(args.batch_sizes)], params)  # warm-up: allocator, kernels
        print(
            f"transformers engine, Qwen2 hidden={args.hidden} layers={args.layers} dtype={args.dtype} "
            f"device={args.device} threads={torch.get_num_threads()} max_new_tokens={args.max_new_tokens}"
        )
        print(f"best of {args.repeats} runs per batch size")
        print(f"{'batch':>6} {'tokens/s':>12} {'vs smallest':>12} {'tokens/cpu-s':>13}")
        rates = {}
        for batch in args.batch_sizes:
            runs = [measure(engine, prompts[:batch], params) for _ in range(args.repeats)]
            rates[batch] = max(r[0] for r in runs)
            cpu_rate = max(r[1] for r in runs)
            speedup = rates[batch] / rates[args.batch_sizes[0]]
            print(f"{batch:>6} {rates[batch]:>12.1f} {speedup:>11.2f}x {cpu_rate:>13.1f}")
    largest, smallest = max(args.batch_sizes), min(args.batch_sizes)
    print(f"batch_speedup={rates[largest] / rates[smallest]:.2f}")


if __name__ == "__main__":
    main()
