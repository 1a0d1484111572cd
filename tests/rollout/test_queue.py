"""The async rollout queue: lag scan, arrival order, exactly-once consumption across a resume, the bound,
half-written shards, checksums."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import numpy as np
import pytest

from megatron_mugrpo.records import RolloutGroup, RolloutSample, collate
from megatron_mugrpo.rollout.queue import (
    CURSOR_FILE,
    QueueCursor,
    QueueReader,
    QueueWriter,
    group_lag,
    scan,
    shard_name,
)
from megatron_mugrpo.rollout.shards import StoreError

VOCAB = 50


def make_group(tag: str, version: int, reward: float = 1.0) -> RolloutGroup:
    samples = [
        RolloutSample(
            response_ids=[3, 4, j + 5],
            behaviour_logprobs=[-0.5, -0.25, -1.0],
            finish_reason="stop",
            reward=reward if j == 0 else 0.0,
            reward_reason="correct" if j == 0 and reward else "wrong",
            advantage=0.5 - j,
        )
        for j in range(2)
    ]
    return RolloutGroup(prompt_id=tag, prompt_ids=[1, 2], answer="7", samples=samples, policy_version=version)


def append(writer: QueueWriter, batch: int, version: int, groups: int = 2, arrival: int | None = None) -> list[str]:
    """Write a shard of ``groups`` groups tagged '<worker>/<batch>/<i>'; ``arrival`` pins the record's mtime."""
    tags = [f"{writer.worker}/{batch}/{i}" for i in range(groups)]
    writer.append(batch, [make_group(t, version) for t in tags], idle_s=1.0, generate_s=3.0)
    if arrival is not None:
        record = writer.queue_dir / f"{shard_name(writer.worker, batch)}.json"
        os.utime(record, ns=(arrival, arrival))
    return tags


def tags(taken) -> list[str]:
    return [g.prompt_id for g in taken.groups]


def test_scan_takes_fresh_groups_in_order_and_drops_stale_ones() -> None:
    # update 8, max_lag 2: lags 8, 8, 3, 2, 1, 0 → the first three are dropped, the next two taken.
    taken, dropped = scan([0, 0, 5, 6, 7, 8], update=8, need=2, max_lag=2)
    assert (taken, dropped) == ([3, 4], [0, 1, 2])
    assert scan([0, 7], update=8, need=3, max_lag=2) == ([1], [0])  # not enough: all scanned
    assert scan([5, 6], update=8, need=0, max_lag=2) == ([], [])


def test_lag_of_a_group_newer_than_the_trainer_is_zero() -> None:
    assert group_lag(10, 6) == 4
    assert group_lag(8, 12) == 0  # sampled with weights published after the checkpoint a resume restarted from


def test_arrival_order_exactly_once_and_resume(tmp_path: Path) -> None:
    w0, w1 = QueueWriter(tmp_path, worker=0, vocab_size=VOCAB), QueueWriter(tmp_path, worker=1, vocab_size=VOCAB)
    a = append(w1, 0, version=0, arrival=1_000)
    b = append(w0, 0, version=0, arrival=2_000)
    reader = QueueReader(tmp_path)
    assert [r.name for r in reader.admit()] == ["w001_b0000000", "w000_b0000000"]  # arrival, not name, order
    first = reader.take(update=0, count=3, max_lag=4)
    assert tags(first) == a + b[:1] and first.lags == [0, 0, 0] and first.dropped == 0
    checkpoint = copy.deepcopy(reader.cursor)  # what a checkpoint after update 1 holds
    c = append(w0, 1, version=1, arrival=3_000)
    reader.admit()
    second = reader.take(update=1, count=3, max_lag=4)
    assert tags(second) == b[1:] + c

    resumed = QueueReader(tmp_path, checkpoint)  # the trainer died after update 2, resumed from update 1
    resumed.admit()
    again = resumed.take(update=1, count=3, max_lag=4)
    assert tags(again) == tags(second)  # the lost update's groups, again; none of update 1's
    assert resumed.take(update=2, count=1, max_lag=4) is None  # everything written has been consumed
    assert resumed.cursor.position == 6 == len(a + b + c)
    assert resumed.cursor.shards == ["w001_b0000000", "w000_b0000000", "w000_b0000001"]


def test_stale_groups_are_dropped_counted_and_consumed(tmp_path: Path) -> None:
    writer = QueueWriter(tmp_path, worker=0, vocab_size=VOCAB)
    append(writer, 0, version=0, groups=3, arrival=1)
    fresh = append(writer, 1, version=8, groups=2, arrival=2)
    reader = QueueReader(tmp_path)
    reader.admit()
    taken = reader.take(update=10, count=2, max_lag=4)  # version 0 has lag 10 > 4
    assert tags(taken) == fresh and taken.dropped == 3 and taken.lags == [2, 2]
    assert (reader.cursor.position, reader.cursor.dropped) == (5, 3)


