"""No wasted generation: a worker pauses before a batch the trainer would drop for its lag.

The decision (``batches.lag_pause``) is arithmetic, checked against the trainer's own drop rule
(``rollout.queue.scan``) over a grid of queue states; the worker's pause ends with newer weights;
the queue counts paused batches apart from dropped groups, exactly once across a resume.
"""

from __future__ import annotations

import copy
import itertools
from pathlib import Path
from types import SimpleNamespace

import pytest

from megatron_mugrpo.asynchronous.batches import lag_pause
from megatron_mugrpo.asynchronous.config import AsyncConfig
from megatron_mugrpo.asynchronous.files import write_json
from megatron_mugrpo.asynchronous.publish import POINTER, Subscription
from megatron_mugrpo.records import RolloutGroup, RolloutSample
from megatron_mugrpo.rollout.queue import QueueReader, QueueWriter, scan

VOCAB = 16


def trainer_drops(*, unconsumed: int, trainer_update: int, groups: int, version: int, mini: int, max_lag: int) -> bool:
    """Whether the trainer's scan drops any of ``groups`` new groups of ``version`` queued behind
    ``unconsumed`` groups it takes (nothing taken yet for the update being assembled)."""
    never_stale = 10**9  # a group newer than the trainer has lag 0 (``group_lag``)
    queue = [never_stale] * unconsumed + [version] * groups
    update, position, dropped = trainer_update, 0, set()
    while position < len(queue):
        taken, gone = scan(queue[position:], update=update, need=mini, max_lag=max_lag)
        dropped |= {position + i for i in gone}
        position += len(taken) + len(gone)
        update += 1
    return any(i >= unconsumed for i in dropped)


def test_a_pause_is_exactly_what_the_trainer_would_drop() -> None:
    outcomes = set()
    for max_lag, mini, groups in ((4, 32, 32), (4, 8, 20), (8, 4, 16), (16, 8, 64)):
        cfg = AsyncConfig(max_lag=max_lag, sync_every=4, batch_groups=groups)
        for unconsumed, behind in itertools.product(range(1, 6 * mini), range(0, max_lag + 3)):
            state = dict(unconsumed=unconsumed, trainer_update=100, groups=groups, version=100 - behind)
            expected = trainer_drops(**state, mini=mini, max_lag=max_lag)
            assert lag_pause(cfg, **state, mini_groups=mini) == expected, (max_lag, mini, state)
            outcomes.add(expected)
    assert outcomes == {True, False}


def test_an_empty_queue_never_pauses() -> None:
    """The trainer waits for groups then: a batch too large for max_lag is made and partly dropped."""
    cfg = AsyncConfig(max_lag=4, sync_every=4, batch_groups=256)
    assert trainer_drops(unconsumed=0, trainer_update=8, groups=256, version=8, mini=8, max_lag=4)
    assert not lag_pause(cfg, groups=256, unconsumed=0, trainer_update=8, version=5, mini_groups=8)


def test_presets_pause_where_groups_would_age_past_max_lag() -> None:
    # async GRPO (max_lag = sync_every = 4, B_mini 32, batches of 32, queue bound 128): a full queue
    # holds 4 updates, so a batch made with weights 1 update old would be dropped.
    grpo = AsyncConfig(max_lag=4, sync_every=4, batch_groups=32, queue_groups=128)
    assert not lag_pause(grpo, groups=32, unconsumed=127, trainer_update=40, version=40, mini_groups=32)
    assert lag_pause(grpo, groups=32, unconsumed=127, trainer_update=40, version=39, mini_groups=32)
    assert not lag_pause(grpo, groups=32, unconsumed=64, trainer_update=40, version=38, mini_groups=32)
    assert lag_pause(grpo, groups=32, unconsumed=64, trainer_update=40, version=37, mini_groups=32)
    # The CPU demo (max_lag 64, B_mini 8, batches up to 256, bound 192): never, even at the bound with
    # weights a whole sync interval old; so the async benchmark's figures do not move.
    demo = AsyncConfig(max_lag=64, sync_every=4, batch_groups=256, first_batch_groups=32, queue_groups=192)
    assert not lag_pause(demo, groups=256, unconsumed=191, trainer_update=100, version=96, mini_groups=8)


