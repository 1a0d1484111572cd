"""Generated tokens/s of the transformers rollout engine at batch sizes 8 … 256 on a small model,
and against ``model.generate`` at the demo's batch sizes.

Large stages buy throughput: a frozen policy can generate its whole static dataset in big
batches. This prints tokens/s per batch size and the ratio largest / smallest batch. Then, side by
side in the same process (interleaved, best of --repeats each, each one batch of that many rows),
our sampling loop and ``model.generate`` (multinomial sampling at T, top-k/top-p off: the same
distribution) at --generate-batches: 256 rows is a standard-GRPO stage of the demo (32 groups × 8),
2048 the μ-GRPO demo's engine batch. ``vs_generate`` is our tokens/s over generate's, the smallest over those batch
sizes, by wall clock; the CPU-time ratio is printed too (steadier on a shared machine).

    python benchmarks/rollout_throughput.py                    # CPU default, < 2 minutes
    python benchmarks/rollout_throughput.py --device cuda --hidden 512 --layers 8

The model is a randomly initialised Qwen2 over the built-in character tokenizer; EOS is disabled
so that every row generates exactly --max-new-tokens tokens and the token count is exact.
Last line: ``batch_speedup=<tokens/s at the largest batch / at the smallest> vs_generate=<ours / generate>``.

``--vllm`` (in the vLLM environment, ``.venv-vllm``) adds the vLLM engine (``rollout.engine: vllm``, in
process) to the side-by-side runs and ``vllm_vs_engine=<vLLM / our engine>`` to the last line. vLLM's CPU
attention needs head_dim 64, so run it at the demo's width with one head::

    nice -n 19 .venv-vllm/bin/python benchmarks/rollout_throughput.py --vllm --hidden 64 --heads 1 \
        --batch-sizes 256 --generate-batches 256 2048 --max-new-tokens 48
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from megatron_mugrpo.char_tokenizer import build_char_tokenizer
from megatron_mugrpo.rollout.engine import RolloutEngine, SamplingParams
from megatron_mugrpo.rollout.tasks import builtin_problems, builtin_prompt
from megatron_mugrpo.rollout.transformers_engine import TransformersEngine, left_pad
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
    parser.add_argument(
        "--generate-batches", type=int, nargs="*", default=[256, 2048], help="rows compared with model.generate"
    )
    parser.add_argument("--vllm", action="store_true", help="also the vLLM engine at --generate-batches (head_dim 64)")
    args = parser.parse_args()
    if args.vllm and args.hidden // args.heads != 64:
        parser.error(f"--vllm needs head_dim 64 (vLLM's CPU attention), got {args.hidden} / {args.heads}: --heads 1")
    return args


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
    rows = builtin_problems("arithmetic", max([*args.batch_sizes, *args.generate_batches]), seed=0, split="train")
    return [tokenizer(builtin_prompt(r["problem"]))["input_ids"] for r in rows]


def measure(engine: RolloutEngine, prompts: list[list[int]], params: SamplingParams) -> tuple[float, float]:
    """Generated tokens per wall-clock second and per CPU second (process time, all threads) for
    one call on len(prompts) rows; the CPU figure is the steadier one on a shared machine."""
    device = getattr(engine, "device", torch.device("cpu"))  # the vLLM engine runs where vLLM put it
    return _timed(device, lambda: sum(len(g.response_ids) for grp in engine.generate(prompts, 1, params) for g in grp))


def measure_generate(
    engine: TransformersEngine, prompts: list[list[int]], params: SamplingParams
) -> tuple[float, float]:
    """``measure`` for ``model.generate`` on the engine's model: multinomial sampling from
    softmax(logits / T), no top-k / top-p, no EOS (every row runs to max_new_tokens, as ours does)."""
    from transformers import GenerationConfig

    config = GenerationConfig(
        do_sample=True,
        temperature=params.temperature,
        top_k=0,
        top_p=1.0,
        max_new_tokens=params.max_new_tokens,
        eos_token_id=None,
        pad_token_id=engine.pad_token_id,
    )
    input_ids, mask = left_pad(prompts, engine.pad_token_id, engine.device)

    def run() -> int:
        with torch.inference_mode():
            out = engine.model.generate(input_ids=input_ids, attention_mask=mask, generation_config=config)
        return out[:, input_ids.shape[1] :].numel()

    return _timed(engine.device, run)


def _timed(device: torch.device, call: Callable[[], int]) -> tuple[float, float]:
    """(tokens / wall second, tokens / CPU second) of ``call``, which returns its token count."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    wall, cpu = time.perf_counter(), time.process_time()
    tokens = call()
    if device.type == "cuda":
        torch.cuda.synchronize()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return tokens / wall, tokens / max(cpu, 1e-9)


