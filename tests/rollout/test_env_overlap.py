"""``env.overlap``: environment calls overlap decoding in the transformers engine's multi-turn loop.

Environments here wait on the engine itself, never on the clock: ``ForwardGate`` counts the model's forwards,
and an episode can hold its answer until the engine has run n more of them. Under overlap the other rows run
those forwards while the episode waits; an engine that waits for the environment runs none, so the episode's
wait runs out (``PROOF_WAIT_S``) and the test fails instead of hanging. Everything but determinism across runs
holds in overlap mode: tokens byte for byte, masks, log-probs equal to a teacher-forced forward, end reasons
of failing environments, and MoE routes of every fed position (a waiting row's pad column is none).
"""

from __future__ import annotations

import random
import threading

import numpy as np
import pytest
import torch
from route_checks import teacher_forced_routes

from megatron_mugrpo.config import load_config
from megatron_mugrpo.envs.base import EnvLimits, StepResult
from megatron_mugrpo.envs.registry import EnvConfig, env_overlap
from megatron_mugrpo.errors import ConfigError
from megatron_mugrpo.rollout.engine import SamplingParams
from megatron_mugrpo.rollout.routes import RouteRecorder
from megatron_mugrpo.rollout.transformers_engine import TransformersEngine, teacher_forced_logprobs
from megatron_mugrpo.training.model import tiny_hf_config
from megatron_mugrpo.training.tiny import tiny_hf_dir

VOCAB, POSITIONS = 48, 256
STOP_IDS = range(40, 45)
"""Rendered as the stop string '|': turns end at different steps in different rows."""
PROMPTS = [[1, 5, 6], [1, 7, 8, 9, 10, 11, 12, 13, 14], [1, 20], [1, 30, 31, 32, 33], [1, 3, 4, 5, 6, 7]]
LOGPROB_TOLERANCE = 1e-5
"""float32 engine log-probs vs one unpadded forward per sequence (as tests/envs/test_multiturn.py)."""
PROOF_WAIT_S = 60.0
"""How long the proof's episode waits for the other row's forwards: only an engine that does not overlap
ever waits this long (it then fails), so it is generous for a loaded machine."""
GATE_FALLBACK_S = 0.3
"""An episode that waits for forwards answers after this long anyway: when every row of the batch waits, no
forward comes (the engine blocks on the first answer). Only the run's speed depends on it."""


def decode(ids):
    return "".join("|" if i in STOP_IDS else chr(97 + i % 26) for i in ids)


