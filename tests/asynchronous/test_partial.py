"""Partial rollouts through a rollout worker's own code (async.partial_rollout): a batch generated across
two publications, written to the queue and read back by the trainer's reader.

The worker is the real one (``worker.generate_batch`` with its ``between_steps`` handed to a
transformers engine) on a tiny float32 model; its staging is a stand-in that hands over version 1 at a
given decode step (the transport is tested in test_transport.py / test_publish.py). What the trainer
reads must say, for every token, which version sampled it, and each token's stored log-prob must equal
a teacher-forced forward under exactly that version (1e-5).
"""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megatron_mugrpo.asynchronous.config import AsyncConfig, partial_rollout_problem
from megatron_mugrpo.asynchronous.files import AsyncPaths
from megatron_mugrpo.asynchronous.partial import group_versions
from megatron_mugrpo.asynchronous.publish import Publication
from megatron_mugrpo.asynchronous.transport import Received
from megatron_mugrpo.asynchronous.worker import Worker, generate_batch
from megatron_mugrpo.errors import ConfigError
from megatron_mugrpo.records import RolloutGroup, RolloutSample
from megatron_mugrpo.rollout.config import RolloutConfig
from megatron_mugrpo.rollout.engine import Interrupt
from megatron_mugrpo.rollout.prompts import PromptRecord
from megatron_mugrpo.rollout.queue import QueueReader, QueueWriter, token_lags
from megatron_mugrpo.rollout.store import StoreError
from megatron_mugrpo.rollout.transformers_engine import TransformersEngine, teacher_forced_logprobs
from megatron_mugrpo.training.tiny import tiny_hf_dir

TOLERANCE = 1e-5
VOCAB = 48
UPDATES_PER_STAGE = 4


class OneStaged:
    """A worker's staging that has version ``version`` (``weights``) ready from decode call ``at`` on."""

    def __init__(self, weights: dict[str, torch.Tensor], *, version: int, at: int):
        self.received = Received(
            name=f"v{version:08d}-test",
            version=version,
            digest="",
            tensors=list(weights.items()),
            buffers=[],
            seconds=0,
        )
        self.at, self.calls, self.applied_count = at, 0, 0

    def take(self) -> Received | None:
        self.calls += 1
        if self.calls == self.at:
            return self.received
        return None

    def applied(self, received: Received) -> None:
        self.applied_count += 1


class Subscribed:
    """The disk subscription's part the worker reads: version 0 is held."""

    current = Publication(name="v00000000-test", version=0, digest="")


class NoTrainer:
    done = False

    def check(self) -> None:
        pass


def _worker(tmp_path: Path, model_dir: Path, new_weights, *, at: int, kv: str = "recompute") -> Worker:
    cfg = SimpleNamespace(
        rollout=RolloutConfig(group_size=3, max_new_tokens=8),
        async_=AsyncConfig(partial_rollout=True, partial_kv=kv, batch_groups=3),
        data=SimpleNamespace(seed=0),
        stages=SimpleNamespace(seed=0, updates_per_stage=UPDATES_PER_STAGE),
        algo=SimpleNamespace(adv_eps=1e-6),
        seed=0,
    )
    role = SimpleNamespace(worker_index=0, describe=lambda: "rollout worker 0")
    worker = Worker(cfg=cfg, role=role, paths=AsyncPaths(tmp_path), trainer=NoTrainer(), subscription=Subscribed())
    worker.paths.make()
    worker.engine = TransformersEngine(model_dir, dtype="float32", device="cpu", batch_size=4, eos_token_ids=[2, 3])
    worker.engine.interrupt = Interrupt(between_steps=worker.between_steps, version=lambda: worker.holds.version, kv=kv)
    worker.staging = OneStaged(new_weights, version=4, at=at)
    worker.prompts = [
        PromptRecord(prompt_id=f"p{i}", prompt_ids=[1, 10 + i, 20 + i, 30 + i][: 2 + i % 3], answer="7", text="")
        for i in range(3)
    ]
    worker.tokenizer = SimpleNamespace(decode=lambda ids, skip_special_tokens=True: " ".join(map(str, ids)))
    worker.reward_fn = SimpleNamespace(score=lambda texts, answers: [(float(len(t) % 2), "test") for t in texts])
    worker.queue = QueueWriter(worker.paths.queue, worker=0, vocab_size=VOCAB)
    return worker


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("partial_worker")
    shape = {"hidden_size": 32, "intermediate_size": 64, "max_position_embeddings": 128, "tie_word_embeddings": True}
    old = tiny_hf_dir(root / "v0", seed=0, tokenizer=False, vocab_size=VOCAB, **shape)
    new = tiny_hf_dir(root / "v4", seed=1, tokenizer=False, vocab_size=VOCAB, **shape)
    engines = {v: TransformersEngine(p, dtype="float32", device="cpu") for v, p in ((0, old), (4, new))}
    return old, engines


