"""The engine watchdog around a real transformers engine that $MUGRPO_ENGINE_FAULT kills or hangs in
the middle of a batch, while a stage's store is generated (rollout.generate.generate_planned):

- the stage completes on rebuilt engines, bitwise equal to an uninterrupted run, and the rebuilt
  engines hold the stage's weights (kept on the host), not the base model's on disk;
- past rollout.max_restarts the generation stops with the engine's error, the shards written before
  are kept, and a rerun generates only the missing ones, again equal to the uninterrupted run.

The model is tiny and every shard two batches of two rows, so each test takes about a second."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from megatron_mugrpo import faults
from megatron_mugrpo.char_tokenizer import build_char_tokenizer, char_vocab
from megatron_mugrpo.rollout.config import RolloutConfig
from megatron_mugrpo.rollout.generate import generate_planned, plan_stage, stage_identity
from megatron_mugrpo.rollout.placement import EnginePlacement, HostGroup, engine_threads
from megatron_mugrpo.rollout.prompts import PromptRecord
from megatron_mugrpo.rollout.store import RolloutStore
from megatron_mugrpo.rollout.tasks import builtin_problems, builtin_prompt
from megatron_mugrpo.rollout.transformers_engine import TransformersEngine
from megatron_mugrpo.rollout.watchdog import EngineFailedError, HostWeights, WatchedEngine

VOCAB = len(char_vocab())
CFG = RolloutConfig(group_size=2, max_new_tokens=6, shard_groups=2)
"""4 prompts → 2 shards of 2 groups × 2 responses; at batch_size 2 each shard is batches 2i and 2i + 1."""
HANG_TIMEOUT_S = 2.0
"""Progress timeout of the hang test: a batch here takes milliseconds, so only the injected hang trips it
(a spurious trip on a very loaded machine would be one more restart, and the same bits)."""


class ParityReward:
    """A deterministic reward without worker processes: 1 for an even-length answer."""

    def score(self, texts, answers):
        return [(float(len(t) % 2 == 0), "parity") for t in texts]


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        eos_token_id=char_vocab()["<eos>"],
    )
    path = tmp_path_factory.mktemp("watchdog_model")
    Qwen2ForCausalLM(config).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def stage_weights(model_dir):
    """The stage's policy: the base model moved by a seeded step, so a rebuilt engine that forgot to load
    it (and sampled from the base model on disk) would give other rows."""
    weights = TransformersEngine(model_dir, dtype="float32", device="cpu").weights()
    generator = torch.Generator().manual_seed(1)
    return [(name, t + 0.05 * torch.randn(t.shape, generator=generator)) for name, t in weights.items()]


@pytest.fixture
def fault(monkeypatch):
    """Sets $MUGRPO_ENGINE_FAULT for one test; afterwards releases every hung batch and joins the threads."""
    faults.reset_engine_faults()
    watched: list[WatchedEngine] = []

    def arm(spec: str) -> list[WatchedEngine]:
        monkeypatch.setenv(faults.ENGINE_FAULT_ENV, spec)
        return watched

    yield arm
    faults.release_hangs()
    for engine in watched:
        for thread in engine.abandoned:
            thread.join(60)
    monkeypatch.delenv(faults.ENGINE_FAULT_ENV)
    faults.reset_engine_faults()


def prompts(tokenizer) -> list[PromptRecord]:
    rows = builtin_problems("arithmetic_easy", 4, seed=0, split="train")
    return [
        PromptRecord(
            prompt_id=f"p{i}",
            prompt_ids=tokenizer(builtin_prompt(r["problem"]))["input_ids"],
            answer=r["answer"],
            text=builtin_prompt(r["problem"]),
        )
        for i, r in enumerate(rows)
    ]


def loaded_engine(model_dir, weights) -> TransformersEngine:
    """An engine built on the base model directory and given the stage's weights, as a weight sync does."""
    engine = TransformersEngine(model_dir, dtype="float32", device="cpu", batch_size=2)
    engine.load_weights(weights)
    return engine


