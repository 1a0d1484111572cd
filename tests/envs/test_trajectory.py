"""Trajectory bookkeeping without a model: the builder's turns and reasons, metrics and the error budget."""

from __future__ import annotations

import pytest

from megatron_mugrpo.envs.base import EnvError, EnvLimits, StepResult
from megatron_mugrpo.envs.trajectory import Trajectory, TrajectoryBuilder, check_error_budget, trajectory_metrics


def builder(**limits):
    return TrajectoryBuilder(prompt_length=3, episode=None, limits=EnvLimits(**limits), max_turn_tokens=2)


def test_the_builder_interleaves_turns_and_observations():
    row = builder()
    row.add_sampled(7, -0.5)
    assert not row.turn_over(eos=False, stopped=False)
    row.add_sampled(8, -1.5)
    assert row.turn_over(eos=False, stopped=False)  # the turn's token cap
    assert row.apply(StepResult(observation_ids=(20, 21, 22), done=False, seconds=0.25, info={"tool_calls": 1})) == [
        20,
        21,
        22,
    ]
    row.add_sampled(9, -0.25)
    assert row.turn_over(eos=False, stopped=True)  # a stop string
    row.apply(StepResult(done=True, reason="answered", seconds=0.5))
    trajectory = row.build()
    assert trajectory.token_ids == [7, 8, 20, 21, 22, 9]
    assert trajectory.policy_mask == [1, 1, 0, 0, 0, 1]
    assert trajectory.turns == [(0, 2), (5, 6)]
    assert trajectory.aligned_logprobs() == [-0.5, -1.5, 0.0, 0.0, 0.0, -0.25]
    assert (trajectory.end_reason, trajectory.tool_calls, trajectory.env_seconds) == ("answered", 1, [0.25, 0.5])


def test_eos_and_the_token_budget_end_the_trajectory_without_the_environment():
    row = builder()
    row.add_sampled(2, -0.1)
    assert not row.turn_over(eos=True, stopped=False) and row.build().end_reason == "stop"
    row = builder(max_total_tokens=4)
    row.add_sampled(5, -0.1)  # 3 prompt tokens + 1 = the budget, mid-turn
    assert not row.turn_over(eos=False, stopped=False) and row.build().end_reason == "max_total_tokens"
    assert row.build().turns == [(0, 1)]
    with pytest.raises(RuntimeError, match="once its episode has ended"):
        builder().build()


def trajectory(reason, turns=1, tool_calls=0, seconds=(), error=None):
    return Trajectory(
        token_ids=[1, 2, 3],
        policy_mask=[1, 0, 1],
        logprobs=[-1.0, -2.0],
        turns=[(0, 1), (2, 3)][:turns],
        end_reason=reason,
        env_seconds=list(seconds),
        tool_calls=tool_calls,
        error=error,
    )


def test_metrics():
    metrics = trajectory_metrics(
        [trajectory("answered", 2, 1, (0.5, 0.25)), trajectory("env_timeout", 1, 0, (2.0,), "no answer")]
    )
    assert metrics == {
        "rollout/turns_mean": 1.5,
        "rollout/tool_calls_mean": 0.5,
        "rollout/env_seconds": 2.75,
        "rollout/env_errors": 1.0,
        "rollout/policy_tokens_mean": 2.0,
        "rollout/observation_tokens_mean": 1.0,
    }
    assert trajectory_metrics([]) == {}


def test_the_error_budget_names_the_environment_and_its_last_error():
    stage = [trajectory("answered")] * 8 + [trajectory("env_error", error="HTTP 500")]
    check_error_budget(stage, 0.2, "search")  # 1 of 9 <= 20%
    stage += [trajectory("env_timeout", error="no answer within env.timeout_s=30.0")]
    with pytest.raises(EnvError, match=r"2 of 10 trajectories failed in environment 'search'.*env_timeout: no answer"):
        check_error_budget(stage, 0.1, "search")
