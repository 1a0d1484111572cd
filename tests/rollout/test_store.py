"""Rollout store: round trip, checksums, resume after a crash, completeness, deterministic minibatches."""

import json
import math

import pytest

from megatron_mugrpo.records import RolloutGroup, RolloutSample, collate
from megatron_mugrpo.rollout.store import (
    MANIFEST,
    RolloutStore,
    RolloutStoreWriter,
    StoreError,
    is_complete,
    read_manifest,
    store_metrics,
)

VOCAB = 50
STAGE = 1
VERSION = 16


def make_group(index: int, num_samples: int = 3) -> RolloutGroup:
    samples = [
        RolloutSample(
            response_ids=[(index + j + t) % VOCAB for t in range(2 + (index + j) % 4)],
            # Dyadic values: exactly representable in float32, so the round trip is exact.
            behaviour_logprobs=[-0.25 * (t + 1) - j / 8 for t in range(2 + (index + j) % 4)],
            finish_reason="length" if j == 0 else "stop",
            reward=float(j % 2),
            reward_reason="correct" if j % 2 else "wrong",
            advantage=0.5 - j,
        )
        for j in range(num_samples)
    ]
    return RolloutGroup(
        prompt_id=f"p{index}",
        prompt_ids=[1, 2, index % VOCAB],
        answer=str(index),
        samples=samples,
        stage=STAGE,
        policy_version=VERSION,
    )


def open_writer(path, num_groups: int = 10, shard_groups: int = 4, **overrides) -> RolloutStoreWriter:
    kwargs = dict(
        stage=STAGE,
        policy_version=VERSION,
        engine="transformers",
        sampling={"temperature": 1.0, "max_new_tokens": 8, "seed": 3},
        num_groups=num_groups,
        shard_groups=shard_groups,
        vocab_size=VOCAB,
    )
    return RolloutStoreWriter.create_or_resume(path, **(kwargs | overrides))


def write_all(path, groups, shard_groups: int = 4, stop_after: int | None = None) -> RolloutStoreWriter:
    writer = open_writer(path, num_groups=len(groups), shard_groups=shard_groups)
    for shard in range(writer.next_shard_index, writer.num_shards):
        if stop_after is not None and shard >= stop_after:
            break
        writer.write_shard(shard, [groups[i] for i in writer.manifest.shard_range(shard)])
    return writer


def test_round_trip(tmp_path):
    groups = [make_group(i) for i in range(10)]
    write_all(tmp_path, groups)
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    assert manifest["complete"] is True
    assert [s["groups"] for s in manifest["shards"]] == [4, 4, 2]
    assert manifest["num_prompts"] == 10 and manifest["num_responses"] == 30
    assert all(len(s["sha256"]) == 64 for s in manifest["shards"])
    store = RolloutStore.open(tmp_path)
    assert store.num_groups == 10
    assert store.groups() == groups
    assert store.groups([7, 2]) == [groups[7], groups[2]]


def test_metrics_from_manifest(tmp_path):
    groups = [make_group(i) for i in range(10)]
    groups[0].samples = [
        RolloutSample(
            response_ids=[1],
            behaviour_logprobs=[-1.0],
            finish_reason="stop",
            reward=1.0,
            reward_reason="correct",
        )
    ] * 2
    write_all(tmp_path, groups)
    metrics = store_metrics(read_manifest(tmp_path))
    samples = [s for g in groups for s in g.samples]
    assert metrics["rollout/responses"] == len(samples)
    assert metrics["rollout/reward_mean"] == pytest.approx(sum(s.reward for s in samples) / len(samples))
    assert metrics["rollout/solve_all_frac"] == pytest.approx(1 / 10)
    assert metrics["rollout/solve_none_frac"] == 0.0
    assert metrics["rollout/finish_length_frac"] == pytest.approx(9 / len(samples))
    assert metrics["rollout/reason_correct"] == sum(s.reward_reason == "correct" for s in samples)


def test_corrupted_shard_is_detected(tmp_path):
    write_all(tmp_path, [make_group(i) for i in range(10)])
    shard = tmp_path / "shard_00001.parquet"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(StoreError, match=r"shard_00001\.parquet does not match its sha256.*delete"):
        RolloutStore.open(tmp_path)


def test_incomplete_store_is_never_read_as_complete(tmp_path):
    write_all(tmp_path, [make_group(i) for i in range(10)], stop_after=2)
    assert not is_complete(tmp_path)
    assert not RolloutStore.is_complete(tmp_path)
    with pytest.raises(StoreError, match=r"incomplete \(2/3 shards\)"):
        RolloutStore.open(tmp_path)
    assert not is_complete(tmp_path / "missing")


