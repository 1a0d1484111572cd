"""Routing replay in async mode: a rollout worker's engine records routes (``moe.routing_replay=rollout``),
its queue shard carries them, and the trainer's queue reader hands them to collate. One process, no
workers spawned: the worker's batch is generated in the test and read back as the trainer reads it."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np

from megatron_mugrpo.asynchronous.config import AsyncConfig
from megatron_mugrpo.asynchronous.files import AsyncPaths
from megatron_mugrpo.asynchronous.publish import Publication
from megatron_mugrpo.asynchronous.worker import Worker, generate_batch
from megatron_mugrpo.records import collate
from megatron_mugrpo.rollout.config import RolloutConfig
from megatron_mugrpo.rollout.prompts import PromptRecord
from megatron_mugrpo.rollout.queue import QueueReader, QueueWriter
from megatron_mugrpo.training.tiny import tiny_hf_dir

VOCAB, EXPERTS, TOPK = 48, 4, 2


class _Subscribed:
    current = Publication(name="v00000000-test", version=0, digest="")


class _NoTrainer:
    done = False

    def check(self) -> None:
        pass


def test_an_async_worker_records_routes_and_the_queue_carries_them_to_collate(tmp_path: Path) -> None:
    model_dir = tiny_hf_dir(
        tmp_path / "moe", "qwen3_moe", tokenizer=False, vocab_size=VOCAB, num_experts=EXPERTS, num_experts_per_tok=TOPK
    )
    cfg = SimpleNamespace(
        rollout=RolloutConfig(group_size=2, max_new_tokens=5),
        async_=AsyncConfig(batch_groups=2),
        data=SimpleNamespace(seed=0),
        stages=SimpleNamespace(seed=0, updates_per_stage=4),
        algo=SimpleNamespace(adv_eps=1e-6),
        seed=0,
    )
    role = SimpleNamespace(worker_index=0, describe=lambda: "rollout worker 0")
    worker = Worker(
        cfg=cfg,
        role=role,
        paths=AsyncPaths(tmp_path / "run"),
        trainer=_NoTrainer(),
        subscription=_Subscribed(),
        record_routes=True,
    )
    worker.paths.make()
    worker.engine = worker._build_engine(str(model_dir))  # as the worker builds it on its first publication
    worker.prompts = [
        PromptRecord(prompt_id=f"p{i}", prompt_ids=[1, 10 + i, 20 + i][: 2 + i % 2], answer="7", text="")
        for i in range(2)
    ]
    worker.tokenizer = SimpleNamespace(decode=lambda ids, skip_special_tokens=True: " ".join(map(str, ids)))
    worker.reward_fn = SimpleNamespace(score=lambda texts, answers: [(float(len(t) % 2), "test") for t in texts])
    worker.queue = QueueWriter(worker.paths.queue, worker=0, vocab_size=VOCAB)

    generated = generate_batch(worker, 0)
    worker.queue.append(0, generated, publication=worker.holds.name)
    reader = QueueReader(worker.paths.queue)
    reader.admit()
    taken = reader.take(update=0, count=len(generated), max_lag=4).groups
    for sent, read in zip(generated, taken, strict=True):
        for a, b in zip(sent.samples, read.samples, strict=True):
            assert a.routes is not None and a.routes.shape[0] == len(sent.prompt_ids) + len(a.response_ids) - 1
            assert a.routes.dtype == b.routes.dtype == np.uint8 and np.array_equal(a.routes, b.routes)
    batch = collate(taken, pad_id=0)
    assert batch.routes is not None and tuple(batch.routes.shape[2:]) == (b.routes.shape[1], TOPK)
