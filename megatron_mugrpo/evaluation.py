"""Held-out evaluation: pass@1 averaged over k samples per problem.

For each benchmark, every problem is sampled k times at the evaluation temperature and scored by
the same verifier as training; pass@1 is the mean reward over the k samples, averaged over
problems (the paper: k = 16 for AIME, 4 for AMC and MATH-500). Results are logged as
``eval/<benchmark>/pass@1`` and ``eval/avg_pass@1`` (the average over benchmarks, used to pick
the best checkpoint).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from megatron_mugrpo.config import BenchmarkConfig, EvalConfig
from megatron_mugrpo.rollout.engine import RolloutEngine, SamplingParams
from megatron_mugrpo.rollout.prompts import PromptRecord
from megatron_mugrpo.rollout.rewards import RewardFn

AVG_KEY = "eval/avg_pass@1"


@dataclass(kw_only=True)
class Benchmark:
    """One loaded benchmark: its config and its tokenised problems."""

    config: BenchmarkConfig
    problems: list[PromptRecord]


def pass_at_1(rewards_per_problem: Sequence[Sequence[float]]) -> float:
    """Mean over problems of the mean reward of that problem's samples."""
    if not rewards_per_problem:
        raise ValueError("pass_at_1 needs at least one problem")
    return sum(sum(r) / len(r) for r in rewards_per_problem) / len(rewards_per_problem)


def evaluate_benchmark(
    engine: RolloutEngine,
    bench: Benchmark,
    *,
    tokenizer,
    reward_fn: RewardFn,
    eval_cfg: EvalConfig,
    seed: int,
) -> dict[str, float]:
    """pass@1 and mean response length of one benchmark under the engine's current weights."""
    params = SamplingParams(max_new_tokens=eval_cfg.max_new_tokens, temperature=eval_cfg.temperature, seed=seed)
    generations = engine.generate([p.prompt_ids for p in bench.problems], bench.config.k, params)
    texts, answers, lengths = [], [], []
    for problem, gens in zip(bench.problems, generations, strict=True):
        for gen in gens:
            texts.append(tokenizer.decode(gen.response_ids, skip_special_tokens=True))
            answers.append(problem.answer)
            lengths.append(len(gen.response_ids))
    scores = [reward for reward, _ in reward_fn.score(texts, answers)]
    k = bench.config.k
    per_problem = [scores[i * k : (i + 1) * k] for i in range(len(bench.problems))]
    name = bench.config.name
    return {
        f"eval/{name}/pass@1": pass_at_1(per_problem),
        f"eval/{name}/response_len_mean": sum(lengths) / len(lengths),
    }


def evaluate(
    engine: RolloutEngine,
    benchmarks: Sequence[Benchmark],
    *,
    tokenizer,
    reward_fn: RewardFn,
    eval_cfg: EvalConfig,
    seed: int,
) -> dict[str, float]:
    """Every benchmark's metrics plus ``eval/avg_pass@1``; empty when there are no benchmarks."""
    metrics: dict[str, float] = {}
    for index, bench in enumerate(benchmarks):
        metrics |= evaluate_benchmark(
            engine, bench, tokenizer=tokenizer, reward_fn=reward_fn, eval_cfg=eval_cfg, seed=seed + index
        )
    if benchmarks:
        metrics[AVG_KEY] = sum(metrics[f"eval/{b.config.name}/pass@1"] for b in benchmarks) / len(benchmarks)
    return metrics