def test_an_update_is_assembled_across_arrivals(tmp_path: Path) -> None:
    """Groups scanned while waiting stay consumed (workers see the room at once); drops are counted once."""
    writer = QueueWriter(tmp_path, worker=0, vocab_size=VOCAB)
    append(writer, 0, version=0, groups=1, arrival=1)
    first = append(writer, 1, version=6, groups=1, arrival=2)
    reader = QueueReader(tmp_path)
    reader.admit()
    assert reader.take(update=6, count=2, max_lag=2) is None
    assert reader.cursor.position == 2  # both scanned: one dropped, one held for the update
    reader.publish_cursor(6)
    assert writer.unconsumed() == 0
    second = append(writer, 2, version=6, groups=1, arrival=3)
    reader.admit()
    taken = reader.take(update=6, count=2, max_lag=2)
    assert tags(taken) == first + second and taken.dropped == 1


def test_workers_see_the_backlog_through_the_trainers_cursor(tmp_path: Path) -> None:
    writer = QueueWriter(tmp_path, worker=0, vocab_size=VOCAB)
    other = QueueWriter(tmp_path, worker=1, vocab_size=VOCAB)
    append(writer, 0, version=0, groups=3)
    append(other, 0, version=0, groups=2)
    assert writer.unconsumed() == 5  # no cursor.json yet: nothing consumed
    reader = QueueReader(tmp_path)
    reader.admit()
    reader.take(update=0, count=4, max_lag=4)
    reader.publish_cursor(1)
    assert (tmp_path / CURSOR_FILE).is_file()
    assert writer.unconsumed() == 1 and other.unconsumed() == 1


def test_a_half_written_shard_is_discarded_and_its_batch_redone(tmp_path: Path) -> None:
    writer = QueueWriter(tmp_path, worker=0, vocab_size=VOCAB)
    append(writer, 0, version=0)
    append(writer, 1, version=0)
    # Killed while writing batch 2: its shard renamed but no record yet; batch 3's shard still a temporary.
    (tmp_path / "w000_b0000002.arrow").write_bytes(b"partial")
    (tmp_path / "w000_b0000002.routes.arrow").write_bytes(b"partial")  # its routes (moe.routing_replay)
    (tmp_path / "w000_b0000003.arrow.tmp").write_bytes(b"partial")
    (tmp_path / "w001_b0000000.arrow.tmp").write_bytes(b"another worker's")
    reader = QueueReader(tmp_path)
    assert [r.name for r in reader.admit()] == ["w000_b0000000", "w000_b0000001"]  # the shard without record is unseen
    restarted = QueueWriter(tmp_path, worker=0, vocab_size=VOCAB)
    assert restarted.resume_batch() == 2
    left = sorted(p.name for p in tmp_path.iterdir())
    assert "w000_b0000002.arrow" not in left and "w000_b0000003.arrow.tmp" not in left
    assert "w000_b0000002.routes.arrow" not in left
    assert "w001_b0000000.arrow.tmp" in left  # another worker's files are its own business
    append(restarted, 2, version=4)
    assert [r.name for r in reader.admit()] == ["w000_b0000002"]


def test_invalid_groups_are_refused_before_anything_is_written(tmp_path: Path) -> None:
    writer = QueueWriter(tmp_path, worker=0, vocab_size=VOCAB)
    bad = make_group("bad", 0)
    bad.samples[0].response_ids[0] = VOCAB + 3
    with pytest.raises(StoreError, match="outside the vocabulary"):
        writer.append(0, [make_group("ok", 0), bad])
    with pytest.raises(StoreError, match="mixes policy versions"):
        writer.append(0, [make_group("a", 0), make_group("b", 1)])
    assert list(tmp_path.iterdir()) == []


def test_a_corrupted_shard_is_an_error_naming_it(tmp_path: Path) -> None:
    writer = QueueWriter(tmp_path, worker=0, vocab_size=VOCAB)
    append(writer, 0, version=0)
    shard = tmp_path / "w000_b0000000.arrow"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(StoreError, match=r"w000_b0000000\.arrow does not match its recorded xxh3_128 checksum"):
        QueueReader(tmp_path).admit()


def test_a_cursor_naming_a_missing_shard_is_refused(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="no record of it"):
        QueueReader(tmp_path, QueueCursor(shards=["w000_b0000009"], position=1))