class ForwardGate:
    """Counts the forwards of a model (a forward pre-hook); ``wait(n)`` blocks until n more have started."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.count, self.lock, self.waiters = 0, threading.Lock(), []
        self.pads = 0
        """Forwards in which some row fed a masked pad column (its whole chunk masked)."""
        self.handle = model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, _module, _args, kwargs) -> None:
        with self.lock:
            self.count += 1
            mask = kwargs.get("attention_mask")
            self.pads += bool(self.count > 1 and mask is not None and (mask[:, -1] == 0).any())
            for target, event in self.waiters:
                if self.count >= target:
                    event.set()

    def wait(self, n: int, timeout: float) -> bool:
        event = threading.Event()
        with self.lock:
            self.waiters.append((self.count + n, event))
        return event.wait(timeout)

    def close(self) -> None:
        self.handle.remove()


class Episode:
    """Records the turns it sees and the observations it writes; answers after ``answer_after`` turns. With a
    gate, holds each answer until ``hold`` more forwards ran (or ``GATE_FALLBACK_S`` passed); ``fail`` answers
    its second turn."""

    def __init__(self, seed, *, answer_after=3, gate=None, hold=0, fail=None):
        self.rng, self.answer_after, self.gate, self.hold, self.fail = (
            random.Random(seed),
            answer_after,
            gate,
            hold,
            fail,
        )
        self.turns, self.observations = [], []

    def step(self, turn):
        self.turns.append(turn)
        if self.gate is not None and self.hold:
            self.gate.wait(self.hold, GATE_FALLBACK_S)
        if self.fail is not None and len(self.turns) == 2:
            return self.fail()
        if len(self.turns) >= self.answer_after:
            return StepResult(done=True, reason="answered")
        observation = tuple(self.rng.randrange(12, 40) for _ in range(self.rng.randint(1, 5)))
        self.observations.append(observation)
        return StepResult(observation_ids=observation, done=False, info={"tool_calls": 1})


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    shape = {"hidden_size": 32, "intermediate_size": 64, "max_position_embeddings": POSITIONS}
    return tiny_hf_dir(tmp_path_factory.mktemp("tiny") / "m", seed=0, tokenizer=False, vocab_size=VOCAB, **shape)


@pytest.fixture(scope="module")
def engine(model_dir):
    """No EOS: every trajectory runs until its environment or a limit ends it, so every row reaches the turns
    a test arranges."""
    return TransformersEngine(model_dir, dtype="float32", device="cpu", batch_size=4, eos_token_ids=[])


def rollout(engine, episodes, *, overlap=True, limits=None, max_new_tokens=6, stop_strings=("|",)):
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.8, seed=3)
    return engine.generate_trajectories(
        PROMPTS[: len(episodes)],
        episodes,
        params,
        limits=limits or EnvLimits(max_total_tokens=POSITIONS),
        decode=decode,
        stop_strings=stop_strings,
        overlap=overlap,
    )


def check_tokens(trajectory, episode) -> None:
    """Byte for byte: the turns the environment saw and the observations it wrote, interleaved; the policy mask
    1 exactly on the turns; one log-prob per policy token."""
    expected = []
    for i, turn in enumerate(episode.turns):
        expected += turn.token_ids
        expected += episode.observations[i] if i < len(episode.observations) else ()
    assert trajectory.token_ids == expected
    assert [tuple(trajectory.token_ids[a:b]) for a, b in trajectory.turns] == [t.token_ids for t in episode.turns]
    mask = [0] * len(expected)
    for a, b in trajectory.turns:
        mask[a:b] = [1] * (b - a)
    assert trajectory.policy_mask == mask and len(trajectory.logprobs) == sum(mask)


def test_a_row_waiting_for_its_environment_does_not_hold_up_the_others(engine):
    """Row 0's environment answers only once row 1 has run 4 more forwards: the proof that the engine decodes
    while a call runs (a blocking engine runs none, and the episode reports it after PROOF_WAIT_S)."""
    gate = ForwardGate(engine.model)
    overlapped = []

    class Gated(Episode):
        def step(self, turn):
            self.turns.append(turn)
            overlapped.append(gate.wait(4, PROOF_WAIT_S))
            return StepResult(done=True, reason="answered")

    try:
        episodes = [Gated(seed=0), Episode(seed=1, answer_after=4)]
        limits = EnvLimits(max_turns=8, timeout_s=2 * PROOF_WAIT_S, max_total_tokens=POSITIONS)
        trajectories = rollout(engine, episodes, limits=limits, max_new_tokens=4, stop_strings=())
    finally:
        gate.close()
    assert overlapped == [True], "the engine ran no forward while row 0's environment call was running"
    assert gate.pads > 0  # row 0 fed pad columns meanwhile
    assert [t.end_reason for t in trajectories] == ["answered", "answered"]
    for trajectory, episode in zip(trajectories, episodes):
        check_tokens(trajectory, episode)


def test_overlapped_trajectories_are_token_in_token_out_with_teacher_forced_logprobs(engine):
    gate = ForwardGate(engine.model)
    try:  # odd rows hold their answers for 3 forwards of the others: their pad columns interleave with chunks
        episodes = [Episode(seed=10 + i, gate=gate, hold=3 * (i % 2)) for i in range(4)]
        trajectories = rollout(engine, episodes, max_new_tokens=8)
    finally:
        gate.close()
    assert gate.pads > 0
    assert all(t.end_reason == "answered" and t.tool_calls == 2 for t in trajectories)
    reference = teacher_forced_logprobs(engine.model, PROMPTS[:4], [t.token_ids for t in trajectories], 0.8)
    for trajectory, episode, ref in zip(trajectories, episodes, reference):
        check_tokens(trajectory, episode)
        policy = torch.tensor(trajectory.policy_mask, dtype=torch.bool)
        assert (torch.tensor(trajectory.logprobs) - ref[policy]).abs().max() <= LOGPROB_TOLERANCE


def test_failing_and_hanging_environments_end_their_trajectories_with_their_reasons(engine):
    hang = threading.Event()
    episodes = [
        Episode(seed=0, fail=lambda: (_ for _ in ()).throw(RuntimeError("index gone"))),
        Episode(seed=1, fail=lambda: hang.wait(120) and StepResult(done=True, reason="answered")),
        Episode(seed=2, fail=lambda: "garbage"),
        Episode(seed=3, fail=lambda: StepResult(observation_ids=(VOCAB + 7,), done=False)),
        Episode(seed=4),
    ]
    try:
        trajectories = rollout(engine, episodes, limits=EnvLimits(timeout_s=0.5, max_total_tokens=POSITIONS))
    finally:
        hang.set()
    assert [t.end_reason for t in trajectories] == ["env_error", "env_timeout", "env_error", "env_error", "answered"]
    assert trajectories[0].error == "RuntimeError: index gone"
    assert trajectories[1].error == "no answer within env.timeout_s=0.5"
    assert "not a StepResult" in trajectories[2].error
    assert "outside the model's vocabulary" in trajectories[3].error
    for trajectory, episode in zip(trajectories, episodes):
        assert len(episode.turns) == (2 if trajectory.end_reason != "answered" else 3)
        check_tokens(trajectory, episode)


def test_limits_hold_under_overlap(engine):
    [capped] = rollout(engine, [Episode(seed=1, answer_after=10)], limits=EnvLimits(max_turns=2, max_total_tokens=64))
    assert capped.end_reason == "max_turns" and len(capped.turns) == 2
    budget = len(PROMPTS[0]) + 9
    [short] = rollout(engine, [Episode(seed=2, answer_after=10)], limits=EnvLimits(max_total_tokens=budget))
    assert short.end_reason == "max_total_tokens" and len(PROMPTS[0]) + len(short.token_ids) <= budget


@pytest.fixture(scope="module")
def moe_engine(tmp_path_factory):
    """A tiny Qwen3-MoE recording routes (as tests/rollout/test_routes_multiturn.py), without EOS."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = tiny_hf_config(
        "qwen3_moe",
        num_hidden_layers=2,
        num_experts=8,
        num_experts_per_tok=2,
        vocab_size=VOCAB,
        max_position_embeddings=POSITIONS,
    )
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**config)).eval()
    with torch.no_grad():  # initialised routers sit near a tie everywhere; make their choice decisive
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0.0, 1.0)
    path = tmp_path_factory.mktemp("moe")
    model.save_pretrained(path)
    return TransformersEngine(path, dtype="float32", device="cpu", batch_size=4, eos_token_ids=[], record_routes=True)


