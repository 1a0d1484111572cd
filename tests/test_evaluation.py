"""pass@1 averaging and stage prompt selection (evaluation through the engine runs in tests/e2e)."""

from __future__ import annotations

import pytest

from megatron_mugrpo.evaluation import pass_at_1
from megatron_mugrpo.rollout.prompts import PromptRecord, stage_prompts


def test_pass_at_1_averages_per_problem_then_over_problems():
    # problem 1: 3 of 4 right; problem 2: 0 of 4; problem 3: 4 of 4 → (0.75 + 0 + 1) / 3
    assert pass_at_1([[1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]]) == pytest.approx(1.75 / 3)
    with pytest.raises(ValueError):
        pass_at_1([])


def _records(n: int) -> list[PromptRecord]:
    return [PromptRecord(prompt_id=str(i), prompt_ids=[1, i], answer=str(i), text=str(i)) for i in range(n)]


def test_stage_prompts_are_seeded_slices_of_epoch_permutations():
    prompts = _records(10)
    stage0, stage1 = stage_prompts(prompts, 0, 4, seed=3), stage_prompts(prompts, 1, 4, seed=3)
    assert stage0 == stage_prompts(prompts, 0, 4, seed=3)  # deterministic
    assert len({p.prompt_id for p in stage0 + stage1}) == 8  # no repeats within an epoch
    # Stage 2 crosses the epoch boundary: 2 prompts from epoch 0, 2 from epoch 1's permutation.
    stage2 = stage_prompts(prompts, 2, 4, seed=3)
    assert len(stage2) == 4
    assert {p.prompt_id for p in stage0 + stage1 + stage2[:2]} == {str(i) for i in range(10)}
    assert stage_prompts(prompts, 0, 4, seed=4) != stage0


def _bench(name: str, n: int, k: int, pass_k: int = 0):
    from megatron_mugrpo.evaluation import Benchmark, BenchmarkConfig

    return Benchmark(
        config=BenchmarkConfig(name=name, path="builtin", k=k, pass_k=pass_k), problems=_records(n), reward_fn=None
    )


def test_benchmark_metrics_report_pass_at_1_pass_at_k_and_the_test_pass_rate():
    """Two problems, 4 samples each. Problem 0: 1 of 4 full passes; problem 1: none, but partial
    rewards (reward.code.partial) of 0.5 are not passes. pass@1 = (1/4 + 0) / 2; pass@2 with
    n = 4, c = 1 is 1 − C(3,2)/C(4,2) = 1 − 3/6 = 0.5, so the benchmark's pass@2 = (0.5 + 0) / 2."""
    from megatron_mugrpo.evaluation import ChunkResult, EvalChunk, benchmark_metrics

    bench = _bench("code", n=2, k=4, pass_k=2)
    result = ChunkResult(
        chunk=EvalChunk(0, 0, 2),
        rewards=[[1.0, 0.0, 0.0, 0.0], [0.5, 0.5, 0.0, 0.0]],
        lengths=[10] * 8,
        pass_fractions=[1.0, 0.0, 0.0, 0.0, 0.5, 0.5, 0.0, 0.0],
    )
    metrics = benchmark_metrics([bench], [result])
    assert metrics["eval/code/pass@1"] == pytest.approx(0.125)
    assert metrics["eval/code/pass@2"] == pytest.approx(0.25)
    assert metrics["eval/code/test_pass_rate"] == pytest.approx(2.0 / 8)
    assert metrics["eval/avg_pass@1"] == metrics["eval/code/pass@1"]


def test_math_benchmarks_report_pass_at_k_for_their_k_and_no_test_pass_rate():
    from megatron_mugrpo.evaluation import ChunkResult, EvalChunk, benchmark_metrics

    result = ChunkResult(chunk=EvalChunk(0, 0, 1), rewards=[[1.0, 0.0]], lengths=[3, 4])
    metrics = benchmark_metrics([_bench("math", n=1, k=2)], [result])
    assert metrics == {
        "eval/math/pass@1": 0.5,
        "eval/math/pass@2": 1.0,
        "eval/math/response_len_mean": 3.5,
        "eval/avg_pass@1": 0.5,
    }
