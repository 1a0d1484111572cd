"""Partial rollouts in the transformers engine (async.partial_rollout): weights applied between two decode
steps, the same sequences continued, every token tagged with the version that sampled it.

The reference is a teacher-forced forward over prompt + response (float32, CPU) under each version's
weights: with the KV cache recomputed at the switch (``partial_kv: recompute``), the stored log-probs
of exactly the tokens of version v equal the forward under v's weights; with the cache kept, the tokens
after the switch were sampled from neither policy, and the gap to the new one is what the trainer's
first ratio sees (measured here and printed).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_mugrpo.rollout.engine import Generation, Interrupt, SamplingParams
from megatron_mugrpo.rollout.transformers_engine import TransformersEngine, teacher_forced_logprobs
from megatron_mugrpo.training.tiny import tiny_hf_dir

TOLERANCE = 1e-5
VOCAB = 48
PROMPTS = [[1, 5, 6], [1, 7, 8, 9, 10, 11, 12, 13, 14], [1, 2], [1, 30, 31, 32, 33]]
STOP_IDS = list(range(2, 8))
"""EOS ids common enough that rows stop (and leave the batch) at different steps."""


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """Two tiny Qwen2 checkpoints with different weights: versions 0 and 1 of the policy."""
    root = tmp_path_factory.mktemp("partial_models")
    shape = {"hidden_size": 32, "intermediate_size": 64, "max_position_embeddings": 128, "tie_word_embeddings": True}
    a = tiny_hf_dir(root / "a", seed=0, tokenizer=False, vocab_size=VOCAB, **shape)
    b = tiny_hf_dir(root / "b", seed=1, tokenizer=False, vocab_size=VOCAB, **shape)
    return str(a), str(b)


class Publisher:
    """Stands in for a worker's staging: publishes version 1 (``new``'s weights) before decode call ``at``."""

    def __init__(self, engine: TransformersEngine, new: TransformersEngine, at: int):
        self.engine, self.weights, self.at = engine, new.weights(), at
        self.calls, self.version = 0, 0

    def between_steps(self) -> bool:
        self.calls += 1
        if self.calls != self.at:
            return False
        self.engine.load_weights((name, tensor.clone()) for name, tensor in self.weights.items())
        self.version = 1
        return True


def _generate(model_dirs, *, kv: str, at: int, eos: list[int], batch_size: int = 64, use_cache: bool = True):
    engine = TransformersEngine(
        model_dirs[0], dtype="float32", device="cpu", batch_size=batch_size, eos_token_ids=eos, use_cache=use_cache
    )
    new = TransformersEngine(model_dirs[1], dtype="float32", device="cpu", eos_token_ids=eos)
    publisher = Publisher(engine, new, at)
    engine.interrupt = Interrupt(between_steps=publisher.between_steps, version=lambda: publisher.version, kv=kv)
    groups = engine.generate(PROMPTS, 3, SamplingParams(max_new_tokens=10, seed=4))
    old = TransformersEngine(model_dirs[0], dtype="float32", device="cpu")
    return groups, {0: old.model, 1: new.model}


def _gaps(groups: list[list[Generation]], models) -> dict[int, float]:
    """Max |stored - teacher-forced| over the tokens of each version, under that version's weights."""
    gaps = {0: 0.0, 1: 0.0}
    for prompt, group in zip(PROMPTS, groups):
        for gen in group:
            stored, versions = torch.tensor(gen.logprobs), torch.tensor(gen.versions)
            for version, model in models.items():
                (forced,) = teacher_forced_logprobs(model, [prompt], [gen.response_ids], 1.0)
                mine = versions == version
                if mine.any():
                    gaps[version] = max(gaps[version], float((stored[mine] - forced[mine]).abs().max()))
    return gaps


def test_a_group_sampled_across_a_publication_carries_both_versions_and_each_tokens_exact_logprob(model_dirs):
    """No EOS: every response runs 10 steps; version 1 arrives before decode step 4 (the 5th call)."""
    groups, models = _generate(model_dirs, kv="recompute", at=5, eos=[])
    for group in groups:
        for gen in group:
            assert gen.versions == [0] * 4 + [1] * 6
    gaps = _gaps(groups, models)
    assert gaps[0] <= TOLERANCE and gaps[1] <= TOLERANCE, gaps


