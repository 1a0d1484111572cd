"""Multi-turn rollout wall clock with the environment's calls waited for (``env.overlap=never``) and overlapped
with decoding (``env.overlap=always``), side by side, at a few environment latencies.

The transformers engine decodes --rows trajectories of a random tiny Qwen2 (EOS off) against an environment
that sleeps --latency-s per call, as ``env.search.latency_s`` makes the search environment do, then answers
with a seeded observation of 1..--observation-tokens ids and ends the episode after --turns turns. A turn ends
at a stop id (one id in --stop-every renders as the stop string, so turns end at different steps in different
rows, as real turns do) or at --max-new-tokens. Waiting, every step at which some row's turn ended waits for
that call; overlapped, only the rows whose calls run wait (``TransformersEngine.generate_trajectories``).
Each setting is the best of --repeats runs, the two modes interleaved.

    nice -n 19 python benchmarks/env_overlap.py                   # about a minute on 2 CPU cores

Last line: ``speedup@<latency>=<waiting wall / overlapped wall>`` for each latency (>1: overlap is faster).
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import time
from pathlib import Path

import torch
from common import tiny_model_dir

from megatron_mugrpo.envs.base import EnvLimits, StepResult, Turn
from megatron_mugrpo.envs.trajectory import Trajectory
from megatron_mugrpo.rollout.engine import SamplingParams
from megatron_mugrpo.rollout.transformers_engine import TransformersEngine

STOP = "|"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--latency-s", type=float, nargs="+", default=[0.0, 0.02, 0.1], help="seconds per env call")
    parser.add_argument("--rows", type=int, default=32, help="trajectories, decoded as one batch")
    parser.add_argument("--turns", type=int, default=4, help="policy turns per trajectory (the last one answers)")
    parser.add_argument("--max-new-tokens", type=int, default=24, help="turn cap")
    parser.add_argument("--stop-every", type=int, default=8, help="one id in N ends a turn")
    parser.add_argument("--observation-tokens", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2, help="best of N runs per setting (noise)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (the machine is shared)")
    args = parser.parse_args()
    if min(args.latency_s) < 0 or args.rows < 1 or args.turns < 1 or args.stop_every < 1 or args.repeats < 1:
        parser.error("--latency-s must be >= 0; --rows, --turns, --stop-every and --repeats >= 1")
    return args


class SlowEpisode:
    """Sleeps ``latency_s`` per call (a search server's round trip), writes a seeded observation, and answers
    at turn ``turns``."""

    def __init__(self, seed: int, *, latency_s: float, turns: int, observation_tokens: int, vocab: int) -> None:
        self.rng, self.latency_s, self.turns = random.Random(seed), latency_s, turns
        self.observation_tokens, self.vocab, self.calls = observation_tokens, vocab, 0

    def step(self, turn: Turn) -> StepResult:
        self.calls += 1
        time.sleep(self.latency_s)
        if self.calls >= self.turns:
            return StepResult(done=True, reason="answered")
        size = self.rng.randint(1, self.observation_tokens)
        observation = tuple(self.rng.randrange(3, self.vocab) for _ in range(size))
        return StepResult(observation_ids=observation, done=False, info={"tool_calls": 1})


def rollout(engine: TransformersEngine, args: argparse.Namespace, latency_s: float, overlap: bool) -> list[Trajectory]:
    vocab, stop_every = engine.vocab_size, args.stop_every

    def decode(ids: list[int]) -> str:
        return "".join(STOP if i % stop_every == 0 else "a" for i in ids)

    episodes = [
        SlowEpisode(r, latency_s=latency_s, turns=args.turns, observation_tokens=args.observation_tokens, vocab=vocab)
        for r in range(args.rows)
    ]
    prompts = [[1 + (r + k) % (vocab - 1) for k in range(8 + r % 5)] for r in range(args.rows)]
    limits = EnvLimits(max_turns=args.turns, max_observation_tokens=args.observation_tokens, max_total_tokens=1024)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0, seed=0)
    return engine.generate_trajectories(
        prompts, episodes, params, limits=limits, decode=decode, stop_strings=(STOP,), overlap=overlap
    )


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        path = tiny_model_dir(Path(tmp) / "model", hidden=args.hidden, layers=args.layers, max_positions=1024)
        engine = TransformersEngine(path, dtype="float32", device="cpu", batch_size=args.rows, eos_token_ids=[])
        rollout(engine, args, 0.0, overlap=False)  # warm-up: first-call allocations stay out of the timings
        print(
            f"rows={args.rows} turns={args.turns} max_new_tokens={args.max_new_tokens} threads={args.threads} "
            f"cpus={os.cpu_count()} load={os.getloadavg()[0]:.2f}"
        )
        speedups = []
        for latency in args.latency_s:
            seconds = {False: float("inf"), True: float("inf")}
            for _ in range(args.repeats):  # interleaved: a change of load hits both modes alike
                for overlap in (False, True):
                    start = time.perf_counter()
                    trajectories = rollout(engine, args, latency, overlap)
                    seconds[overlap] = min(seconds[overlap], time.perf_counter() - start)
            policy = sum(sum(t.policy_mask) for t in trajectories)
            calls = sum(len(t.env_seconds) for t in trajectories)
            print(
                f"latency_s={latency:g}: waiting {seconds[False]:.2f} s, overlapped {seconds[True]:.2f} s "
                f"(last run: {policy} policy tokens, {calls} env calls = {calls * latency:.1f} s of env time summed)"
            )
            speedups.append(f"speedup@{latency:g}={seconds[False] / seconds[True]:.2f}")
    print(" ".join(speedups))


if __name__ == "__main__":
    main()