def _group(tag: str, version: int) -> RolloutGroup:
    samples = [
        RolloutSample(
            response_ids=[3, 4, 5 + j],
            behaviour_logprobs=[-0.5, -0.25, -1.0],
            finish_reason="stop",
            reward=float(j == 0),
            reward_reason="correct" if j == 0 else "wrong",
            advantage=0.5 - j,
        )
        for j in range(2)
    ]
    return RolloutGroup(prompt_id=tag, prompt_ids=[1, 2], answer="7", samples=samples, policy_version=version)


def _publish(root: Path, version: int) -> None:
    name = f"v{version:08d}-test"
    (root / name).mkdir(parents=True, exist_ok=True)
    write_json(root / POINTER, {"name": name, "version": version, "digest": ""})


class _Trainer:
    """The worker's view of the trainer: alive until ``done``."""

    def __init__(self) -> None:
        self.done = False

    def check(self) -> None:
        pass


class _FakeWorker(SimpleNamespace):
    """What ``_pause_for_lag`` reads of a ``worker.Worker`` (disk publications only)."""

    @property
    def holds(self):
        return self.subscription.current

    def refresh(self) -> float:
        return self.subscription.refresh(self.load)


def test_a_paused_worker_resumes_with_newer_weights(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron_mugrpo.asynchronous import worker as worker_module

    monkeypatch.setattr(worker_module, "POLL_S", 0.001)
    root, queue = tmp_path / "weights", tmp_path / "queue"
    _publish(root, 36)
    cfg = SimpleNamespace(
        async_=AsyncConfig(max_lag=4, sync_every=4, batch_groups=4, queue_groups=64),
        stages=SimpleNamespace(mini_groups=4),
    )
    writer, loaded = QueueWriter(queue, worker=0, vocab_size=VOCAB), []
    worker = _FakeWorker(
        cfg=cfg,
        index=0,
        role=SimpleNamespace(describe=lambda: "rollout worker 0 (rank 1)"),
        subscription=Subscription(root, retry_s=0.0),
        queue=writer,
        trainer=_Trainer(),
        load=loaded.append,
    )
    worker.subscription.refresh(worker.load)
    writer.append(0, [_group(f"0/{i}", 36) for i in range(12)])  # 12 groups = 3 updates ahead
    write_json(queue / "cursor.json", {"position": 0, "global_update": 40})

    # Trainer at update 40, weights of 36, 12 groups ahead: the batch's last group would be consumed at
    # update 43 with lag 7 > 4. Room in the queue, but generating now would be wasted.
    polls = []
    real_backlog = writer.backlog

    def backlog() -> tuple[int, int]:
        polls.append(1)
        if len(polls) == 5:
            _publish(root, 40)  # the trainer publishes: lag 3 at update 43
        return real_backlog()

    writer.backlog = backlog
    paused = worker_module._pause_for_lag(worker, 1)
    assert paused is not None and paused[0] > 0 and len(polls) == 6
    assert worker.subscription.current.version == 40 and loaded[-1].endswith("v00000040-test")

    assert worker_module._pause_for_lag(worker, 2) == (0.0, pytest.approx(0.0, abs=0.1))  # fresh: no pause
    _publish(root, 30)  # stale weights again (by hand), and the trainer ends during the pause
    worker.trainer.done = True
    assert worker_module._pause_for_lag(worker, 3) is None  # the trainer finished meanwhile: stop


def test_paused_batches_are_counted_apart_from_drops_and_once(tmp_path: Path) -> None:
    writer = QueueWriter(tmp_path, worker=0, vocab_size=VOCAB)
    writer.append(0, [_group("0/0", 0)], paused_s=0.0)
    writer.append(1, [_group("1/0", 0)], paused_s=1.5, idle_s=2.0)
    reader = QueueReader(tmp_path)
    reader.admit()
    assert (reader.cursor.paused, reader.cursor.dropped) == (1, 0)
    taken = reader.take(update=8, count=1, max_lag=4)  # both groups of version 0 are 8 updates old
    assert taken is None and reader.cursor.dropped == 2 and reader.cursor.paused == 1
    reader.publish_cursor(8)
    assert writer.backlog() == (0, 8)  # the worker's inputs: nothing unconsumed, the trainer at update 8

    saved = copy.deepcopy(reader.cursor)  # a checkpoint; a later shard arrives after it
    writer.append(2, [_group("2/0", 8)], paused_s=0.25)
    reader.admit()
    assert reader.cursor.paused == 2
    resumed = QueueReader(tmp_path, saved)  # the later shard is admitted again, and counted once
    resumed.admit()
    assert resumed.cursor.paused == 2 and resumed.cursor.shards == reader.cursor.shards
