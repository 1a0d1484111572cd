"""Route recording of multi-turn trajectories (rollout.routes with TransformersEngine.generate_trajectories):
a tiny Qwen3-MoE (3 layers, the middle one dense, 8 experts top-2) decodes trajectories whose rows sit at
different turns, feeding observation chunks of different lengths into the kept KV cache.

Each trajectory's routes cover prompt + trajectory minus its last token (the trainer's input), observation
tokens included, and equal those of one teacher-forced forward over that sequence at every token and layer.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from route_checks import teacher_forced_routes

from megatron_mugrpo.envs.base import EnvLimits, StepResult
from megatron_mugrpo.envs.episodes import trajectory_sample
from megatron_mugrpo.envs.registry import MULTI_TURN_ROUTE_ENGINES
from megatron_mugrpo.records import RolloutGroup
from megatron_mugrpo.rewards.score import Score
from megatron_mugrpo.rollout.engine import SamplingParams
from megatron_mugrpo.rollout.routes import RouteRecorder, RouteRecordingError, shard_routes
from megatron_mugrpo.rollout.transformers_engine import TransformersEngine
from megatron_mugrpo.training.model import tiny_hf_config

VOCAB, EXPERTS, TOPK = 48, 8, 2
STOP_IDS = range(40, 45)
"""Tokens the decoder renders as the stop string '|': turns end at different steps in different rows."""
PROMPTS = [[1, 5, 6], [1, 7, 8, 9, 10, 11, 12, 13, 14], [1, 20], [1, 30, 31, 32, 33], [1, 3, 4, 5, 6, 7]]


def decode(ids):
    return "".join("|" if i in STOP_IDS else chr(97 + i % 26) for i in ids)


class Observer:
    """Answers after three turns; before that, observations of 1..5 seeded random ids."""

    def __init__(self, seed):
        self.rng, self.turns = random.Random(seed), 0

    def step(self, turn):
        self.turns += 1
        if self.turns >= 3:
            return StepResult(done=True, reason="answered")
        observation = tuple(self.rng.randrange(12, 40) for _ in range(self.rng.randint(1, 5)))
        return StepResult(observation_ids=observation, done=False)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = tiny_hf_config(
        "qwen3_moe",
        num_hidden_layers=3,
        mlp_only_layers=[1],
        num_experts=EXPERTS,
        num_experts_per_tok=TOPK,
        vocab_size=VOCAB,
        max_position_embeddings=256,
    )
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**config)).eval()
    with torch.no_grad():  # initialised routers sit near a tie everywhere; make their choice decisive
        for layer in (0, 2):
            model.model.layers[layer].mlp.gate.weight.normal_(0.0, 1.0)
    path = tmp_path_factory.mktemp("moe")
    model.save_pretrained(path)
    return TransformersEngine(path, dtype="float32", device="cpu", batch_size=4, eos_token_ids=[2], record_routes=True)


def rollout(engine, seed=3):
    params = SamplingParams(max_new_tokens=6, temperature=0.8, seed=seed)
    return engine.generate_trajectories(
        PROMPTS,
        [Observer(seed=i) for i in range(len(PROMPTS))],
        params,
        limits=EnvLimits(max_total_tokens=256),
        decode=decode,
        stop_strings=("|",),
    )


def test_trajectory_routes_equal_a_teacher_forced_forward_over_prompt_and_trajectory(engine):
    trajectories = rollout(engine)
    observed = [t for t in trajectories if 0 in t.policy_mask]
    assert len(observed) >= 3, "too few trajectories got an observation to check the chunked feeds"
    assert len({len(t.token_ids) for t in trajectories}) > 2  # rows at different turns and lengths
    checker = RouteRecorder(engine.model)
    try:
        for prompt, t in zip(PROMPTS, trajectories):
            assert t.routes.shape == (len(prompt) + len(t.token_ids) - 1, 2, TOPK) and t.routes.dtype == np.uint8
            expected = teacher_forced_routes(engine.model, checker, prompt + t.token_ids[:-1])
            np.testing.assert_array_equal(t.routes, expected)
    finally:
        checker.close()


def test_recording_changes_no_sampled_token_and_the_samples_carry_the_routes(engine):
    recorded = rollout(engine, seed=5)
    engine.recorder.close()
    engine.recorder = None
    try:
        plain = rollout(engine, seed=5)
    finally:
        engine.recorder = RouteRecorder(engine.model)
    assert [t.token_ids for t in recorded] == [t.token_ids for t in plain]
    assert [t.logprobs for t in recorded] == [t.logprobs for t in plain]
    assert all(t.routes is None for t in plain)
    samples = [trajectory_sample(t, Score(1.0, "correct")) for t in recorded]
    groups = [
        RolloutGroup(prompt_id=str(i), prompt_ids=p, answer="", samples=[s])
        for i, (p, s) in enumerate(zip(PROMPTS, samples))
    ]
    stored = shard_routes(groups, "shard 0")  # the store's and the queue's check: one row per trainer input token
    assert [r[0] is t.routes for r, t in zip(stored, recorded)] == [True] * len(PROMPTS)


def test_trajectory_routes_round_trip_through_an_async_queue_shard(engine, tmp_path):
    """A rollout worker's queue shard of multi-turn samples keeps each trajectory's routes (observation
    positions included) bit for bit beside its policy mask, and collate lines them up with the input tokens."""
    from megatron_mugrpo.records import collate
    from megatron_mugrpo.rollout.queue import QueueReader, QueueWriter

    trajectories = rollout(engine, seed=7)
    groups = [
        RolloutGroup(prompt_id=str(i), prompt_ids=p, answer="", samples=[trajectory_sample(t, Score(1.0, "correct"))])
        for i, (p, t) in enumerate(zip(PROMPTS, trajectories))
    ]
    record = QueueWriter(tmp_path, worker=0, vocab_size=VOCAB).append(0, groups)
    assert record.trajectories and record.routes is not None and record.routes.moe_layers == 2
    reader = QueueReader(tmp_path)
    reader.admit()
    taken = reader.take(update=0, count=len(PROMPTS), max_lag=4).groups
    for group, t in zip(taken, trajectories):
        (sample,) = group.samples
        assert sample.policy_mask == t.policy_mask and sample.routes.tobytes() == t.routes.tobytes()
    batch = collate(taken, pad_id=0)
    for b, t in enumerate(trajectories):
        assert torch.equal(batch.routes[b, : len(t.routes)], torch.from_numpy(t.routes))


def test_the_recorder_refuses_chunks_that_do_not_fit(engine):
    recorder = RouteRecorder(engine.model)
    try:
        recorder.begin([3, 2])
        with pytest.raises(RouteRecordingError, match="prefill forward takes no fed counts"):
            recorder.step([0, 1], fed=[3, 2])
        recorder.step([0, 1])
        with torch.no_grad():
            engine.model(
                input_ids=torch.tensor([[5, 6, 7], [0, 8, 9]]), attention_mask=torch.tensor([[1, 1, 1], [0, 1, 1]])
            )
        with pytest.raises(RouteRecordingError, match="one count >= 1 per row"):
            recorder.step([0, 1], fed=[1])
        recorder.step([1], fed=[4])
        with pytest.raises(RouteRecordingError, match="fewer than a row fed"), torch.no_grad():
            engine.model(input_ids=torch.tensor([[5, 6]]))
    finally:
        recorder.close()
    assert MULTI_TURN_ROUTE_ENGINES == ("transformers",)


def test_the_config_admits_multi_turn_routing_replay_on_the_transformers_engine_only(qa_overrides):
    from megatron_mugrpo.config import load_config
    from megatron_mugrpo.errors import ConfigError

    cfg = load_config("configs/demo_moe_cpu.yaml", qa_overrides)
    assert cfg.moe.routing_replay == "rollout" and cfg.env.enabled
    with pytest.raises(ConfigError, match=r"rollout\.engine='sglang' records them for single-turn responses only"):
        load_config("configs/demo_moe_cpu.yaml", [*qa_overrides, "rollout.engine=sglang"])