def test_records_carry_statistics_and_worker_times(tmp_path: Path) -> None:
    writer = QueueWriter(tmp_path, worker=2, vocab_size=VOCAB)
    record = writer.append(5, [make_group("x", 3), make_group("y", 3, reward=0.0)], idle_s=0.5, load_s=0.25)
    assert (record.name, record.groups, record.responses, record.policy_version) == ("w002_b0000005", 2, 4, 3)
    assert record.stats["reward_sum"] == 1.0 and record.stats["solve_none"] == 1.0
    assert (record.idle_s, record.load_s) == (0.5, 0.25)
    reader = QueueReader(tmp_path)
    assert reader.admit()[0] == record


# ------------------------------------------------------------------ routes (moe.routing_replay=rollout)


def routed(group: RolloutGroup, seed: int, dtype=np.uint8, experts: int = 4) -> RolloutGroup:
    """``group`` whose responses carry routes: [prompt + response - 1, 2 layers, top-2] distinct ids."""
    rng = np.random.default_rng(seed)
    for sample in group.samples:
        rows = len(group.prompt_ids) + len(sample.response_ids) - 1
        sample.routes = np.stack([rng.permutation(experts)[:2] for _ in range(rows * 2)]).reshape(rows, 2, 2)
        sample.routes = sample.routes.astype(dtype)
    return group


def assert_same_routes(read: list[RolloutGroup], written: list[RolloutGroup]) -> None:
    for a_group, b_group in zip(read, written, strict=True):
        for a, b in zip(a_group.samples, b_group.samples, strict=True):
            assert a.routes.dtype == b.routes.dtype and a.routes.tobytes() == b.routes.tobytes()


@pytest.mark.parametrize(("dtype", "experts"), [(np.uint8, 4), (np.int16, 300)])
def test_routes_round_trip_through_the_queue_into_collate(tmp_path: Path, dtype, experts) -> None:
    """Under moe.routing_replay=rollout a worker's shard carries every response's routes in the engine's
    dtype (a routes file next to it, checksummed in the record); the trainer reads them back bit for bit,
    also after a resume, and collate fills TrainBatch.routes. A dense shard stays as it was."""
    writer = QueueWriter(tmp_path, worker=0, vocab_size=VOCAB)
    written = [routed(make_group(f"0/0/{i}", 0), seed=i, dtype=dtype, experts=experts) for i in range(3)]
    record = writer.append(0, written)
    assert record.routes is not None and record.routes.dtype == np.dtype(dtype).name
    assert (tmp_path / "w000_b0000000.routes.arrow").is_file()
    append(writer, 1, version=0)  # dense: no routes file, no routes key
    assert not (tmp_path / "w000_b0000001.routes.arrow").exists()
    assert "routes" not in json.loads((tmp_path / "w000_b0000001.json").read_text())
    reader = QueueReader(tmp_path)
    reader.admit()
    taken = reader.take(update=0, count=2, max_lag=4)
    assert_same_routes(taken.groups, written[:2])
    batch = collate(taken.groups, pad_id=0)
    assert batch.routes is not None and tuple(batch.routes.shape) == (4, 5, 2, 2)
    resumed = QueueReader(tmp_path, reader.cursor)  # the third group is read again from the files
    assert_same_routes(resumed.take(update=0, count=1, max_lag=4).groups, written[2:])


def test_damaged_or_partial_routes_in_the_queue_are_errors_naming_them(tmp_path: Path) -> None:
    writer = QueueWriter(tmp_path, worker=0, vocab_size=VOCAB)
    half = [routed(make_group("a", 0), seed=0), make_group("b", 0)]
    with pytest.raises(StoreError, match=r"worker 0 batch 0: prompt 'b' response 0.* carry no routes"):
        writer.append(0, half)
    short = routed(make_group("c", 0), seed=1)
    short.samples[1].routes = short.samples[1].routes[:-1]
    with pytest.raises(StoreError, match=r"response 1 has routes of shape .* rows, not 4"):
        writer.append(0, [short])
    assert list(tmp_path.iterdir()) == []
    writer.append(0, [routed(make_group("d", 0), seed=2)])
    routes_file = tmp_path / "w000_b0000000.routes.arrow"
    routes_file.write_bytes(routes_file.read_bytes()[:-8] + bytes(8))
    with pytest.raises(StoreError, match=r"rollout queue: .*routes\.arrow does not match .*checksum.*damaged"):
        QueueReader(tmp_path).admit()
    routes_file.unlink()
    with pytest.raises(StoreError, match=r"rollout queue: .*routes\.arrow is missing"):
        QueueReader(tmp_path).admit()
