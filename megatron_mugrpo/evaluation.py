"""Held-out evaluation: pass@1 and pass@k over k samples per problem, spread over every engine host.

For each benchmark, every problem is sampled k times at the evaluation temperature and scored by
its reward (``reward`` of the benchmark; default the run's ``reward.kind``). A sample is correct
when its reward is 1 (for code: every test passed, also when ``reward.code.partial`` grades
fractions). Per benchmark the log holds ``eval/<benchmark>/pass@1`` (mean correctness; the paper:
k = 16 for AIME, 4 for AMC and MATH-500), ``eval/<benchmark>/pass@<K>`` for ``pass_k`` = K (the
unbiased estimator, ``algorithms/pass_at_k.py``; the paper's coding run: LiveCodeBench pass@4),
``eval/<benchmark>/test_pass_rate`` when the reward runs tests (the mean fraction of tests
passed), and ``eval/avg_pass@1``, the average over benchmarks that picks the best checkpoint.

The work is cut into fixed chunks of ``eval.chunk_problems`` problems, each sampled with a seed
derived from (seed, benchmark, chunk); hosts take chunks round-robin, score them with their own
reward pool, and rank 0 gathers the per-problem rewards. The result does not depend on how many
engines took part (bitwise with the seeded transformers engine on CPU at equal threads per engine).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from megatron_mugrpo.algorithms.pass_at_k import pass_at_k
from megatron_mugrpo.envs.episodes import StageEnv, episode_samples, stage_env
from megatron_mugrpo.errors import require
from megatron_mugrpo.metric_names import EVAL_AVG, EVAL_PREFIX, PASS_AT_1_SUFFIX
from megatron_mugrpo.rewards.registry import RewardFn
from megatron_mugrpo.rollout.engine import RolloutEngine, SamplingParams, derive_seed
from megatron_mugrpo.rollout.placement import EnginePlacement, HostGroup
from megatron_mugrpo.rollout.prompts import DATA_FORMATS, PromptRecord

AVG_KEY = EVAL_AVG  # named in metric_names, which the report reads it from


@dataclass(kw_only=True)
class BenchmarkConfig:
    """One evaluation benchmark: a local JSONL/Parquet file (or 'builtin')."""

    name: str
    """Names the metrics: ``eval/<name>/pass@1``."""
    path: str
    """Local file, or 'builtin' for the held-out split of the built-in task."""
    k: int = 4
    """Samples per problem; pass@1 is averaged over them (paper: 16 for AIME, 4 for AMC/MATH-500)."""
    pass_k: int = 0
    """Also report pass@<pass_k> (the unbiased estimator over the k samples); 0: pass@k."""
    format: str = "problems"
    """How the file's rows are read: 'problems' (prompt_field / answer_field), 'code_contests' or
    'livecodebench' (ignored for 'builtin')."""
    reward: str = ""
    """The reward kind that scores this benchmark ('math', 'code'); empty: the run's reward.kind."""
    prompt_field: str = "problem"
    """Column holding the problem text."""
    answer_field: str = "answer"
    """Column holding the reference answer."""
    limit: int = 0
    """Evaluate at most this many problems (0: all)."""

    def __post_init__(self) -> None:
        require(self.k >= 1, f"eval benchmark {self.name!r}: k={self.k} must be >= 1")
        require(
            0 <= self.pass_k <= self.k,
            f"eval benchmark {self.name!r}: pass_k={self.pass_k} must be in [0, k={self.k}] (pass@k needs k samples)",
        )
        require(
            self.format in DATA_FORMATS,
            f"eval benchmark {self.name!r}: format={self.format!r} is not one of {DATA_FORMATS}",
        )
        if self.path != "builtin":
            require(Path(self.path).is_file(), f"eval benchmark {self.name!r}: path {self.path!r} does not exist")