def test_routes_cover_every_fed_position_and_no_pad_column(moe_engine):
    gate = ForwardGate(moe_engine.model)
    try:
        episodes = [Episode(seed=20 + i, gate=gate, hold=3 * (i % 2)) for i in range(4)]
        trajectories = rollout(moe_engine, episodes)
    finally:
        gate.close()
    assert gate.pads > 0
    checker = RouteRecorder(moe_engine.model)
    try:
        for prompt, t in zip(PROMPTS, trajectories):
            assert t.routes.shape == (len(prompt) + len(t.token_ids) - 1, 2, 2)
            np.testing.assert_array_equal(
                t.routes, teacher_forced_routes(moe_engine.model, checker, prompt + t.token_ids[:-1])
            )
    finally:
        checker.close()


def test_the_overlap_key_is_validated_and_resolved_per_loop(tmp_path, qa_overrides):
    with pytest.raises(ConfigError, match=r"env\.overlap='sometimes' is not one of \('auto', 'always', 'never'\)"):
        EnvConfig(overlap="sometimes")
    with pytest.raises(ConfigError, match=r"env\.overlap='True' \(YAML reads on/off/true/false as booleans\)"):
        load_config("configs/demo_cpu.yaml", [*qa_overrides, "env.overlap=on"])
    with pytest.raises(ConfigError, match=r"env\.overlap=always: rollout\.engine='sglang' sends each turn"):
        load_config("configs/demo_cpu.yaml", [*qa_overrides, "env.overlap=always", "rollout.engine=sglang"])
    assert load_config("configs/demo_cpu.yaml", [*qa_overrides, "env.overlap=always"]).env.overlap == "always"
    on, auto, off = (EnvConfig(enabled=True, overlap=v) for v in ("always", "auto", "never"))
    assert env_overlap(auto, asynchronous=True, engine="transformers")  # async workers overlap by default
    assert not env_overlap(auto, asynchronous=False, engine="transformers")  # staged runs stay reproducible
    assert env_overlap(on, asynchronous=False, engine="transformers")
    assert not env_overlap(off, asynchronous=True, engine="transformers")
    assert not env_overlap(auto, asynchronous=True, engine="vllm")  # 'auto' stays off where it cannot overlap
    assert not env_overlap(EnvConfig(overlap="always"), asynchronous=True, engine="transformers")  # env.enabled off
    assert not env_overlap(None, asynchronous=True, engine="transformers")


def test_run_episodes_hands_overlap_to_the_engine_only_when_it_is_on():
    """``run_episodes`` (called by ``episode_samples`` with ``StageEnv.overlap``): ``overlap=True`` reaches the
    engine when the stage overlaps; otherwise no keyword goes, so vLLM's and SGLang's signatures stay as they are."""
    from megatron_mugrpo.envs.base import Problem
    from megatron_mugrpo.envs.episodes import run_episodes

    calls = []

    class Engine:
        def generate_trajectories(self, prompts, episodes, params, **kwargs):
            calls.append(kwargs.get("overlap"))
            return [None] * len(prompts)

    class Env:
        stop_strings = ()

        def start(self, problem):
            return Episode(seed=0)

    for overlap in (True, False):
        groups = run_episodes(
            Engine(),
            Env(),
            [Problem(prompt="q", answer="a")],
            [[1]],
            n=2,
            params=None,
            limits=EnvLimits(),
            decode=decode,
            overlap=overlap,
        )
        assert len(groups[0]) == 2
    assert calls == [True, None]