def watched_engine(model_dir, stage_weights, **settings) -> WatchedEngine:
    """What loop/engines.py hands a host: the synced engine, and a rebuild from the host's copy."""
    kept = HostWeights()
    engine = loaded_engine(model_dir, kept.tee(stage_weights))
    return WatchedEngine(
        engine,
        rebuild=lambda: loaded_engine(model_dir, kept),
        label="rollout engine 0 (rank 0 on test)",
        where=lambda: "in stage 1's rollout phase",
        **({"progress_timeout_s": 600.0, "max_restarts": 2} | settings),
    )


def generate(store_dir, engine, tokenizer) -> dict[str, float]:
    """The stage's store, as the staged loop makes it on one engine thread (rollout.cpu_threads=1)."""
    records, hosts = prompts(tokenizer), HostGroup(EnginePlacement.single())
    identity = stage_identity(
        cfg=CFG,
        reward={"kind": "parity"},
        prompts=records,
        stage=1,
        policy_version=8,
        seed=5,
        vocab_size=VOCAB,
        engine_name="transformers",
    )
    plan = plan_stage(store_dir, identity, hosts)
    with engine_threads(1):
        return generate_planned(
            plan,
            engine=engine,
            prompts=records,
            tokenizer=tokenizer,
            reward_fn=ParityReward(),
            cfg=CFG,
            adv_eps=1e-6,
            store_dir=store_dir,
            seed=5,
            hosts=hosts,
        )


def rows(store_dir) -> list[tuple]:
    """Every stored response, bit for bit (ids, log-probs, finish reason, reward)."""
    return [
        (g.prompt_id, tuple(s.response_ids), tuple(s.behaviour_logprobs), s.finish_reason, s.reward)
        for g in RolloutStore.open(store_dir).groups()
        for s in g.samples
    ]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, model_dir, stage_weights, tokenizer):
    store_dir = tmp_path_factory.mktemp("uninterrupted")
    generate(store_dir, loaded_engine(model_dir, stage_weights), tokenizer)
    return rows(store_dir)


def test_killed_and_hung_mid_batch_the_stage_completes_bitwise_equal(
    tmp_path, model_dir, stage_weights, tokenizer, uninterrupted, fault
):
    """Batch 1 (shard 0's second) raises, batch 4 (shard 1's first, after the retry's 2 and 3) hangs."""
    engine = watched_engine(model_dir, stage_weights, progress_timeout_s=HANG_TIMEOUT_S, max_restarts=5)
    fault("raise:1,hang:4").append(engine)
    metrics = generate(tmp_path, engine, tokenizer)
    assert rows(tmp_path) == uninterrupted
    kinds = [f.kind for f in engine.failures]
    assert kinds[0] == "died" and "hung" in kinds and engine.restarts == len(kinds)
    assert "injected: the engine died in the middle of batch 1" in engine.failures[0].detail
    assert metrics["perf/rollout_shards_written"] == 2


def test_a_rebuilt_engine_samples_the_stage_weights_not_the_base_model(tmp_path, model_dir, tokenizer, uninterrupted):
    """The check the bitwise test relies on: the base model on disk gives other rows."""
    generate(tmp_path, TransformersEngine(model_dir, dtype="float32", device="cpu", batch_size=2), tokenizer)
    assert rows(tmp_path) != uninterrupted


def test_past_max_restarts_finished_shards_are_kept_and_a_rerun_completes_them(
    tmp_path, model_dir, stage_weights, tokenizer, uninterrupted, fault
):
    """Shard 0 (batches 0, 1) is written; shard 1 fails three times (batches 2, 3, 4) with max_restarts=2."""
    engine = watched_engine(model_dir, stage_weights, max_restarts=2)
    fault("raise:2,raise:3,raise:4").append(engine)
    with pytest.raises(EngineFailedError) as caught:
        generate(tmp_path, engine, tokenizer)
    message = str(caught.value)
    assert message.startswith("rollout engine 0 (rank 0 on test) died in stage 1's rollout phase: InjectedEngineError")
    assert "batch 4" in message and "rollout.max_restarts=2" in message
    assert (tmp_path / "shard_00000.arrow").is_file() and not (tmp_path / "shard_00001.arrow").exists()

    metrics = generate(tmp_path, watched_engine(model_dir, stage_weights), tokenizer)  # a resume, no fault left
    assert metrics["perf/rollout_shards_resumed"] == 1 and metrics["perf/rollout_shards_written"] == 1
    assert rows(tmp_path) == uninterrupted