@dataclass(kw_only=True)
class EvalConfig:
    """``eval.*``: held-out evaluation, pass@1 averaged over k samples, every N updates."""

    every_updates: int = 0
    """Evaluate every N optimizer updates (0: only before training and at the end of each stage)."""
    benchmarks: list[BenchmarkConfig] = field(default_factory=list)
    """The benchmarks evaluated (none: no evaluation)."""
    temperature: float = 1.0
    """Sampling temperature of the evaluation samples."""
    max_new_tokens: int = 512
    """Response length cap of the evaluation samples."""
    chunk_problems: int = 32
    """Problems per unit of evaluation work (one engine call with its own derived seed). Chunks are
    spread over the engine hosts; smaller ones spread a small benchmark over more engines, larger ones
    give each engine bigger batches. Results do not depend on the engine count."""

    def __post_init__(self) -> None:
        require(self.every_updates >= 0, f"eval.every_updates={self.every_updates} must be >= 0")
        require(self.chunk_problems >= 1, f"eval.chunk_problems={self.chunk_problems} must be >= 1")
        require(self.temperature > 0, f"eval.temperature={self.temperature} must be > 0")


@dataclass(kw_only=True)
class Benchmark:
    """One loaded benchmark: its config, its tokenised problems and the reward that scores them."""

    config: BenchmarkConfig
    problems: list[PromptRecord]
    reward_fn: RewardFn


@dataclass(frozen=True)
class EvalChunk:
    """A unit of evaluation work: problems [start, stop) of benchmark ``bench``."""

    bench: int
    start: int
    stop: int


@dataclass(kw_only=True)
class ChunkResult:
    """What a host sends rank 0 for one chunk: rewards per problem (k each) and response lengths."""

    chunk: EvalChunk
    rewards: list[list[float]]
    lengths: list[int]
    pass_fractions: list[float] = field(default_factory=list)
    """Fraction of tests passed per sample, from rewards that run tests (empty for the others)."""


def pass_at_1(rewards_per_problem: Sequence[Sequence[float]]) -> float:
    """Mean over problems of the mean reward of that problem's samples."""
    if not rewards_per_problem:
        raise ValueError("pass_at_1 needs at least one problem")
    return sum(sum(r) / len(r) for r in rewards_per_problem) / len(rewards_per_problem)


def eval_chunks(benchmarks: Sequence[Benchmark], chunk_problems: int) -> list[EvalChunk]:
    """Every benchmark's problems in consecutive chunks of ``chunk_problems`` (the last may be shorter)."""
    return [
        EvalChunk(b, start, min(start + chunk_problems, len(bench.problems)))
        for b, bench in enumerate(benchmarks)
        for start in range(0, len(bench.problems), chunk_problems)
    ]


def evaluate_chunk(
    engine: RolloutEngine,
    bench: Benchmark,
    chunk: EvalChunk,
    *,
    tokenizer,
    eval_cfg: EvalConfig,
    seed: int,
    env: StageEnv | None = None,
) -> ChunkResult:
    """Sample k responses for each problem of ``chunk`` and score them; with ``env``, k multi-turn
    trajectories each, scored on the policy's own turns (``envs.episodes.episode_samples``), their length
    the policy's tokens."""
    params = SamplingParams(
        max_new_tokens=eval_cfg.max_new_tokens,
        temperature=eval_cfg.temperature,
        seed=derive_seed(seed, chunk.bench, chunk.start),
    )
    problems = bench.problems[chunk.start : chunk.stop]
    k = bench.config.k
    if env is not None:
        decode = partial(tokenizer.decode, skip_special_tokens=True)
        groups = episode_samples(
            engine,  # type: ignore[arg-type]  # the config allows multi-turn engines only
            env,
            problems,
            group_size=k,
            params=params,
            decode=decode,
            reward_fn=bench.reward_fn,
        )
        lengths = [sum(s.policy_mask or []) for group in groups for s in group]
        return ChunkResult(chunk=chunk, rewards=[[s.reward for s in group] for group in groups], lengths=lengths)
    generations = engine.generate([p.prompt_ids for p in problems], k, params)
    texts, answers, lengths = [], [], []
    for problem, gens in zip(problems, generations, strict=True):
        for gen in gens:
            texts.append(tokenizer.decode(gen.response_ids, skip_special_tokens=True))
            answers.append(problem.answer)
            lengths.append(len(gen.response_ids))
    results = bench.reward_fn.score(texts, answers)
    scores = [reward for reward, _ in results]
    fractions = [f for f in (getattr(r, "pass_fraction", None) for r in results) if f is not None]
    rewards = [scores[i * k : (i + 1) * k] for i in range(len(problems))]
    return ChunkResult(chunk=chunk, rewards=rewards, lengths=lengths, pass_fractions=fractions)