@pytest.mark.parametrize("use_cache", [True, False])
def test_recomputed_cache_is_exact_with_rows_leaving_the_batch_and_several_micro_batches(model_dirs, use_cache):
    """EOS makes rows stop and leave at different steps; batches of 4 rows, so the switch (the 7th call)
    falls inside the second micro-batch and the third starts under version 1."""
    groups, models = _generate(model_dirs, kv="recompute", at=7, eos=STOP_IDS, batch_size=4, use_cache=use_cache)
    versions = [tuple(sorted(set(gen.versions))) for group in groups for gen in group]
    assert (0,) in versions and (1,) in versions and (0, 1) in versions, versions
    assert any(gen.finish_reason == "stop" for group in groups for gen in group)
    gaps = _gaps(groups, models)
    assert gaps[0] <= TOLERANCE and gaps[1] <= TOLERANCE, gaps


def test_kept_cache_samples_the_tokens_after_a_switch_from_neither_policy(model_dirs):
    """``partial_kv: keep``: the old weights' keys and values stay; the tokens after the switch are off
    the new policy by a gap the trainer's first ratio would see (printed: pytest -s)."""
    groups, models = _generate(model_dirs, kv="keep", at=5, eos=[])
    gaps = _gaps(groups, models)
    assert gaps[0] <= TOLERANCE
    assert gaps[1] > 100 * TOLERANCE, gaps
    after = [
        float((torch.tensor(gen.logprobs[4:]) - forced[4:]).abs().mean())
        for prompt, group in zip(PROMPTS, groups)
        for gen in group
        for forced in teacher_forced_logprobs(models[1], [prompt], [gen.response_ids], 1.0)
    ]
    print(
        f"partial_kv=keep: |log beta - log pi_new| over the tokens after the switch: max {gaps[1]:.3g}, "
        f"mean {sum(after) / len(after):.3g} (recompute: <= {TOLERANCE})"
    )


def test_without_an_interrupt_nothing_records_versions(model_dirs):
    engine = TransformersEngine(model_dirs[0], dtype="float32", device="cpu")
    (group,) = engine.generate(PROMPTS[:1], 2, SamplingParams(max_new_tokens=4, seed=0))
    assert all(gen.versions is None for gen in group)


def test_an_interrupt_that_applies_nothing_changes_nothing_sampled(model_dirs):
    plain = TransformersEngine(model_dirs[0], dtype="float32", device="cpu", eos_token_ids=STOP_IDS)
    params = SamplingParams(max_new_tokens=10, seed=4)
    expected = plain.generate(PROMPTS, 3, params)
    plain.interrupt = Interrupt(between_steps=lambda: False, version=lambda: 7)
    got = plain.generate(PROMPTS, 3, params)
    for want, have in zip(expected, got):
        for a, b in zip(want, have):
            assert (a.response_ids, a.logprobs) == (b.response_ids, b.logprobs)
            assert b.versions == [7] * len(b.response_ids)


def test_bad_kv_mode_is_refused():
    with pytest.raises(ValueError, match="kv='reuse'"):
        Interrupt(between_steps=lambda: False, version=lambda: 0, kv="reuse")


def test_routes_keep_being_recorded_per_step_across_a_switch(tmp_path):
    """A MoE model under record_routes=True: a switch mid-sequence (cache recomputed) leaves each
    response's routes complete (prompt + response - 1 rows): the recompute forward is not recorded."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from megatron_mugrpo.training.model import tiny_hf_config

    config = tiny_hf_config("qwen3_moe", num_hidden_layers=2, num_experts=8, num_experts_per_tok=2)
    for seed, name in ((0, "a"), (1, "b")):
        torch.manual_seed(seed)
        Qwen3MoeForCausalLM(Qwen3MoeConfig(**config)).save_pretrained(tmp_path / name)
    engine = TransformersEngine(tmp_path / "a", dtype="float32", device="cpu", eos_token_ids=[], record_routes=True)
    new = TransformersEngine(tmp_path / "b", dtype="float32", device="cpu", eos_token_ids=[])
    publisher = Publisher(engine, new, at=3)
    engine.interrupt = Interrupt(between_steps=publisher.between_steps, version=lambda: publisher.version)
    groups = engine.generate(PROMPTS, 2, SamplingParams(max_new_tokens=6, seed=1))
    for prompt, group in zip(PROMPTS, groups):
        for gen in group:
            assert gen.versions == [0, 0, 1, 1, 1, 1]
            assert gen.routes.shape == (len(prompt) + 5, 2, 2)
            assert np.all(gen.routes < 8)
