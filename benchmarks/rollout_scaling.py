"""Rollout scaling with the engine count: one stage's D_k from 1 engine, then from 2, each on one core.

Each engine is its own process limited to one torch thread, the way each rank of a GPU job has one
device: the 1-engine run is one process, the 2-engine run two gloo ranks sharing the shards through
the rollout store's claim files (``rollout/generate.py``). Both generate the same stage of the same
model into fresh stores; the benchmark prints generated tokens/s for both and whether the shard
checksums are identical (they must be: a shard's prompts, batches and seeds depend only on the stage
and the shard index, and both runs use one thread per engine).

    python benchmarks/rollout_scaling.py                      # CPU, about a minute on a quiet machine
    python benchmarks/rollout_scaling.py --shards 32 --repeats 3

The model is a randomly initialised Qwen2 over the built-in character tokenizer, EOS disabled so
that every response has --max-new-tokens tokens. Timing covers generation only (processes, models
and reward pools are ready and behind a barrier first); the best of --repeats runs counts, the two
engine counts alternating so that a busy machine slows both alike. The ideal ratio is 2 with 2 free
cores; other work on the machine lowers it, so the CPU seconds of the busiest engine are printed too
(``cpu_time_scaling``: what the ratio would be with a free core per engine).
Last line: ``engine_scaling=<tokens/s with 2 engines / with 1> identical=<true|false>``.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from common import free_port, tiny_model_dir

from megatron_mugrpo.char_tokenizer import build_char_tokenizer
from megatron_mugrpo.durable import Checksum
from megatron_mugrpo.rewards.registry import build_reward
from megatron_mugrpo.rollout.config import RolloutConfig
from megatron_mugrpo.rollout.generate import generate_planned, plan_stage, stage_identity
from megatron_mugrpo.rollout.placement import EnginePlacement, HostGroup
from megatron_mugrpo.rollout.prompts import PromptRecord
from megatron_mugrpo.rollout.tasks import builtin_problems, builtin_prompt
from megatron_mugrpo.rollout.transformers_engine import TransformersEngine


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shards", type=int, default=16, help="shards of the stage (the unit engines claim)")
    parser.add_argument("--shard-groups", type=int, default=4, help="prompt groups per shard")
    parser.add_argument("--group-size", type=int, default=8, help="responses per prompt (G)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2, help="best of N runs per engine count")
    return parser.parse_args()


def build_model(out_dir: Path, args: argparse.Namespace) -> list[PromptRecord]:
    """Save a random Qwen2 (4 heads, 2 KV heads) + char tokenizer in out_dir; return the stage's prompts."""
    tiny_model_dir(out_dir, hidden=args.hidden, layers=args.layers, heads=4, max_positions=256)
    tokenizer = build_char_tokenizer()
    rows = builtin_problems("arithmetic", args.shards * args.shard_groups, seed=0, split="train")
    return [
        PromptRecord(
            prompt_id=f"p{i}",
            prompt_ids=tokenizer(builtin_prompt(r["problem"]))["input_ids"],
            answer=r["answer"],
            text=builtin_prompt(r["problem"]),
        )
        for i, r in enumerate(rows)
    ]