def test_resume_after_crash_writes_only_missing_shards(tmp_path):
    groups = [make_group(i) for i in range(10)]
    write_all(tmp_path, groups, stop_after=1)
    # A crash while writing shard 1: its temporary file exists, the manifest does not list it.
    (tmp_path / "shard_00001.parquet.tmp").write_bytes(b"partial")
    first_shard = (tmp_path / "shard_00000.parquet").stat().st_mtime_ns
    writer = open_writer(tmp_path)
    assert writer.next_shard_index == 1
    written = []
    for shard in range(writer.next_shard_index, writer.num_shards):
        writer.write_shard(shard, [groups[i] for i in writer.manifest.shard_range(shard)])
        written.append(shard)
    assert written == [1, 2]
    assert (tmp_path / "shard_00000.parquet").stat().st_mtime_ns == first_shard
    assert RolloutStore.open(tmp_path).groups() == groups


def test_resume_rewrites_from_first_corrupted_shard(tmp_path):
    write_all(tmp_path, [make_group(i) for i in range(10)], stop_after=2)
    (tmp_path / "shard_00001.parquet").write_bytes(b"garbage")
    writer = open_writer(tmp_path)
    assert writer.next_shard_index == 1
    assert not writer.manifest.complete


def test_resume_with_other_settings_is_refused(tmp_path):
    write_all(tmp_path, [make_group(i) for i in range(10)], stop_after=1)
    with pytest.raises(StoreError, match=r"policy_version=16.*delete the directory"):
        open_writer(tmp_path, policy_version=17)
    with pytest.raises(StoreError, match="sampling"):
        open_writer(tmp_path, sampling={"temperature": 0.7, "max_new_tokens": 8, "seed": 3})


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (lambda g: g.samples[1].behaviour_logprobs.__setitem__(0, math.nan), "not finite numbers <= 0"),
        (lambda g: g.samples[1].behaviour_logprobs.__setitem__(0, math.inf), "not finite numbers <= 0"),
        (lambda g: g.samples[1].behaviour_logprobs.__setitem__(0, 0.5), "not finite numbers <= 0"),
        (lambda g: g.samples[0].response_ids.__setitem__(0, VOCAB), "outside the vocabulary"),
        (lambda g: g.samples[0].response_ids.__setitem__(0, -1), "outside the vocabulary"),
        (lambda g: g.prompt_ids.append(VOCAB + 3), "prompt holds token ids"),
        (lambda g: g.samples[2].response_ids.append(1), "tokens but 2 behaviour"),
        (lambda g: setattr(g.samples[0], "finish_reason", "abort"), "finish_reason 'abort'"),
        (lambda g: setattr(g, "samples", []), "no responses"),
        (lambda g: setattr(g, "policy_version", 3), "policy version 3"),
    ],
)
def test_invalid_data_is_rejected_before_writing(tmp_path, corrupt, message):
    groups = [make_group(i, num_samples=3) for i in range(4)]
    for g in groups:
        for s in g.samples:
            s.response_ids, s.behaviour_logprobs = s.response_ids[:2], s.behaviour_logprobs[:2]
    corrupt(groups[2])
    writer = open_writer(tmp_path, num_groups=4)
    with pytest.raises(StoreError, match=message):
        writer.write_shard(0, groups)
    assert not list(tmp_path.glob("*.parquet*"))
    assert not is_complete(tmp_path)


def test_shards_must_be_written_in_order_and_full(tmp_path):
    writer = open_writer(tmp_path)
    with pytest.raises(StoreError, match="out of order"):
        writer.write_shard(1, [make_group(i) for i in range(4, 8)])
    with pytest.raises(StoreError, match="needs 4 groups, got 3"):
        writer.write_shard(0, [make_group(i) for i in range(3)])


def test_minibatches_are_deterministic_and_cover_each_epoch(tmp_path):
    write_all(tmp_path, [make_group(i) for i in range(10)])
    store = RolloutStore.open(tmp_path)
    assert store.updates_per_epoch(3) == 3
    orders = [store.minibatch_indices(u, 3, seed=7) for u in range(6)]
    assert orders == [RolloutStore.open(tmp_path).minibatch_indices(u, 3, seed=7) for u in range(6)]
    epoch0 = [i for batch in orders[:3] for i in batch]
    epoch1 = [i for batch in orders[3:] for i in batch]
    assert len(set(epoch0)) == 9 and len(set(epoch1)) == 9  # no repeats within an epoch
    assert epoch0 != epoch1  # a new permutation per epoch
    assert store.minibatch_indices(0, 3, seed=8) != orders[0] or store.minibatch_indices(1, 3, seed=8) != orders[1]
    groups = store.minibatch(4, 3, seed=7)
    assert [g.prompt_id for g in groups] == [f"p{i}" for i in orders[4]]
    batch = collate(groups, pad_id=0)
    assert batch.num_sequences == 9
    with pytest.raises(StoreError, match="mini_groups=11"):
        store.minibatch(0, 11, seed=7)
