"""Which rank trains and which generates: the pure role split, and its errors."""

from __future__ import annotations

import pytest

from megatron_mugrpo.asynchronous.roles import LaunchError, split_roles
from megatron_mugrpo.errors import InputError


def roles(world: int, mode: str = "async", rollout_ranks: int = 1, model_parallel: int = 1) -> list:
    return [
        split_roles(rank=r, world_size=world, mode=mode, rollout_ranks=rollout_ranks, model_parallel=model_parallel)
        for r in range(world)
    ]


def test_staged_mode_trains_on_every_rank() -> None:
    assert all(role.is_trainer and role.trainer_world == 4 for role in roles(4, mode="staged"))
    assert roles(1, mode="staged")[0].is_trainer


def test_async_puts_the_workers_on_the_last_ranks() -> None:
    split = roles(4, rollout_ranks=2)
    assert [role.is_worker for role in split] == [False, False, True, True]
    assert [role.worker_index for role in split[2:]] == [0, 1]
    assert {role.trainer_world for role in split} == {2} and {role.num_workers for role in split} == {2}
    assert split[0].describe() == "trainer rank 0" and split[3].describe() == "rollout worker 1 (rank 3)"
    with pytest.raises(ValueError, match="trainer rank"):
        _ = split[0].worker_index


def test_trainer_ranks_must_fill_the_model_parallel_grid() -> None:
    assert roles(5, rollout_ranks=1, model_parallel=2)[4].is_worker  # 4 trainers = TP 2 × DP 2
    with pytest.raises(LaunchError, match=r"3 trainer ranks .* not a multiple of .* = 2"):
        roles(4, rollout_ranks=1, model_parallel=2)


@pytest.mark.parametrize(
    ("world", "rollout_ranks", "message"),
    [
        (1, 1, "this launch has a single process: start it with `torchrun --nproc_per_node N"),
        (2, 2, "async.rollout_ranks=2 leaves no trainer among the 2 processes"),
        (3, 5, "async.rollout_ranks=5 leaves no trainer"),
    ],
)
def test_impossible_async_launches_are_clear_input_errors(world: int, rollout_ranks: int, message: str) -> None:
    with pytest.raises(InputError, match=message.replace("(", r"\(").replace("`", ".")):
        split_roles(rank=0, world_size=world, mode="async", rollout_ranks=rollout_ranks, model_parallel=1)