def evaluate(
    engine: RolloutEngine | None,
    benchmarks: Sequence[Benchmark],
    *,
    tokenizer,
    eval_cfg: EvalConfig,
    seed: int,
    hosts: HostGroup | None = None,
    env: Any = None,
) -> dict[str, float]:
    """Every benchmark's metrics plus ``eval/avg_pass@1`` on rank 0 (``{}`` elsewhere and without
    benchmarks). Collective over ``hosts``: hosts pass their engine, other ranks ``engine=None``.
    ``env``: the run's ``env`` section; when enabled, problems are solved as multi-turn trajectories
    against the environment, which each host holds for this call (as a rollout phase does)."""
    hosts = hosts or HostGroup(EnginePlacement.single())
    placement = hosts.placement
    results: list[ChunkResult] = []
    if placement.is_host and engine is not None:
        chunks = eval_chunks(benchmarks, eval_cfg.chunk_problems)[placement.engine_index :: placement.num_engines]
        with stage_env(env, tokenizer) as stage:
            results = [
                evaluate_chunk(
                    engine, benchmarks[c.bench], c, tokenizer=tokenizer, eval_cfg=eval_cfg, seed=seed, env=stage
                )
                for c in chunks
            ]
    gathered = hosts.gather(results)
    if gathered is None or not benchmarks:
        return {}
    return benchmark_metrics(benchmarks, [r for per_rank in gathered for r in per_rank])


def benchmark_metrics(benchmarks: Sequence[Benchmark], results: Sequence[ChunkResult]) -> dict[str, float]:
    """pass@1, pass@K, the test pass rate (rewards that run tests) and the mean response length per
    benchmark, and their average pass@1, from every chunk."""
    ordered = sorted(results, key=lambda r: (r.chunk.bench, r.chunk.start))
    metrics: dict[str, float] = {}
    for b, bench in enumerate(benchmarks):
        mine = [r for r in ordered if r.chunk.bench == b]
        rewards = [problem for r in mine for problem in r.rewards]
        lengths = [n for r in mine for n in r.lengths]
        if len(rewards) != len(bench.problems):
            raise RuntimeError(f"evaluation of {bench.config.name!r} returned {len(rewards)} of {len(bench.problems)}")
        name, k = bench.config.name, bench.config.k
        correct = [sum(r >= 1.0 for r in problem) for problem in rewards]
        key = EVAL_PREFIX + name  # eval/<benchmark>/<stat>
        metrics[key + PASS_AT_1_SUFFIX] = pass_at_1([[float(r >= 1.0) for r in problem] for problem in rewards])
        pass_k = bench.config.pass_k or k
        if pass_k > 1:
            metrics[f"{key}/pass@{pass_k}"] = sum(pass_at_k(k, c, pass_k) for c in correct) / len(correct)
        fractions = [f for r in mine for f in r.pass_fractions]
        if fractions:
            metrics[f"{key}/test_pass_rate"] = sum(fractions) / len(fractions)
        metrics[f"{key}/response_len_mean"] = sum(lengths) / len(lengths)
    pass_at_1s = [metrics[EVAL_PREFIX + b.config.name + PASS_AT_1_SUFFIX] for b in benchmarks]
    metrics[AVG_KEY] = sum(pass_at_1s) / len(pass_at_1s)
    return metrics
