"""Routes from the engine to the trainer's batch: samples carry them, ``collate`` lays them out next to
the input tokens, and the trainer's replay rows (sequence-major) hold each token's own routes."""

import numpy as np
import pytest
import torch

from megatron_mugrpo.records import RolloutGroup, RolloutSample, collate
from megatron_mugrpo.rollout.config import RolloutConfig
from megatron_mugrpo.rollout.generate import generate_groups, stage_identity
from megatron_mugrpo.rollout.prompts import PromptRecord
from megatron_mugrpo.rollout.routes import RoutedGeneration, RouteRecordingError
from megatron_mugrpo.training.routing_replay import real_tokens, replay_rows

LAYERS, TOPK, EXPERTS = 2, 2, 4


def routes_for(rows: int, salt: int) -> np.ndarray:
    """[rows, LAYERS, TOPK] distinct expert pairs that differ per row, layer and ``salt``."""
    first = (np.arange(rows)[:, None] + np.arange(LAYERS)[None, :] + salt) % EXPERTS
    return np.stack([first, (first + 1) % EXPERTS], axis=-1).astype(np.uint8)


def sample(prompt_len: int, response_len: int, salt: int, routed: bool = True) -> RolloutSample:
    return RolloutSample(
        response_ids=list(range(10, 10 + response_len)),
        behaviour_logprobs=[-0.5] * response_len,
        finish_reason="stop",
        routes=routes_for(prompt_len + response_len - 1, salt) if routed else None,
    )


def group(prompt_len: int, samples: list[RolloutSample]) -> RolloutGroup:
    return RolloutGroup(
        prompt_id=f"p{prompt_len}", prompt_ids=list(range(1, 1 + prompt_len)), answer="", samples=samples
    )


def test_collate_lines_routes_up_with_the_input_tokens():
    groups = [group(3, [sample(3, 2, 0), sample(3, 4, 1)]), group(5, [sample(5, 1, 2)])]
    batch = collate(groups, pad_id=0, pad_to_multiple=4)
    assert batch.routes.shape == (3, 8, LAYERS, TOPK) and batch.routes.dtype == torch.uint8
    valid = real_tokens(batch.response_mask)
    for b, (prompt_len, s) in enumerate(
        [(3, groups[0].samples[0]), (3, groups[0].samples[1]), (5, groups[1].samples[0])]
    ):
        rows = prompt_len + len(s.response_ids) - 1
        assert int(valid[b].sum()) == rows  # the trainer's real inputs are exactly the recorded tokens
        assert torch.equal(batch.routes[b, :rows], torch.from_numpy(s.routes))
        assert (batch.routes[b, rows:] == torch.arange(TOPK, dtype=torch.uint8)).all()  # padding: distinct ids
    # Megatron's routers see rows s·B + b: token (b, s)'s own routes, layer by layer.
    seq_major = replay_rows(batch.routes, valid, num_experts=EXPERTS, topk=TOPK, moe_layers=LAYERS)
    B = batch.num_sequences
    for b in range(B):
        for s in range(int(valid[b].sum())):
            for layer in range(LAYERS):
                assert seq_major[layer, s * B + b].tolist() == batch.routes[b, s, layer].tolist()


def test_micro_batches_keep_their_rows_routes():
    batch = collate([group(3, [sample(3, 2, 0), sample(3, 3, 1), sample(3, 4, 2)])], pad_id=0)
    assert torch.equal(batch.slice(1, 3).routes, batch.routes[1:3])


def test_collate_without_routes_has_none_and_a_mixed_batch_is_refused():
    assert collate([group(3, [sample(3, 2, 0, routed=False)])], pad_id=0).routes is None
    with pytest.raises(ValueError, match="1 of 2 responses carry no routes"):
        collate([group(3, [sample(3, 2, 0), sample(3, 2, 1, routed=False)])], pad_id=0)


def test_sample_routes_must_be_tokens_by_layers_by_k():
    with pytest.raises(ValueError, match=r"must be \[tokens, moe_layers, k\]"):
        RolloutSample(
            response_ids=[1], behaviour_logprobs=[-1.0], finish_reason="stop", routes=np.zeros((2, 4), np.uint8)
        )


class RoutingEngine:
    """Answers every prompt with ``n`` responses of 3 tokens and routes of ``extra`` + P + 3 - 1 rows."""

    name = "transformers"

    def __init__(self, extra: int = 0):
        self.extra = extra

    def generate(self, prompts, n, params, progress=None):
        return [
            [
                RoutedGeneration(
                    response_ids=[5, 6, 7],
                    logprobs=[-0.5] * 3,
                    finish_reason="length",
                    routes=routes_for(len(p) + 3 - 1 + self.extra, salt=k),
                )
                for k in range(count)
            ]
            for p, count in zip(prompts, n)
        ]


class ZeroReward:
    def score(self, texts, answers):
        return [(0.0, "wrong")] * len(texts)


class Decoder:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def generate(engine):
    prompts = [PromptRecord(prompt_id=f"q{i}", prompt_ids=[1] * (2 + i), answer="1", text="") for i in range(2)]
    return generate_groups(
        engine=engine,
        records=prompts,
        tokenizer=Decoder(),
        reward_fn=ZeroReward(),
        cfg=RolloutConfig(group_size=2, max_new_tokens=3, shard_groups=2),
        seeds=(0,),
        vocab_size=50,
    )


def test_generation_carries_the_engines_routes_into_the_samples():
    groups = generate(RoutingEngine())
    for group in groups:
        for k, sample in enumerate(group.samples):
            assert np.array_equal(sample.routes, routes_for(len(group.prompt_ids) + 2, salt=k))


def test_routes_that_do_not_cover_the_trainers_input_are_refused():
    with pytest.raises(RouteRecordingError, match=r"routes need 4 rows \(prompt \+ response - 1\)"):
        generate(RoutingEngine(extra=1))


def test_the_store_identity_names_routes_only_when_recorded():
    prompts = [PromptRecord(prompt_id="q", prompt_ids=[1, 2], answer="1", text="")]
    kwargs = dict(
        cfg=RolloutConfig(group_size=2), reward={}, prompts=prompts, stage=0, policy_version=0, seed=0, vocab_size=50
    )
    plain = stage_identity(**kwargs, engine_name="transformers")
    routed = stage_identity(**kwargs, engine_name="transformers", routes=True)
    assert "routes" not in plain.sampling and routed.sampling["routes"] is True
