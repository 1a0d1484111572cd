"""Multi-turn rollouts in the transformers engine: token in / token out, exact behaviour log-probs with
the KV cache kept across turns, limits, and environments that raise, hang or return garbage."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from megatron_mugrpo.envs.base import EnvLimits, Problem, StepResult
from megatron_mugrpo.envs.trajectory import Trajectory
from megatron_mugrpo.errors import ConfigError
from megatron_mugrpo.rollout.engine import SamplingParams
from megatron_mugrpo.rollout.transformers_engine import TransformersEngine, teacher_forced_logprobs
from megatron_mugrpo.training.tiny import tiny_hf_dir

VOCAB = 48
STOP_IDS = range(40, 45)
"""Tokens the test's decoder renders as the stop string '|': a turn ends at one about every 10 tokens, so
rows of a batch end their turns at different steps and sit at different turns."""
EOS_IDS = [2]
MAX_OBSERVATION = 5
PROMPTS = [[1, 5, 6], [1, 7, 8, 9, 10, 11, 12, 13, 14], [1, 20], [1, 30, 31, 32, 33], [1, 3, 4, 5, 6, 7]]
POSITIONS = 256
"""max_position_embeddings of the test models: env.max_total_tokens may not exceed it."""
LOGPROB_TOLERANCE = 1e-5
"""float32 engine log-probs vs one unpadded forward per sequence (as tests/rollout/test_engine.py)."""


def decode(ids):
    return "".join("|" if i in STOP_IDS else chr(97 + i % 26) for i in ids)


class Recorder:
    """An episode that records every turn it is handed and every observation it returns; it answers after
    ``answer_after`` turns, and its observations are seeded random ids of 1..MAX_OBSERVATION tokens."""

    def __init__(self, seed, answer_after=3, fail=None):
        self.rng, self.answer_after, self.fail = random.Random(seed), answer_after, fail
        self.turns, self.observations = [], []

    def step(self, turn):
        self.turns.append(turn)
        if self.fail is not None and len(self.turns) == 2:
            return self.fail()
        if len(self.turns) >= self.answer_after:
            return StepResult(done=True, reason="answered")
        observation = tuple(self.rng.randrange(12, 40) for _ in range(self.rng.randint(1, MAX_OBSERVATION)))
        self.observations.append(observation)
        return StepResult(observation_ids=observation, done=False, info={"tool_calls": 1})


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    shape = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "max_position_embeddings": POSITIONS,
        "tie_word_embeddings": True,
    }
    path = tiny_hf_dir(tmp_path_factory.mktemp("tiny") / "m", seed=0, tokenizer=False, vocab_size=VOCAB, **shape)
    return TransformersEngine(path, dtype="float32", device="cpu", batch_size=4, eos_token_ids=EOS_IDS)


def rollout(engine, episodes, limits=None, max_new_tokens=6, seed=3, prompts=PROMPTS):
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.8, seed=seed)
    return engine.generate_trajectories(
        prompts[: len(episodes)],
        episodes,
        params,
        limits=limits or EnvLimits(max_total_tokens=POSITIONS),
        decode=decode,
        stop_strings=("|",),
    )


def expected_tokens(episode: Recorder) -> list[int]:
    """Sampled turns and observations interleaved, as the environment saw and wrote them."""
    out = []
    for i, turn in enumerate(episode.turns):
        out += turn.token_ids
        if i < len(episode.observations):
            out += episode.observations[i]
    return out


def check_tokens(trajectory: Trajectory, episode: Recorder) -> None:
    """Byte for byte: the turns the environment saw and the observations it wrote, interleaved, then (when EOS
    or the token budget ended the trajectory mid-turn) the last turn, which no environment saw."""
    expected = expected_tokens(episode)
    assert trajectory.token_ids[: len(expected)] == expected
    tail = trajectory.token_ids[len(expected) :]
    if trajectory.end_reason in ("stop", "max_total_tokens"):
        assert tail and trajectory.turns[-1] == (len(expected), len(trajectory.token_ids))
    else:
        assert not tail
    env_turns = [list(t.token_ids) for t in episode.turns]
    assert [trajectory.token_ids[a:b] for a, b in trajectory.turns][: len(env_turns)] == env_turns
    mask = [0] * len(trajectory.token_ids)
    for a, b in trajectory.turns:
        mask[a:b] = [1] * (b - a)
    assert trajectory.policy_mask == mask
    assert len(trajectory.logprobs) == sum(mask)
    assert all(decode(list(t.token_ids)) == t.text for t in episode.turns)


def test_trajectory_tokens_are_the_sampled_tokens_plus_the_observation_tokens(engine):
    episodes = [Recorder(seed=i) for i in range(len(PROMPTS))]
    trajectories = rollout(engine, episodes)
    for trajectory, episode in zip(trajectories, episodes):
        check_tokens(trajectory, episode)
        if trajectory.end_reason == "answered":
            assert len(episode.turns) == 3 and trajectory.tool_calls == 2 and len(trajectory.env_seconds) == 3
    assert sum(t.end_reason == "answered" for t in trajectories) >= 3  # most rows reach their answer


def test_behaviour_logprobs_equal_a_teacher_forced_forward_with_the_cache_kept(engine):
    widths = []
    hook = engine.model.register_forward_pre_hook(
        lambda module, args, kwargs: widths.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    try:
        episodes = [Recorder(seed=10 + i) for i in range(4)]
        trajectories = rollout(engine, episodes, max_new_tokens=8)
    finally:
        hook.remove()
    assert widths[0] == max(len(p) for p in PROMPTS[:4])  # the prefill
    turn_lengths = {b - a for t in trajectories for a, b in t.turns[:-1]}
    assert len(turn_lengths) > 1  # turns end at different steps: rows of one batch sit at different turns
    assert max(widths[1:]) <= 1 + MAX_OBSERVATION and max(widths[1:]) > 1  # only new tokens, observations included
    reference = teacher_forced_logprobs(engine.model, PROMPTS[:4], [t.token_ids for t in trajectories], 0.8)
    for trajectory, ref in zip(trajectories, reference):
        policy = torch.tensor(trajectory.policy_mask, dtype=torch.bool)
        assert torch.equal(torch.tensor(trajectory.aligned_logprobs())[~policy], torch.zeros(int((~policy).sum())))
        error = (torch.tensor(trajectory.logprobs) - ref[policy]).abs().max()
        assert error <= LOGPROB_TOLERANCE


def test_the_same_seed_gives_the_same_trajectories(engine):
    first = rollout(engine, [Recorder(seed=i) for i in range(3)])
    second = rollout(engine, [Recorder(seed=i) for i in range(3)])
    assert [(t.token_ids, t.logprobs, t.end_reason) for t in first] == [
        (t.token_ids, t.logprobs, t.end_reason) for t in second
    ]


def test_limits_end_trajectories(engine):
    [capped] = rollout(
        engine, [Recorder(seed=1, answer_after=10)], limits=EnvLimits(max_turns=2, max_total_tokens=POSITIONS)
    )
    assert capped.end_reason in ("max_turns", "stop") and len(capped.turns) <= 2
    budget = len(PROMPTS[0]) + 9
    [short] = rollout(engine, [Recorder(seed=2, answer_after=10)], limits=EnvLimits(max_total_tokens=budget))
    assert short.end_reason in ("max_total_tokens", "stop") and len(PROMPTS[0]) + len(short.token_ids) <= budget


def test_eos_ends_the_trajectory(tmp_path):
    shape = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "max_position_embeddings": POSITIONS,
        "tie_word_embeddings": True,
    }
    path = tiny_hf_dir(tmp_path / "m", seed=0, tokenizer=False, vocab_size=VOCAB, **shape)
    eager = TransformersEngine(path, dtype="float32", device="cpu", eos_token_ids=list(range(2, 40)))
    trajectories = rollout(eager, [Recorder(seed=i, answer_after=50) for i in range(3)], max_new_tokens=30)
    assert all(t.end_reason == "stop" and t.token_ids[-1] in range(2, 40) for t in trajectories)


def test_bad_environments_end_their_own_trajectories_only(engine):
    release = threading.Event()
    episodes = [
        Recorder(seed=0, fail=lambda: (_ for _ in ()).throw(RuntimeError("index gone"))),
        Recorder(seed=1, fail=lambda: release.wait(120) and StepResult(done=True, reason="answered")),
        Recorder(seed=2, fail=lambda: "garbage"),
        Recorder(seed=3, fail=lambda: StepResult(observation_ids=(VOCAB + 7,), done=False)),
        Recorder(seed=4),
    ]
    limits = EnvLimits(timeout_s=0.5, max_total_tokens=POSITIONS)
    start = time.perf_counter()
    trajectories = rollout(engine, episodes, limits=limits, max_new_tokens=4)
    release.set()
    assert time.perf_counter() - start < 60  # a hung environment does not hang the rollout
    reached = [len(e.turns) >= 2 for e in episodes]  # the failure is on the second call (EOS may come first)
    assert sum(reached[:4]) >= 3  # the failures are exercised, not skipped
    expected = ["env_error", "env_timeout", "env_error", "env_error"]
    for trajectory, ok, reason in zip(trajectories, reached, expected):
        assert trajectory.end_reason == (reason if ok else "stop")
    if reached[0]:
        assert trajectories[0].error == "RuntimeError: index gone"
    if reached[3]:
        assert "outside the model's vocabulary" in trajectories[3].error
    assert trajectories[4].end_reason in ("answered", "stop")
    for trajectory, episode in zip(trajectories, episodes):
        check_tokens(trajectory, episode)


def test_the_engine_refuses_what_it_cannot_do_yet(engine):
    params = SamplingParams(max_new_tokens=4, seed=0)
    with pytest.raises(ValueError, match="one episode per prompt"):
        engine.generate_trajectories(
            PROMPTS[:2], [Recorder(seed=0)], params, limits=EnvLimits(max_total_tokens=POSITIONS), decode=decode
        )
    with pytest.raises(ConfigError, match=r"env\.max_total_tokens=4096 is more than"):
        rollout(engine, [Recorder(seed=0)], limits=EnvLimits(max_total_tokens=4096))  # the model has 256 positions
    engine.use_cache = False
    try:
        with pytest.raises(ValueError, match="need the KV cache"):
            rollout(engine, [Recorder(seed=0)])
    finally:
        engine.use_cache = True


def test_the_search_environment_runs_in_the_engine_through_run_episodes(tmp_path):
    """The pieces compose: the char tokenizer decodes turns for Search-R1's environment (stop strings included),
    episodes group by problem, and the qa reward scores each trajectory with its end reason."""
    from transformers import AutoTokenizer

    from megatron_mugrpo.envs.episodes import run_episodes, score_episodes
    from megatron_mugrpo.envs.search import Document, SearchEnvironment, SearchOptions
    from megatron_mugrpo.rewards.qa import QaOptions, QaReward

    class Client:
        def retrieve(self, queries, topk):
            return [[Document(id="0", title="T", text="x", score=1.0)] for _ in queries]

    shape = {"hidden_size": 32, "intermediate_size": 64, "max_position_embeddings": POSITIONS}
    path = tiny_hf_dir(tmp_path / "m", seed=1, **shape)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    chat = TransformersEngine(path, dtype="float32", device="cpu", batch_size=4)
    limits = EnvLimits(max_turns=2, max_observation_tokens=64, max_total_tokens=POSITIONS)
    env = SearchEnvironment(tokenizer=tokenizer, limits=limits, options=SearchOptions(), client=Client())
    problems = [Problem(prompt="Who?", answer='["Ada"]'), Problem(prompt="Where?", answer='["Tarsk"]')]
    prompts = [list(tokenizer(p.prompt)["input_ids"]) for p in problems]
    params = SamplingParams(max_new_tokens=8, seed=0)
    groups = run_episodes(chat, env, problems, prompts, n=2, params=params, limits=limits, decode=tokenizer.decode)
    assert [len(g) for g in groups] == [2, 2]
    for trajectory in (t for g in groups for t in g):
        assert trajectory.end_reason in ("no_action", "stop", "answered", "max_turns")  # a random policy
        assert sum(trajectory.policy_mask) == len(trajectory.logprobs) > 0
    reward = QaReward(workers=1, timeout_s=1.0, options=QaOptions())
    scores = score_episodes(reward, groups, [p.answer for p in problems], tokenizer.decode)
    assert all(s.reason in ("no_answer", "wrong_answer", "max_turns", "correct") for g in scores for s in g)


def test_collate_makes_the_policy_mask_the_loss_mask_and_the_model_agrees_with_the_behaviour_logprobs(engine):
    """Engine → trajectory → RolloutSample → collate: the response mask is 1 exactly at the targets the policy
    sampled, the behaviour log-probs sit at those targets (0 elsewhere), and one forward of the collated
    tokens gives those log-probs back: what every masked loss assumes (tests/envs/test_masked_losses.py)."""
    from megatron_mugrpo.envs.episodes import trajectory_sample
    from megatron_mugrpo.records import RolloutGroup, collate

    trajectories = rollout(engine, [Recorder(seed=20 + i) for i in range(4)], max_new_tokens=8)
    assert all(0 in t.policy_mask for t in trajectories)  # every row has observations between turns
    groups = [
        RolloutGroup(prompt_id=str(i), prompt_ids=PROMPTS[i], answer="", samples=[trajectory_sample(t, (1.0, "ok"))])
        for i, t in enumerate(trajectories)
    ]
    batch = collate(groups, pad_id=0)
    for b, (prompt, t) in enumerate(zip(PROMPTS, trajectories)):
        start, mask = len(prompt) - 1, torch.zeros(batch.tokens.shape[1])
        mask[start : start + len(t.policy_mask)] = torch.tensor(t.policy_mask, dtype=torch.float32)
        assert torch.equal(batch.response_mask[b], mask)
        assert batch.targets[b, start : start + len(t.token_ids)].tolist() == t.token_ids
        assert batch.behaviour_logprobs[b][mask == 0].abs().sum() == 0
    with torch.no_grad():
        logits = engine.model(input_ids=batch.tokens).logits.float() / 0.8
    scored = torch.log_softmax(logits, dim=-1).gather(-1, batch.targets[..., None])[..., 0]
    policy = batch.response_mask.bool()
    assert (scored[policy] - batch.behaviour_logprobs[policy]).abs().max() <= LOGPROB_TOLERANCE


def test_a_multi_turn_sample_refuses_a_mask_its_turns_do_not_match():
    from megatron_mugrpo.records import RolloutSample

    ok = {"response_ids": [5, 6, 7, 8], "behaviour_logprobs": [-1.0, 0.0, 0.0, -2.0], "finish_reason": "stop"}
    RolloutSample(**ok, policy_mask=[1, 0, 0, 1], turns=[(0, 1), (3, 4)], env_seconds=[0.1])
    with pytest.raises(ValueError, match="cover exactly the policy tokens"):
        RolloutSample(**ok, policy_mask=[1, 0, 0, 1], turns=[(0, 2), (3, 4)])
    with pytest.raises(ValueError, match="policy_mask must be 4 values"):
        RolloutSample(**ok, policy_mask=[1, 0, 1], turns=[(0, 1)])
    with pytest.raises(ValueError, match="outside the 4-token response"):
        RolloutSample(**ok, policy_mask=[1, 0, 0, 1], turns=[(0, 1), (3, 5)])
