"""Multi-turn trajectories on the SGLang engine (``SGLangEngine.generate_trajectories``), on CPU.

Against the stand-in ``sglang`` of the oldest and newest supported versions (``sglang_standin``, built from
the snapshots ``tools/sglang_contract.py`` read from the wheels): one request per turn over the prompt and
the trajectory so far, token in and token out, output log-probs only, the radix cache serving earlier turns,
no stop strings sent, each sampled turn replayed through the transformers engine's turn rules. The
stand-in's model is a bigram table, so a token's log-prob says which token came before it in the request.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest
import torch
from sglang_standin import bigram_logprobs, build_module, load_snapshot, snapshot_versions

from megatron_mugrpo.envs.base import EnvLimits, Problem, StepResult
from megatron_mugrpo.envs.episodes import run_episodes
from megatron_mugrpo.envs.registry import EnvConfig, run_env_problem
from megatron_mugrpo.envs.search import SearchOptions
from megatron_mugrpo.envs.trajectory import TrajectoryBuilder
from megatron_mugrpo.errors import ConfigError
from megatron_mugrpo.rollout import sglang_engine
from megatron_mugrpo.rollout.engine import SamplingParams
from megatron_mugrpo.rollout.sglang_engine import SGLangContractError, SGLangEngine, replay_turn, turn_from_output
from megatron_mugrpo.rollout.watchdog import WatchedEngine

VERSIONS = snapshot_versions()
VOCAB, EOS, POSITIONS = 32, 1, 64
STOP_IDS = range(24, 28)
"""Tokens ``decode`` renders as the stop string '|' (an eighth of the vocabulary: most turns end at one)."""
PROMPTS = [[3, 4, 5], [6, 7], [8, 9, 10, 11], [12, 2], [13, 14, 15, 16, 17]]
PARAMS = SamplingParams(max_new_tokens=6, temperature=0.8, seed=3)
TOLERANCE = 1e-6
"""float32 log_softmax of the same table row, computed twice."""


def decode(ids):
    return "".join("|" if i in STOP_IDS else chr(97 + i % 26) for i in ids)


def _model_dir(path: Path, *, eos=EOS, positions=POSITIONS) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(
        json.dumps({"vocab_size": VOCAB, "eos_token_id": eos, "max_position_embeddings": positions})
    )
    return path


class Episode:
    """Answers after three turns; its observations are seeded random ids of 1-4 tokens."""

    def __init__(self, seed):
        self.rng, self.turns, self.observations = random.Random(seed), [], []

    def step(self, turn):
        self.turns.append(turn)
        if len(self.turns) >= 3:
            return StepResult(done=True, reason="answered")
        observation = tuple(self.rng.randrange(2, 24) for _ in range(self.rng.randint(1, 4)))
        self.observations.append(observation)
        return StepResult(observation_ids=observation, done=False, info={"tool_calls": 1})


@pytest.fixture(params=VERSIONS)
def sglang(request, monkeypatch):
    module = build_module(load_snapshot(request.param))
    monkeypatch.setitem(sys.modules, "sglang", module)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv(sglang_engine.ORIGINAL_LOGPROB_ENV, raising=False)
    return module


def _rollout(engine, episodes, *, max_total_tokens=48):
    return engine.generate_trajectories(
        PROMPTS[: len(episodes)],
        episodes,
        PARAMS,
        limits=EnvLimits(max_total_tokens=max_total_tokens),
        decode=decode,
        stop_strings=("|",),
    )


def _requests(module):
    """(input_ids, sampling params, output) of every request the engines received, in order."""
    found = []
    for (_, name, args), answer in zip(module.recorder.calls, module.recorder.answers):
        if name == "generate":
            assert args["return_logprob"] is True and args.get("logprob_start_len") is None
            found += list(zip(args["input_ids"], args["sampling_params"], answer))
    return found


def test_trajectories_are_token_in_token_out(sglang, tmp_path):
    """Each turn is one request over prompt + trajectory so far; the trajectory is the sampled turns (cut at
    the stop string) and the observations, byte for byte; every policy token's log-prob is the
    teacher-forced one over that context; the radix cache serves the earlier turns."""
    engine = SGLangEngine(_model_dir(tmp_path / "m"), deterministic=True)
    episodes = [Episode(seed) for seed in range(len(PROMPTS))]
    trajectories = _rollout(engine, episodes)
    requests = _requests(sglang)
    assert {t.end_reason for t in trajectories} <= {"answered", "stop", "max_total_tokens"}
    assert sum(len(e.turns) for e in episodes) > len(PROMPTS), "some trajectory should have several turns"

    expected_inputs = []
    for prompt, trajectory, episode in zip(PROMPTS, trajectories, episodes):
        expected_inputs += [prompt + trajectory.token_ids[:start] for start, _ in trajectory.turns]
        env_turns = [list(t.token_ids) for t in episode.turns]
        assert [trajectory.token_ids[a:b] for a, b in trajectory.turns][: len(env_turns)] == env_turns
        for (_, end), observation in zip(trajectory.turns, episode.observations):
            assert tuple(trajectory.token_ids[end : end + len(observation)]) == observation
        mask = [0] * len(trajectory.token_ids)
        for a, b in trajectory.turns:
            mask[a:b] = [1] * (b - a)
        assert trajectory.policy_mask == mask
        for turn in env_turns:  # a turn the environment saw ended at its first stop string, or at the cap
            assert (decode(turn).endswith("|") and "|" not in decode(turn)[:-1]) or len(turn) == PARAMS.max_new_tokens
        reference = bigram_logprobs(prompt, trajectory.token_ids, vocab_size=VOCAB, version=0, temperature=0.8)
        policy = [lp for lp, m in zip(reference, trajectory.policy_mask) if m]
        assert torch.allclose(torch.tensor(trajectory.logprobs), torch.tensor(policy), atol=TOLERANCE, rtol=0)
    assert sorted(ids for ids, _, _ in requests) == sorted(expected_inputs)  # one request per turn, nothing else

    by_input = {tuple(ids): (params, output) for ids, params, output in requests}
    for prompt, trajectory in zip(PROMPTS, trajectories):
        for (start, end), (next_start, _) in zip(trajectory.turns, trajectory.turns[1:]):
            params, output = by_input[tuple(prompt + trajectory.token_ids[:start])]
            sampled = output["output_ids"]
            assert sampled[: end - start] == trajectory.token_ids[start:end]  # the turn is what SGLang sampled
            assert params["max_new_tokens"] <= PARAMS.max_new_tokens and "stop" not in params
            hit = by_input[tuple(prompt + trajectory.token_ids[:next_start])][1]["meta_info"]["cached_tokens"]
            assert hit >= len(prompt) + end - 1  # the earlier turns came from the radix cache
    seeds = [params["sampling_seed"] for _, params, _ in requests]
    assert len(set(seeds)) == len(seeds)  # one seed per (prompt, turn)


def test_asking_for_prompt_logprobs_would_stop_the_prefix_match(sglang, tmp_path):
    """Why the engine sends no logprob_start_len: SGLang's prefix match stops there (the snapshot's flag)."""
    SGLangEngine(_model_dir(tmp_path / "m"))
    standin = sglang.recorder.engines[0]
    prompt = [3, 4, 5, 6]
    first = standin.generate(input_ids=[prompt], sampling_params={"max_new_tokens": 4}, return_logprob=True)[0]
    context = prompt + first["output_ids"][:2] + [7]
    again = standin.generate(input_ids=[context], sampling_params={"max_new_tokens": 2}, return_logprob=True)[0]
    full = standin.generate(
        input_ids=[context], sampling_params={"max_new_tokens": 2}, return_logprob=True, logprob_start_len=0
    )[0]
    assert again["meta_info"]["cached_tokens"] == len(prompt) + 2
    assert full["meta_info"]["cached_tokens"] == 0


def test_trajectories_are_reproducible_and_independent_of_their_batch(sglang, tmp_path):
    """Deterministic mode: a trajectory depends on its seed, prompt and environment, not on the others."""
    engine = SGLangEngine(_model_dir(tmp_path / "m"), deterministic=True)
    both = _sampled(_rollout(engine, [Episode(seed) for seed in range(3)]))
    alone = _sampled(_rollout(engine, [Episode(0)]))
    assert alone[0] == both[0]
    assert _sampled(_rollout(engine, [Episode(seed) for seed in range(3)])) == both


def _sampled(trajectories):
    """What sampling decides (not the environment's seconds)."""
    return [(t.token_ids, t.policy_mask, t.logprobs, t.turns, t.end_reason) for t in trajectories]


def test_the_budget_caps_each_turn_and_ends_the_trajectory(sglang, tmp_path):
    engine = SGLangEngine(_model_dir(tmp_path / "m"))
    trajectories = _rollout(engine, [Episode(seed) for seed in range(len(PROMPTS))], max_total_tokens=10)
    for prompt, trajectory in zip(PROMPTS, trajectories):
        assert len(prompt) + len(trajectory.token_ids) <= 10
    for ids, params, _ in _requests(sglang):
        assert len(ids) + params["max_new_tokens"] <= 10


def test_the_context_length_bounds_the_token_budget(sglang, tmp_path):
    """0.5.10 refuses a request whose input + max_new_tokens reaches the context length: the budget stays below."""
    engine = SGLangEngine(_model_dir(tmp_path / "m", positions=20))
    with pytest.raises(ConfigError, match=r"env\.max_total_tokens=20 must be below"):
        _rollout(engine, [Episode(0)], max_total_tokens=20)
    assert _rollout(engine, [Episode(0)], max_total_tokens=19)


def test_the_standin_finishes_and_refuses_by_the_snapshot(sglang, tmp_path):
    """The stand-in keeps its version's rules: an EOS at the cap is 'length' in 0.5.10 and 'stop' in 0.5.23; a
    request reaching the context length is refused by 0.5.10 only."""
    SGLangEngine(_model_dir(tmp_path / "m", eos=list(range(VOCAB)), positions=8))  # every token is EOS
    standin, flags = sglang.recorder.engines[0], load_snapshot(sglang.__version__)["flags"]
    out = standin.generate(input_ids=[[3, 4]], sampling_params={"max_new_tokens": 1}, return_logprob=True)[0]
    finish = out["meta_info"]["finish_reason"]
    assert finish["type"] == ("length" if flags["eos_at_cap_finishes_as_length"] else "stop")
    out = standin.generate(input_ids=[[3, 4]], sampling_params={"max_new_tokens": 3}, return_logprob=True)[0]
    assert out["meta_info"]["finish_reason"]["type"] == "stop" and len(out["output_ids"]) == 1
    reaching = {"input_ids": [[3, 4, 5, 6]], "sampling_params": {"max_new_tokens": 4}, "return_logprob": True}
    if flags["request_below_context_length"]:
        with pytest.raises(ValueError, match="maximum context length of 8"):
            standin.generate(**reaching)
    else:
        assert standin.generate(**reaching)


def test_an_eos_at_the_cap_ends_the_trajectory_in_both_versions(sglang, tmp_path):
    """Every token is EOS and a turn holds one token: 0.5.10 answers 'length', 0.5.23 'stop'; both trajectories
    end at their first token with reason 'stop', without an environment call."""
    engine = SGLangEngine(_model_dir(tmp_path / "m", eos=list(range(VOCAB))))
    episodes = [Episode(seed) for seed in range(2)]
    trajectories = engine.generate_trajectories(
        PROMPTS[:2],
        episodes,
        SamplingParams(max_new_tokens=1, temperature=0.8, seed=3),
        limits=EnvLimits(max_total_tokens=48),
        decode=decode,
        stop_strings=("|",),
    )
    assert [(len(t.token_ids), t.end_reason, t.turns) for t in trajectories] == [(1, "stop", [(0, 1)])] * 2
    assert not any(e.turns for e in episodes)


class BadEnvironment:
    """Problem 'raise': the episode's second call raises; 'vocab': its first observation holds an id the model
    cannot embed; anything else answers at once."""

    stop_strings = ("|",)

    def start(self, problem):
        return BadEpisode(problem.prompt)

    def close(self):
        pass


class BadEpisode:
    def __init__(self, kind):
        self.kind, self.calls = kind, 0

    def step(self, turn):
        self.calls += 1
        if self.kind == "raise" and self.calls == 2:
            raise ConnectionError("retriever down")
        if self.kind == "vocab":
            return StepResult(observation_ids=(3, VOCAB + 5), done=False)
        if self.kind == "answer":
            return StepResult(done=True, reason="answered")
        return StepResult(observation_ids=(4, 5), done=False)


def test_failing_environments_end_their_trajectories_through_the_watched_engine(sglang, tmp_path):
    """What a stage runs: run_episodes over the watchdog's engine (multi-turn goes to SGLang's own method); an
    environment that raises or writes an id outside the vocabulary ends that trajectory with env_error. The
    model has no EOS, so only the environment ends a trajectory."""
    engine = SGLangEngine(_model_dir(tmp_path / "m", eos=[]))
    watched = WatchedEngine(engine, rebuild=None, progress_timeout_s=60, max_restarts=0, label="sglang")
    kinds = ["raise", "vocab", "answer"]
    groups = run_episodes(
        watched,
        BadEnvironment(),
        [Problem(prompt=k, answer="") for k in kinds],
        PROMPTS[:3],
        n=2,
        params=SamplingParams(max_new_tokens=30, temperature=0.8, seed=3),  # no turn reaches its cap
        limits=EnvLimits(max_total_tokens=60),
        decode=decode,
    )
    errors = [[(t.end_reason, t.error, len(t.turns)) for t in group] for group in groups]
    assert errors[0] == [("env_error", "ConnectionError: retriever down", 2)] * 2
    assert errors[1] == [("env_error", f"observation id {VOCAB + 5} is outside the model's vocabulary (32 ids)", 1)] * 2
    assert errors[2] == [("answered", None, 1)] * 2
    assert all(VOCAB + 5 not in t.token_ids for group in groups for t in group)


# ------------------------------------------------------------------------ one turn's output, by hand


def _output(ids, finish):
    pairs = [(-0.5 - 0.1 * k, t, None) for k, t in enumerate(ids)]
    return {"output_ids": ids, "meta_info": {"output_token_logprobs": pairs, "finish_reason": finish}}


def _row(cap=4, budget=64):
    limits = EnvLimits(max_total_tokens=budget)
    return TrajectoryBuilder(prompt_length=2, episode=None, limits=limits, max_turn_tokens=cap)


def test_an_eos_at_the_cap_ends_the_trajectory_whatever_the_finish_reason():
    """0.5.10 checks the cap before EOS ('length'), 0.5.23 EOS first ('stop'): either way the trajectory stops."""
    for finish in ({"type": "length", "length": 4}, {"type": "stop", "matched": EOS}):
        row = _row()
        assert not replay_turn(row, turn_from_output(_output([5, 6, 7, EOS], finish), VOCAB), {EOS}, decode, ())
        assert row.end_reason == "stop" and row.turns == [(0, 4)] and row.logprobs == [-0.5, -0.6, -0.7, -0.8]


def test_a_token_sglang_stopped_at_is_eos_even_outside_the_config():
    """SGLang also stops at the tokenizer's EOS ids; the token it names ends the trajectory."""
    row, turn = _row(), turn_from_output(_output([5, 9], {"type": "stop", "matched": 9}), VOCAB)
    assert not replay_turn(row, turn, {EOS}, decode, ())
    assert row.end_reason == "stop" and row.token_ids == [5, 9]


def test_tokens_past_the_stop_string_are_dropped():
    row = _row(cap=6)
    turn = turn_from_output(_output([5, 24, 6, 7], {"type": "length", "length": 4}), VOCAB)
    assert replay_turn(row, turn, {EOS}, decode, ("|",))  # the turn goes to the environment
    assert row.token_ids == [5, 24] and row.logprobs == [-0.5, -0.6] and not row.done


def test_answers_outside_the_contract_are_refused():
    with pytest.raises(SGLangContractError, match="sends no stop strings"):
        turn_from_output(_output([5, 6], {"type": "stop", "matched": "</search>"}), VOCAB)
    with pytest.raises(SGLangContractError, match="NaN happened"):
        turn_from_output(_output([5, 6], {"type": "stop", "matched": "NaN happened"}), VOCAB)
    with pytest.raises(SGLangContractError, match="stopped at token 6 but its last token is 5"):
        turn_from_output(_output([5], {"type": "stop", "matched": 6}), VOCAB)
    with pytest.raises(SGLangContractError, match="outside the model's vocabulary"):
        turn_from_output(_output([5, VOCAB], {"type": "length", "length": 2}), VOCAB)
    short = turn_from_output(_output([5, 6], {"type": "length", "length": 2}), VOCAB)
    with pytest.raises(SGLangContractError, match="before its max_new_tokens or EOS"):
        replay_turn(_row(cap=4), short, {EOS}, decode, ())


# ---------------------------------------------------------------------------------- the contract


def test_the_snapshots_hold_what_multi_turn_relies_on():
    """Both ends of the window: token-id requests with output log-probs only by default, per-request seeds,
    the radix cache keeping finished requests, EOS finishes naming the token; the order of the EOS and cap
    checks differs, which is why EOS is recognised by id, not by the finish reason alone."""
    snaps = [load_snapshot(v) for v in VERSIONS]
    for snap in snaps:
        generate = {p["name"] for p in snap["engine"]["generate"]}
        assert {"input_ids", "sampling_params", "return_logprob", "logprob_start_len"} <= generate
        assert {"max_new_tokens", "sampling_seed", "stop"} <= set(snap["sampling_params"])
        flags = snap["flags"]
        for flag in (
            "output_logprobs_only_by_default",
            "prefix_match_bounded_by_logprob_start",
            "finished_requests_cached",
            "cached_tokens_reported",
            "eos_finish_names_token",
            "deterministic_may_disable_radix_cache",  # said in docs/engines.md: a cost, not a wrong result
        ):
            assert flags[flag], (snap["version"], flag)
    for flag in ("eos_at_cap_finishes_as_length", "request_below_context_length"):  # 0.5.10 yes, 0.5.23 no
        assert snaps[0]["flags"][flag] and not snaps[-1]["flags"][flag]


def test_the_env_registry_admits_sglang():
    settings = EnvConfig(enabled=True, search=SearchOptions(url="http://127.0.0.1:9"))
    problem = run_env_problem(
        settings, reward_kind="qa", engine="sglang", allocation="fixed", mode="staged", routing_replay="none"
    )
    assert problem is None
