"""Groups of episodes and their scores, with a stand-in engine (the real one is tests/envs/test_multiturn.py)."""

from __future__ import annotations

import json

import pytest

from megatron_mugrpo.envs.base import EnvLimits, Problem
from megatron_mugrpo.envs.episodes import policy_text, run_episodes, score_episodes
from megatron_mugrpo.envs.trajectory import Trajectory
from megatron_mugrpo.rewards.qa import QaOptions, QaReward

TEXT = {1: "<answer>Paris</answer>", 2: "<search>q</search>", 3: "<information><answer>Rome</answer></information>"}


def decode(ids):
    return "".join(TEXT.get(i, "x") for i in ids)


class Env:
    stop_strings = ("</search>", "</answer>")

    def __init__(self):
        self.started = []

    def start(self, problem):
        self.started.append(problem)
        return ("episode", len(self.started))


class Engine:
    """Gives episode k the trajectory SCRIPT[k % 3]."""

    SCRIPT = (
        ([2, 3, 1], [1, 0, 1], [(0, 1), (2, 3)], "answered"),
        ([2, 3], [1, 0], [(0, 1)], "max_turns"),  # the observation holds an <answer>: never the policy's
        ([2], [1], [(0, 1)], "env_timeout"),
    )

    def generate_trajectories(self, prompts, episodes, params, *, limits, decode, stop_strings=()):
        self.call = (prompts, episodes, params, limits, stop_strings)
        out = []
        for _, k in episodes:
            ids, mask, turns, reason = self.SCRIPT[(k - 1) % 3]
            out.append(
                Trajectory(token_ids=ids, policy_mask=mask, logprobs=[-1.0] * sum(mask), turns=turns, end_reason=reason)
            )
        return out


def test_episodes_are_grouped_by_problem_and_scored_on_the_policy_text():
    env, engine = Env(), Engine()
    problems = [Problem(prompt="p0", answer='["Paris"]'), Problem(prompt="p1", answer='["Rome"]')]
    groups = run_episodes(engine, env, problems, [[5, 6], [7]], n=3, params="params", limits=EnvLimits(), decode=decode)
    assert env.started == [problems[0]] * 3 + [problems[1]] * 3
    prompts, episodes, params, limits, stops = engine.call
    assert prompts == [[5, 6]] * 3 + [[7]] * 3 and stops == Env.stop_strings and params == "params"
    assert [k for _, k in episodes] == [1, 2, 3, 4, 5, 6] and isinstance(limits, EnvLimits)
    assert [[t.end_reason for t in g] for g in groups] == [["answered", "max_turns", "env_timeout"]] * 2
    assert policy_text(groups[0][0], decode) == "<search>q</search><answer>Paris</answer>"
    scores = score_episodes(
        QaReward(workers=1, timeout_s=1.0, options=QaOptions()), groups, [p.answer for p in problems], decode
    )
    assert [[tuple(s) for s in g] for g in scores] == [
        [(1.0, "correct"), (0.0, "max_turns"), (0.0, "env_timeout")],
        [(0.0, "wrong_answer"), (0.0, "max_turns"), (0.0, "env_timeout")],  # Rome is only in the observation
    ]
    assert json.loads(problems[1].answer) == ["Rome"]


def test_mismatched_inputs_are_refused():
    with pytest.raises(ValueError, match="2 problems but 1 prompts"):
        run_episodes(
            Engine(),
            Env(),
            [Problem(prompt="a", answer="b")] * 2,
            [[1]],
            n=1,
            params=None,
            limits=EnvLimits(),
            decode=decode,
        )
    with pytest.raises(ValueError, match="n=0"):
        run_episodes(Engine(), Env(), [], [], n=0, params=None, limits=EnvLimits(), decode=decode)
    with pytest.raises(ValueError, match="1 groups but 0 answers"):
        score_episodes(None, [[]], [], decode)