def versus_generate(
    engine: TransformersEngine, prompts: list[list[int]], params: SamplingParams, batches: list[int], repeats: int
) -> float:
    """Print our tokens/s and generate's per batch size (interleaved runs, best of ``repeats``);
    returns the smallest wall-clock ratio ours / generate (nan without batch sizes)."""
    print(f"ours vs model.generate, best of {repeats} interleaved runs each")
    print(f"{'batch':>6} {'ours tok/s':>11} {'generate':>10} {'ratio':>6} {'cpu ratio':>10}")
    ratios = []
    for batch in batches:
        # One engine batch of ``batch`` rows, as generate's single call (the μ-GRPO demo's engine batch
        # is 2048 rows). Left at the sweep's largest size, 2048 rows would run as 8 batches of 256.
        engine.batch_size = batch
        ours, theirs = [], []
        for _ in range(repeats):
            ours.append(measure(engine, prompts[:batch], params))
            theirs.append(measure_generate(engine, prompts[:batch], params))
        wall = max(r[0] for r in ours) / max(r[0] for r in theirs)
        cpu = max(r[1] for r in ours) / max(r[1] for r in theirs)
        ratios.append(wall)
        print(
            f"{batch:>6} {max(r[0] for r in ours):>11.1f} {max(r[0] for r in theirs):>10.1f} {wall:>6.2f} {cpu:>10.2f}"
        )
    return min(ratios, default=float("nan"))


def versus_vllm(
    model_dir: str,
    engine: TransformersEngine,
    prompts: list[list[int]],
    params: SamplingParams,
    batches: list[int],
    repeats: int,
) -> float:
    """Print the vLLM engine's tokens/s beside ours per batch size (interleaved, best of ``repeats``; vLLM
    schedules up to the whole batch at once); returns the smallest wall-clock ratio vLLM / ours."""
    from megatron_mugrpo.rollout.vllm_engine import VLLMEngine

    vllm = VLLMEngine(model_dir, eos_token_ids=[], max_num_seqs=max(batches), kv_cache_gib=1.0)
    measure(vllm, prompts[: min(batches)], params)  # warm-up
    print(f"vLLM engine vs ours, best of {repeats} interleaved runs each")
    print(f"{'batch':>6} {'vllm tok/s':>11} {'ours':>10} {'ratio':>6} {'cpu ratio':>10}")
    ratios = []
    for batch in batches:
        engine.batch_size = batch
        theirs, ours = [], []
        for _ in range(repeats):
            theirs.append(measure(vllm, prompts[:batch], params))
            ours.append(measure(engine, prompts[:batch], params))
        wall = max(r[0] for r in theirs) / max(r[0] for r in ours)
        cpu = max(r[1] for r in theirs) / max(r[1] for r in ours)
        ratios.append(wall)
        print(
            f"{batch:>6} {max(r[0] for r in theirs):>11.1f} {max(r[0] for r in ours):>10.1f} {wall:>6.2f} {cpu:>10.2f}"
        )
    vllm.shutdown()
    return min(ratios, default=float("nan"))


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
        measure_generate(engine, prompts[: min(args.batch_sizes)], params)  # warm-up
        vs_generate = versus_generate(engine, prompts, params, args.generate_batches, args.repeats)
        vs_vllm = versus_vllm(tmp, engine, prompts, params, args.generate_batches, args.repeats) if args.vllm else None
    largest, smallest = max(args.batch_sizes), min(args.batch_sizes)
    last = f"batch_speedup={rates[largest] / rates[smallest]:.2f} vs_generate={vs_generate:.2f}"
    print(last + (f" vllm_vs_engine={vs_vllm:.2f}" if vs_vllm is not None else ""))


if __name__ == "__main__":
    main()
