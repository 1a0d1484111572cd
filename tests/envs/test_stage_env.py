"""A rollout stage's environment: built for the phase and stopped after it, trajectories turned into scored
samples, the error budget enforced before a shard is written, and the env metrics summed over hosts."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from megatron_mugrpo.char_tokenizer import build_char_tokenizer
from megatron_mugrpo.envs.base import EnvError, EnvLimits
from megatron_mugrpo.envs.episodes import EnvTally, StageEnv, env_metrics, episode_samples, stage_env
from megatron_mugrpo.envs.registry import EnvConfig
from megatron_mugrpo.envs.search import SearchOptions
from megatron_mugrpo.envs.trajectory import Trajectory
from megatron_mugrpo.rewards.qa import QaOptions, QaReward
from megatron_mugrpo.rollout.prompts import PromptRecord

OBSERVATION = "<information>Paris</information>"


def decode(ids):
    return "".join(chr(i) for i in ids)


def ids(text):
    return [ord(c) for c in text]


class Env:
    stop_strings = ("</answer>",)

    def start(self, problem):
        return object()

    def close(self):
        pass


class Engine:
    """Hands back scripted trajectories: per row, (policy text, end reason, error)."""

    def __init__(self, script):
        self.script = script

    def generate_trajectories(self, prompts, episodes, params, *, limits, decode, stop_strings=()):
        out = []
        for (text, reason, error), _ in zip(self.script, prompts):
            turn, obs = ids(text), ids(OBSERVATION)
            out.append(
                Trajectory(
                    token_ids=turn + obs + turn,
                    policy_mask=[1] * len(turn) + [0] * len(obs) + [1] * len(turn),
                    logprobs=[-0.5] * (2 * len(turn)),
                    turns=[(0, len(turn)), (len(turn) + len(obs), 2 * len(turn) + len(obs))],
                    end_reason=reason,
                    env_seconds=[0.5, 0.25],
                    tool_calls=1,
                    error=error,
                )
            )
        return out


def record(i):
    return PromptRecord(prompt_id=f"q{i}", prompt_ids=[1, 2], answer='["Paris"]', text=f"question {i}")


def stage(max_error_frac=0.5):
    return StageEnv(env=Env(), name="search", limits=EnvLimits(), max_error_frac=max_error_frac)


REWARD = QaReward(workers=1, timeout_s=1.0, options=QaOptions())


def test_trajectories_become_scored_samples_with_their_masks():
    script = [("<answer>Paris</answer>", "answered", None), ("<answer>Rome</answer>", "answered", None)]
    script += [("<answer>Paris</answer>", "env_timeout", "no answer within 30 s"), ("x", "max_turns", None)]
    env = stage()
    groups = episode_samples(
        Engine(script), env, [record(0), record(1)], group_size=2, params=None, decode=decode, reward_fn=REWARD
    )
    flat = [s for g in groups for s in g]
    assert [(s.reward, s.reward_reason) for s in flat] == [
        (1.0, "correct"),
        (0.0, "wrong_answer"),
        (0.0, "env_timeout"),
        (0.0, "max_turns"),
    ]  # the timed-out one wrote the right answer: a failed trajectory scores 0 whatever its text
    first = flat[0]
    n = len(OBSERVATION)
    assert first.policy_mask.count(0) == n
    assert [lp for lp, m in zip(first.behaviour_logprobs, first.policy_mask) if not m] == [0.0] * n
    assert first.turns[1][0] == len("<answer>Paris</answer>") + n and first.env_seconds == [0.5, 0.25]
    metrics = env_metrics([env.tally.counts(sampling_s=4.0)])
    assert metrics["rollout/turns_mean"] == 2.0 and metrics["rollout/tool_calls_mean"] == 1.0
    assert metrics["rollout/env_seconds"] == 3.0 and metrics["rollout/env_errors"] == 1.0


def test_more_failures_than_the_budget_stop_the_stage_naming_the_env_and_its_last_error():
    script = [("a", "env_error", "ConnectionError: refused")] * 2 + [("<answer>Paris</answer>", "answered", None)] * 2
    with pytest.raises(EnvError, match=r"2 of 4 trajectories failed in environment 'search'.*ConnectionError: refused"):
        episode_samples(
            Engine(script),
            stage(0.25),
            [record(0), record(1)],
            group_size=2,
            params=None,
            decode=decode,
            reward_fn=REWARD,
        )
    episode_samples(
        Engine(script), stage(0.5), [record(0), record(1)], group_size=2, params=None, decode=decode, reward_fn=REWARD
    )  # at the budget: goes on


def test_env_metrics_sum_hosts_before_dividing():
    a, b = EnvTally(trajectories=2, turns=6, tool_calls=4), EnvTally(trajectories=6, turns=6, env_errors=1)
    metrics = env_metrics([a.counts(2.0), b.counts(6.0)])
    assert metrics["rollout/turns_mean"] == 12 / 8 and metrics["rollout/tool_calls_mean"] == 4 / 8
    assert metrics["rollout/env_errors"] == 1.0 and metrics["rollout/env_share"] == 0.0
    assert env_metrics([]) == {}


def test_the_stage_env_serves_its_corpus_on_loopback_and_stops_it(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps({"id": "1", "title": "Paris", "text": "Paris is in France."}) + "\n")
    with stage_env(EnvConfig(enabled=False), build_char_tokenizer()) as none:
        assert none is None
    settings = EnvConfig(enabled=True, search=SearchOptions(corpus=str(corpus)))
    with stage_env(settings, build_char_tokenizer()) as env:
        url = env.env.client.endpoint.removesuffix("/retrieve")
        with urllib.request.urlopen(url + "/health", timeout=5) as answer:
            assert json.loads(answer.read()) == {"documents": 1}
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(url + "/health", timeout=2)
