"""Megatron train step vs a plain PyTorch one on the same small model: time per update, tokens/s, ratio.

    python benchmarks/train_step.py                 # CPU (float32), well under 2 minutes
    python benchmarks/train_step.py --layers 8      # bigger; on a GPU the same script runs in bf16
    python benchmarks/train_step.py --demo-shape    # the CPU demo's update: 64 rows of 64 tokens, 2 tiny layers
    nice -n 19 python benchmarks/train_step.py --threads 1   # on a shared machine (see below)
    python benchmarks/train_step.py --demo-shape --threads 1 --compare-attention   # + megatron's own attention

Both sides make the same μ-GRPO update (same Qwen2-architecture shapes, same batch, same
``policy_loss``, AdamW + gradient clipping, the same micro-batching):

* megatron: ``training.train_step`` at TP = PP = DP = 1 — Megatron ``GPTModel`` (local layer spec on
  CPU with its attention computed by SDPA, ``training.sdpa_attention``; Transformer Engine's spec on
  GPU when importable), DDP buffers, ``get_forward_backward_func``, Megatron's optimizer, the fused
  vocab-parallel log-prob. ``--compare-attention`` adds a third side, ``megatron_mcore_attn``: the
  same update with megatron-core's own local ``DotProductAttention`` (the state before SDPA).
* plain: transformers' ``Qwen2ForCausalLM`` (eager attention on CPU, like Megatron's local
  attention; SDPA on GPU), ``log_softmax(logits / T)`` + gather, ``torch.optim.AdamW``.

The two sides alternate update by update and each reports its median, so a machine whose load
drifts (a shared CI box) affects both alike. On CPU the compatibility layer's device mode is then
active for both sides (it adds the same small per-op cost to each). Last line:
``megatron_overhead=<Megatron median time per update / plain median time per update>``.

On a machine other jobs share, measure with ``--threads 1``: with two threads on two busy cores every
parallel region waits for a descheduled thread, which times the number of torch ops rather than the
update (measured: 12 s per update at load average 18 against 0.23 s idle, at the default shape).
With one thread the script also prints each side's median CPU time of the calling thread per update
and their ratio, which time spent descheduled does not inflate.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megatron_mugrpo.algorithms.config import AlgoConfig
from megatron_mugrpo.algorithms.losses import policy_loss
from megatron_mugrpo.records import RolloutGroup, RolloutSample, TrainBatch, collate
from megatron_mugrpo.training.model import tiny_hf_config
from megatron_mugrpo.training.optimizer import OptimConfig

LR = 1e-6
CLIP_GRAD = 1.0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--groups", type=int, default=2, help="prompt groups per update (B_mini)")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--response-len", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--updates", type=int, default=4)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default, the cores)")
    parser.add_argument(
        "--demo-shape", action="store_true", help="the CPU demo's update: 64 rows of 16 + 48 tokens, 2 layers"
    )
    parser.add_argument(
        "--compare-attention",
        action="store_true",
        help="also time megatron-core's own local attention (megatron_mcore_attn), the state before SDPA",
    )
    args = parser.parse_args()
    if args.demo_shape:  # configs/demo_cpu.yaml: mini_groups x G rows, max_prompt + max_new tokens, one micro-batch
        args.hidden, args.layers, args.vocab = 64, 2, 100
        args.groups, args.group_size, args.prompt_len, args.response_len, args.micro_batch = 8, 8, 16, 48, 64
    return args


def make_batch(args: argparse.Namespace, seed: int = 0) -> TrainBatch:
    gen = torch.Generator().manual_seed(seed)
    groups = []
    for g in range(args.groups):
        prompt = torch.randint(3, args.vocab, (args.prompt_len,), generator=gen).tolist()
        samples = [
            RolloutSample(
                response_ids=torch.randint(3, args.vocab, (args.response_len,), generator=gen).tolist(),
                behaviour_logprobs=[-9.0] * args.response_len,
                finish_reason="length",
                advantage=float(torch.randn((), generator=gen)),
            )
            for _ in range(args.group_size)
        ]
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
        max_position_embeddings=args.prompt_len + args.response_len,
        tie_word_embeddings=True,
    )


def time_alternating(
    steps: dict[str, Callable[[], None]], warmup: int, updates: int, device: torch.device
) -> tuple[dict[str, float], dict[str, float]]:
    """Median wall seconds and median CPU seconds of the calling thread per update of each step
    function, run in alternation after ``warmup`` rounds. The thread's CPU time is the whole update's
    only with one torch thread on CPU (``--threads 1``), where it also ignores time spent descheduled."""
    wall: dict[str, list[float]] = {name: [] for name in steps}
    cpu: dict[str, list[float]] = {name: [] for name in steps}
    for round_index in range(warmup + updates):
        for name, step in steps.items():
            if device.type == "cuda":
                torch.cuda.synchronize()
            start, start_cpu = time.perf_counter(), time.thread_time()
            step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            if round_index >= warmup:
                wall[name].append(time.perf_counter() - start)
                cpu[name].append(time.thread_time() - start_cpu)
    median = statistics.median
    return {name: median(v) for name, v in wall.items()}, {name: median(v) for name, v in cpu.items()}


def plain_step_fn(
    args: argparse.Namespace, config: dict, batch: TrainBatch, device: torch.device, dtype: torch.dtype
) -> Callable[[], None]:
    from megatron_mugrpo.training.tiny import tiny_model

    attention = "sdpa" if device.type == "cuda" else "eager"
    model = tiny_model(seed=0, dtype=dtype, attn_implementation=attention, **config).to(device).train()
    optim = OptimConfig(lr=LR, clip_grad=CLIP_GRAD)
    opt = torch.optim.AdamW(
        model.parameters(),
        lr=optim.lr,
        betas=(optim.beta1, optim.beta2),
        eps=optim.eps,
        weight_decay=optim.weight_decay,
    )
    options = AlgoConfig().loss_options()
    batch = batch.to(device)
    micro = [batch.slice(i, i + args.micro_batch) for i in range(0, batch.num_sequences, args.micro_batch)]

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        total = sum(float(mb.response_mask.bool().any(-1).sum()) for mb in micro)  # seq-mean normaliser
        for mb in micro:
            logits = model(input_ids=mb.tokens).logits.float()
            logprobs = torch.log_softmax(logits, dim=-1).gather(-1, mb.targets.unsqueeze(-1)).squeeze(-1)
            out = policy_loss("mu_grpo", logprobs, mb.behaviour_logprobs, mb.advantages, mb.response_mask, **options)
            (out.loss_sum / total).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_GRAD)
        opt.step()

    return step


def megatron_step_fn(
    args: argparse.Namespace, config: dict, batch: TrainBatch, dtype: torch.dtype, *, mcore_attention: bool = False
) -> Callable[[], None]:
    """``mcore_attention``: the same update with megatron-core's own local ``DotProductAttention`` in
    place of ``training.sdpa_attention`` (a subclass without state of its own, so resetting the class
    is the exact before-state of the layer spec), for a side-by-side before / after in one process."""
    from megatron_mugrpo.training.parallel import initialize_parallel
    from megatron_mugrpo.training.setup import build_policy
    from megatron_mugrpo.training.train_step import train_step

    groups = initialize_parallel(1, 1, seed=0)
    policy = build_policy(config, groups=groups, dtype=dtype, optim=OptimConfig(lr=LR, clip_grad=CLIP_GRAD))
    if mcore_attention:
        from megatron.core.transformer.dot_product_attention import DotProductAttention

        from megatron_mugrpo.training.sdpa_attention import SdpaDotProductAttention

        for module in (m for chunk in policy.unwrapped() for m in chunk.modules()):
            if isinstance(module, SdpaDotProductAttention):
                module.__class__ = DotProductAttention
    options = AlgoConfig().loss_options()

    def step() -> None:
        train_step(
            policy,
            batch,
            loss_name="mu_grpo",
            loss_options=options,
            temperature=1.0,
            micro_batch_size=args.micro_batch,
            impl="fused",
        )

    return step


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda") if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    torch.manual_seed(0)
    config = hf_config(args)
    batch = make_batch(args)
    tokens = int(batch.tokens.numel())
    print(
        f"device={device.type} dtype={str(dtype).removeprefix('torch.')} threads={torch.get_num_threads()} "
        f"hidden={args.hidden} layers={args.layers} vocab={args.vocab} sequences={batch.num_sequences} "
        f"seq_len={batch.tokens.shape[1]} micro_batch={args.micro_batch}"
    )
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("RANK", "0")
    steps = {
        "plain": plain_step_fn(args, config, batch, device, dtype),
        "megatron": megatron_step_fn(args, config, batch, dtype),
    }
    if args.compare_attention:
        steps["megatron_mcore_attn"] = megatron_step_fn(args, config, batch, dtype, mcore_attention=True)
    seconds, cpu_seconds = time_alternating(steps, args.warmup, args.updates, device)
    plain, megatron = seconds["plain"], seconds["megatron"]
    for name, value in seconds.items():
        print(f"{name:9s} {value * 1e3:9.1f} ms/update  {tokens / value:10.0f} tokens/s")
    if device.type == "cpu" and torch.get_num_threads() == 1:  # robust to other jobs on the cores
        cpu = {name: f"{value * 1e3:.1f} ms" for name, value in cpu_seconds.items()}
        print(f"thread CPU per update: {cpu}, overhead {cpu_seconds['megatron'] / cpu_seconds['plain']:.3f}")
        if args.compare_attention:
            before = cpu_seconds["megatron_mcore_attn"] / cpu_seconds["plain"]
            print(f"thread CPU overhead with megatron-core's local attention: {before:.3f}")
    print(f"megatron_overhead={megatron / plain:.3f}")


if __name__ == "__main__":
    main()