def engine_process(rank: int, world: int, port: int, model_dir: str, store_dir: str, prompts, args, results) -> None:
    """One engine on one thread; reports (rank, generation seconds, its CPU seconds, tokens, most shards)."""
    warnings.filterwarnings("ignore")  # library notices, once per spawned process
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    hosts = HostGroup.create(EnginePlacement.from_env(tensor_parallel=1, cores=world))
    engine = TransformersEngine(model_dir, dtype="float32", device="cpu", batch_size=256, eos_token_ids=[])
    reward = build_reward("math", workers=1, timeout_s=10.0)
    cfg = RolloutConfig(
        group_size=args.group_size,
        max_new_tokens=args.max_new_tokens,
        shard_groups=args.shard_groups,
    )
    hosts.barrier()
    started, cpu_started = time.perf_counter(), time.process_time()
    identity = stage_identity(
        cfg=cfg,
        reward={"kind": "math"},
        prompts=prompts,
        stage=0,
        policy_version=0,
        seed=0,
        vocab_size=engine.vocab_size,
        engine_name=engine.name,
    )
    metrics = generate_planned(
        plan_stage(store_dir, identity, hosts),
        engine=engine,
        prompts=prompts,
        tokenizer=build_char_tokenizer(),
        reward_fn=reward,
        cfg=cfg,
        adv_eps=1e-6,
        store_dir=store_dir,
        seed=0,
        hosts=hosts,
    )
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    reward.close()
    tokens, most = metrics.get("perf/rollout_tokens", 0.0), metrics.get("perf/rollout_shards_max_per_engine", 0.0)
    results.put((rank, seconds, cpu, tokens, most))
    if world > 1:
        dist.destroy_process_group()


def run_engines(world: int, model_dir: Path, store_dir: Path, prompts, args) -> dict[str, float]:
    """Generate the stage on ``world`` engines: rank 0's wall seconds, tokens, most shards on one engine,
    and the largest CPU seconds any engine spent (the critical path when every engine has its own core)."""
    shutil.rmtree(store_dir, ignore_errors=True)
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    mp.start_processes(
        engine_process,
        args=(world, free_port(), str(model_dir), str(store_dir), prompts, args, results),
        nprocs=world,
        start_method="spawn",
    )
    reports = sorted(results.get() for _ in range(world))
    _, seconds, _, tokens, most = reports[0]
    return {"seconds": seconds, "tokens": tokens, "most_shards": most, "cpu_max": max(r[2] for r in reports)}


def checksums(store_dir: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(store_dir.glob("shard_*.arrow")):
        digest.update(Checksum.of_file(path).hexdigest.encode())
    return digest.hexdigest()


def main() -> None:
    args = parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        prompts = build_model(model_dir, args)
        rows = len(prompts) * args.group_size
        print(
            f"transformers engine, Qwen2 hidden={args.hidden} layers={args.layers}, {args.shards} shards x "
            f"{args.shard_groups} prompts x G={args.group_size} = {rows} responses of {args.max_new_tokens} tokens; "
            f"one torch thread per engine; {os.cpu_count()} CPUs; best of {args.repeats}"
        )
        best: dict[int, dict[str, float]] = {}
        sums: dict[int, str] = {}
        for _ in range(args.repeats):
            for engines in (1, 2):
                store = Path(tmp) / f"store_{engines}"
                result = run_engines(engines, model_dir, store, prompts, args)
                result["rate"] = result["tokens"] / result["seconds"]
                print(
                    f"  {engines} engine(s): {result['tokens']:.0f} tokens in {result['seconds']:.2f}s = "
                    f"{result['rate']:.1f} tokens/s (busiest engine {result['cpu_max']:.2f} CPU-s)"
                )
                if engines not in best or result["rate"] > best[engines]["rate"]:
                    best[engines] = result
                sums[engines] = checksums(store)
        for engines, result in sorted(best.items()):
            print(
                f"{engines} engine(s): {result['rate']:10.1f} tokens/s  "
                f"(most shards on one engine: {result['most_shards']:.0f})"
            )
        # On a busy machine wall time measures the other jobs too; the CPU seconds of the busiest engine
        # are what the wall time would be with one free core per engine.
        print(f"cpu_time_scaling={best[1]['cpu_max'] / best[2]['cpu_max']:.2f} (busiest engine's CPU seconds, 1 vs 2)")
        identical = sums[1] == sums[2]
        print(f"shard checksums identical: {identical}")
    print(f"engine_scaling={best[2]['rate'] / best[1]['rate']:.2f} identical={str(identical).lower()}")


if __name__ == "__main__":
    main()
