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