def _written_and_read(worker: Worker) -> list[RolloutGroup]:
    groups = generate_batch(worker, 0)
    worker.queue.append(0, groups, publication=worker.holds.name)
    reader = QueueReader(worker.paths.queue)
    reader.admit()
    return reader.take(update=5, count=len(groups), max_lag=8).groups


def test_a_group_generated_across_two_publications_carries_both_versions_exactly(tmp_path, models):
    old, engines = models
    worker = _worker(tmp_path, old, engines[4].weights(), at=6)  # version 4 before the 6th decode call
    groups = _written_and_read(worker)
    assert worker.holds.version == 4 and worker.staging.applied_count == 1
    spans = [sorted(set(s.versions)) for g in groups for s in g.samples]
    assert [0, 4] in spans, spans
    for group in groups:
        assert group.policy_version == min(v for s in group.samples for v in s.versions)
        assert group.stage == group.policy_version // UPDATES_PER_STAGE
        for sample in group.samples:
            stored, versions = torch.tensor(sample.behaviour_logprobs), torch.tensor(sample.versions)
            for version, engine in engines.items():
                (forced,) = teacher_forced_logprobs(engine.model, [group.prompt_ids], [sample.response_ids], 1.0)
                mine = versions == version
                if mine.any():
                    assert float((stored[mine] - forced[mine]).abs().max()) <= TOLERANCE


def test_token_lags_count_each_tokens_own_version(tmp_path, models):
    old, engines = models
    worker = _worker(tmp_path, old, engines[4].weights(), at=6)
    groups = generate_batch(worker, 0)
    worker.queue.append(0, groups)
    reader = QueueReader(worker.paths.queue)
    reader.admit()
    taken = reader.take(update=6, count=len(groups), max_lag=8)
    lags = [lag for g in groups for lag in token_lags(g, 6)]
    assert sorted(set(lags)) == [2, 6]  # tokens of version 4 and of version 0, at update 7
    assert taken.token_lag_max == 6 and math.isclose(taken.token_lag_mean, sum(lags) / len(lags))
    assert taken.lags == [6 - g.policy_version for g in groups]  # max_lag: the oldest token


def test_group_versions_refuse_a_response_without_versions_and_take_the_oldest_token():
    tagged = RolloutSample(
        response_ids=[4, 5], behaviour_logprobs=[-1.0, -1.0], finish_reason="length", versions=[3, 4]
    )
    group = RolloutGroup(prompt_id="p", prompt_ids=[1], answer="", samples=[tagged], policy_version=4)
    group_versions([group], engine="transformers", updates_per_stage=2)
    assert (group.policy_version, group.stage) == (3, 1)
    plain = RolloutSample(response_ids=[5], behaviour_logprobs=[-1.0], finish_reason="length")
    untagged = RolloutGroup(prompt_id="q", prompt_ids=[1], answer="", samples=[tagged, plain], policy_version=4)
    with pytest.raises(RuntimeError, match="without per-token versions"):
        group_versions([untagged], engine="plain", updates_per_stage=2)


def test_queue_refuses_a_group_whose_version_is_not_its_oldest_token(tmp_path):
    sample = RolloutSample(
        response_ids=[4, 5], behaviour_logprobs=[-1.0, -1.0], finish_reason="length", versions=[3, 4]
    )
    writer = QueueWriter(tmp_path, worker=0, vocab_size=VOCAB)
    group = RolloutGroup(prompt_id="p", prompt_ids=[1], answer="", samples=[sample], policy_version=4)
    with pytest.raises(StoreError, match="oldest token was sampled by version 3"):
        writer.append(0, [group])


def test_partial_rollout_is_refused_where_it_cannot_run():
    assert partial_rollout_problem(AsyncConfig(partial_rollout=True), "transformers") == ""
    assert partial_rollout_problem(AsyncConfig(), "sglang") == ""
    problem = partial_rollout_problem(AsyncConfig(partial_rollout=True), "sglang")
    assert "async.partial_rollout=true" in problem and "rollout.engine=sglang" in problem
    with pytest.raises(ConfigError, match=r"async\.publish=memory"):
        AsyncConfig(partial_rollout=True, publish="disk")
    with pytest.raises(ConfigError, match=r"async\.partial_kv='reuse'"):
        AsyncConfig(partial_kv="reuse")
