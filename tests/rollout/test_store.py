"""Rollout store: round trip, checksums, several writers with claims, resume and repair, completeness,
memory-mapped reading with flat memory, deterministic minibatches."""

import hashlib
import json
import math
import multiprocessing
import shutil
import subprocess
import sys

import numpy as np
import pytest

from megatron_mugrpo.durable import Checksum
from megatron_mugrpo.records import RolloutGroup, RolloutSample, collate
from megatron_mugrpo.rollout.manifest import (
    FORMAT,
    MANIFEST,
    StoreManifest,
    is_complete,
    read_manifest,
    store_identity,
    store_metrics,
)
from megatron_mugrpo.rollout.shards import StoreError
from megatron_mugrpo.rollout.store import RolloutStore, ShardWriter, StorePlan, prepare_store, seal_store

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


def identity(num_groups: int = 10, shard_groups: int = 4, **overrides) -> StoreManifest:
    kwargs = dict(
        stage=STAGE,
        policy_version=VERSION,
        engine="transformers",
        sampling={"temperature": 1.0, "max_new_tokens": 8, "seed": 3},
        num_groups=num_groups,
        shard_groups=shard_groups,
        vocab_size=VOCAB,
    )
    return store_identity(**(kwargs | overrides))


def write_all(path, groups, shard_groups: int = 4, only=None, seal: bool = True) -> StorePlan:
    """Prepare, write the planned shards (or only those in ``only``), seal when all are written."""
    plan = prepare_store(path, identity(num_groups=len(groups), shard_groups=shard_groups))
    writer = ShardWriter(path, plan.manifest)
    for shard in plan.missing:
        if only is None or shard in only:
            assert writer.claim(shard)
            writer.write_shard(shard, [groups[i] for i in plan.manifest.shard_range(shard)])
    if seal and only is None:
        seal_store(path)
    return plan


def shard_hashes(path) -> dict[str, Checksum]:
    return {p.name: Checksum.of_file(p) for p in sorted(path.glob("shard_*.arrow"))}


def test_round_trip(tmp_path):
    groups = [make_group(i) for i in range(10)]
    write_all(tmp_path, groups)
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    assert manifest["complete"] is True
    assert [s["groups"] for s in manifest["shards"]] == [4, 4, 2]
    assert manifest["num_prompts"] == 10 and manifest["num_responses"] == 30
    assert all(s["checksum"]["algorithm"] == "xxh3_128" for s in manifest["shards"])
    store = RolloutStore.open(tmp_path)
    assert store.num_groups == 10
    assert store.groups() == groups
    assert store.groups([7, 2]) == [groups[7], groups[2]]


def test_a_store_with_sha256_records_still_opens_and_verifies(tmp_path):
    """Stores written before checksums named their algorithm hold a bare ``sha256`` per shard."""
    groups = [make_group(i) for i in range(10)]
    write_all(tmp_path, groups)
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    for shard in manifest["shards"]:
        del shard["checksum"]
        shard["sha256"] = hashlib.sha256((tmp_path / shard["file"]).read_bytes()).hexdigest()
    (tmp_path / MANIFEST).write_text(json.dumps(manifest))
    assert RolloutStore.open(tmp_path).groups() == groups
    (tmp_path / "shard_00002.arrow").write_bytes(b"garbage")
    with pytest.raises(StoreError, match=r"shard_00002\.arrow does not match its recorded sha256 checksum"):
        RolloutStore.open(tmp_path)


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


def test_corrupted_shard_is_detected_on_open(tmp_path):
    write_all(tmp_path, [make_group(i) for i in range(10)])
    shard = tmp_path / "shard_00001.arrow"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    # The advice must be something that works (it did not, when it said "delete the shard").
    with pytest.raises(StoreError, match=r"shard_00001\.arrow does not match its recorded xxh3_128 .*rerun the stage"):
        RolloutStore.open(tmp_path)


def test_unsealed_store_is_never_read_as_complete(tmp_path):
    write_all(tmp_path, [make_group(i) for i in range(10)], only={0, 2})
    assert not is_complete(tmp_path)
    assert not RolloutStore.is_complete(tmp_path)
    with pytest.raises(StoreError, match=r"incomplete \(0/3 shards sealed\)"):
        RolloutStore.open(tmp_path)
    with pytest.raises(StoreError, match="shard 1 was never written"):
        seal_store(tmp_path)
    assert not is_complete(tmp_path / "missing")


def test_claims_are_exclusive_and_removed_when_sealed(tmp_path):
    groups = [make_group(i) for i in range(10)]
    plan = prepare_store(tmp_path, identity())
    first, second = ShardWriter(tmp_path, plan.manifest), ShardWriter(tmp_path, plan.manifest)
    assert first.claim(0) and not second.claim(0) and second.claim(1) and not first.claim(1)
    for shard in range(3):
        (first if shard != 1 else second).claim(shard)
        (first if shard != 1 else second).write_shard(shard, [groups[i] for i in plan.manifest.shard_range(shard)])
    seal_store(tmp_path)
    assert not list(tmp_path.glob("*.claim"))
    assert RolloutStore.open(tmp_path).groups() == groups


def _race_for_claims(store_dir: str, manifest: StoreManifest, barrier, results) -> None:
    writer = ShardWriter(store_dir, manifest)
    barrier.wait()
    results.put([index for index in range(manifest.num_shards) if writer.claim(index)])


def test_claims_race_between_processes(tmp_path):
    """Two processes claiming the same 200 shards at once: every shard goes to exactly one of them."""
    plan = prepare_store(tmp_path, identity(num_groups=200, shard_groups=1))
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_race_for_claims, args=(str(tmp_path), plan.manifest, barrier, results)) for _ in "ab"]
    for proc in procs:
        proc.start()
    taken = [results.get(timeout=120) for _ in procs]
    for proc in procs:
        proc.join(timeout=60)
    assert sorted(taken[0] + taken[1]) == list(range(200))


def test_prepare_after_a_crash_keeps_finished_shards_and_clears_stale_claims(tmp_path):
    """Two hosts were killed mid-stage: shards 0 and 2 are finished; shard 1's host died holding its
    claim with a temporary file; shard 3's host died between renaming its shard and writing its record."""
    groups = [make_group(i) for i in range(14)]
    write_all(tmp_path, groups, only={0, 2})
    manifest = read_manifest(tmp_path)
    ShardWriter(tmp_path, manifest).claim(1)
    (tmp_path / "shard_00001.arrow.tmp").write_bytes(b"partial")
    ShardWriter(tmp_path, manifest).write_shard(3, groups[12:14])
    (tmp_path / "shard_00003.json").unlink()
    finished = {name: (tmp_path / name).stat().st_mtime_ns for name in ("shard_00000.arrow", "shard_00002.arrow")}

    plan = prepare_store(tmp_path, identity(num_groups=14))
    assert plan.missing == [1, 3] and plan.dropped == {}
    assert not list(tmp_path.glob("*.claim")) and not list(tmp_path.glob("*.tmp"))
    assert not (tmp_path / "shard_00003.arrow").exists()  # no record: not finished, regenerated
    assert {name: (tmp_path / name).stat().st_mtime_ns for name in finished} == finished
    writer = ShardWriter(tmp_path, plan.manifest)
    for shard in plan.missing:  # the stale claim does not block the resumed run
        assert writer.claim(shard)
        writer.write_shard(shard, [groups[i] for i in plan.manifest.shard_range(shard)])
    seal_store(tmp_path)
    assert RolloutStore.open(tmp_path).groups() == groups


def test_prepare_seals_a_store_whose_every_shard_was_written_before_the_seal_was_lost(tmp_path):
    """A process killed between its last shard and the seal (seen under Slurm: preempted in the rollout phase,
    requeued): the resumed run must not regenerate anything, nor open the store unsealed. prepare_store
    verifies every shard, seals the store and plans nothing; the shards are the ones written."""
    groups = [make_group(i) for i in range(10)]
    write_all(tmp_path, groups, seal=False)
    assert not is_complete(tmp_path)
    written = shard_hashes(tmp_path)

    plan = prepare_store(tmp_path, identity(num_groups=10))
    assert plan.missing == [] and plan.dropped == {} and plan.manifest.complete
    assert is_complete(tmp_path) and shard_hashes(tmp_path) == written
    assert RolloutStore.open(tmp_path).groups() == groups


def test_damaged_shard_of_a_sealed_store_is_dropped_and_regenerated(tmp_path):
    """D7: a corrupted or deleted shard of a complete store is found by prepare_store, the manifest
    is unsealed, and writing only those shards again restores the identical store."""
    groups = [make_group(i) for i in range(10)]
    write_all(tmp_path, groups)
    original, manifest_bytes = shard_hashes(tmp_path), (tmp_path / MANIFEST).read_bytes()
    (tmp_path / "shard_00001.arrow").write_bytes(b"garbage")
    (tmp_path / "shard_00002.arrow").unlink()

    plan = prepare_store(tmp_path, identity())
    assert plan.missing == [1, 2]
    assert "does not match its recorded xxh3_128 checksum" in plan.dropped[1] and "missing" in plan.dropped[2]
    assert not is_complete(tmp_path)
    with pytest.raises(StoreError, match="incomplete"):
        RolloutStore.open(tmp_path)
    writer = ShardWriter(tmp_path, plan.manifest)
    for shard in plan.missing:
        writer.claim(shard)
        writer.write_shard(shard, [groups[i] for i in plan.manifest.shard_range(shard)])
    seal_store(tmp_path)
    assert shard_hashes(tmp_path) == original
    assert (tmp_path / MANIFEST).read_bytes() == manifest_bytes
    assert prepare_store(tmp_path, identity()).missing == []  # intact now: nothing to do


def test_resume_with_other_settings_is_refused(tmp_path):
    write_all(tmp_path, [make_group(i) for i in range(10)], only={0})
    with pytest.raises(StoreError, match=r"policy_version=16.*delete the directory"):
        prepare_store(tmp_path, identity(policy_version=17))
    with pytest.raises(StoreError, match="sampling"):
        prepare_store(tmp_path, identity(sampling={"temperature": 0.7, "max_new_tokens": 8, "seed": 3}))
    # Completing an older stage's store keeps the policy version that made it.
    plan = prepare_store(tmp_path, identity(policy_version=17), keep_policy_version=True)
    assert plan.manifest.policy_version == VERSION and plan.missing == [1, 2]


def test_old_format_store_is_refused_with_advice(tmp_path):
    write_all(tmp_path, [make_group(i) for i in range(10)])
    data = json.loads((tmp_path / MANIFEST).read_text())
    data["format"] = "megatron_mugrpo.rollout_store/1"
    (tmp_path / MANIFEST).write_text(json.dumps(data))
    with pytest.raises(StoreError, match=rf"format 'megatron_mugrpo.rollout_store/1'.*reads '{FORMAT}'.*delete"):
        RolloutStore.open(tmp_path)
    with pytest.raises(StoreError, match="delete"):
        prepare_store(tmp_path, identity())


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
    plan = prepare_store(tmp_path, identity(num_groups=4))
    with pytest.raises(StoreError, match=message):
        ShardWriter(tmp_path, plan.manifest).write_shard(0, groups)
    assert not list(tmp_path.glob("shard_*"))
    assert not is_complete(tmp_path)


def test_shard_index_and_size_are_checked(tmp_path):
    plan = prepare_store(tmp_path, identity())
    writer = ShardWriter(tmp_path, plan.manifest)
    with pytest.raises(StoreError, match="outside the 3 shards"):
        writer.write_shard(3, [make_group(i) for i in range(4)])
    with pytest.raises(StoreError, match="needs 4 groups, got 3"):
        writer.write_shard(0, [make_group(i) for i in range(3)])
    writer.write_shard(2, [make_group(i) for i in range(8, 10)])  # any order: hosts finish when they finish


RSS_PROBE = """
import gc, sys
import psutil
from megatron_mugrpo.rollout.store import RolloutStore

def opened_rss(path):
    gc.collect()
    before = psutil.Process().memory_info().rss
    store = RolloutStore.open(path)          # verify=True: every shard is hashed too
    batch = store.minibatch(0, 4, seed=0)
    gc.collect()
    return psutil.Process().memory_info().rss - before, store, batch

opened_rss(sys.argv[1])                      # warm up imports and allocator pools
small = opened_rss(sys.argv[1])[0]
large = opened_rss(sys.argv[2])[0]
print(small, large)
"""


def _store_of(path, shard, copies: int) -> int:
    """A sealed store of ``copies`` identical shards (copies of one written shard); returns its bytes."""
    groups_per_shard = 100
    plan = prepare_store(path, identity(num_groups=groups_per_shard * copies, shard_groups=groups_per_shard))
    ShardWriter(path, plan.manifest).write_shard(0, shard)
    record = json.loads((path / "shard_00000.json").read_text())
    for index in range(1, copies):
        shutil.copyfile(path / "shard_00000.arrow", path / f"shard_{index:05d}.arrow")
        (path / f"shard_{index:05d}.json").write_text(
            json.dumps(record | {"index": index, "file": f"shard_{index:05d}.arrow"})
        )
    seal_store(path)
    return sum(p.stat().st_size for p in path.glob("*.arrow"))


def test_reading_a_ten_times_larger_store_keeps_memory_flat(tmp_path):
    """Shards are memory-mapped and hashed in 1 MiB reads: opening a 10x larger store and reading a
    minibatch raises this process's RSS by (almost) nothing more. Measured in a fresh subprocess."""
    tokens = 256
    shard = []
    for i in range(100):
        group = make_group(i, num_samples=8)
        for j, sample in enumerate(group.samples):
            sample.response_ids = [(i + j + t) % VOCAB for t in range(tokens)]
            sample.behaviour_logprobs = [-0.5] * tokens
        shard.append(group)
    small_bytes = _store_of(tmp_path / "small", shard, 3)
    large_bytes = _store_of(tmp_path / "large", shard, 30)
    assert large_bytes == 10 * small_bytes > 40 * 2**20
    proc = subprocess.run(
        [sys.executable, "-c", RSS_PROBE, str(tmp_path / "small"), str(tmp_path / "large")],
        capture_output=True,
        text=True,
        check=True,
    )
    small, large = map(int, proc.stdout.split())
    # Reading everything into memory would cost about large_bytes (45 MiB) more.
    assert large - small < 4 * 2**20, (small, large)


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


# ------------------------------------------------------------------ routes (moe.routing_replay=rollout)

LAYERS, TOPK = 2, 2


def routed_group(index: int, dtype=np.uint8, experts: int = 4) -> RolloutGroup:
    """``make_group`` whose responses carry routes: [prompt + response - 1, LAYERS, TOPK] distinct ids."""
    group = make_group(index)
    for j, sample in enumerate(group.samples):
        rows = len(group.prompt_ids) + len(sample.response_ids) - 1
        first = (np.arange(rows)[:, None] + np.arange(LAYERS)[None, :] + index + j) % experts
        sample.routes = np.stack([first, (first + 1 + j % (experts - 1)) % experts], axis=-1).astype(dtype)
    return group


def assert_same_routes(read: list[RolloutGroup], written: list[RolloutGroup]) -> None:
    for got, want in zip(read, written, strict=True):
        assert [s.response_ids for s in got.samples] == [s.response_ids for s in want.samples]
        for a, b in zip(got.samples, want.samples, strict=True):
            assert a.routes.dtype == b.routes.dtype and np.array_equal(a.routes, b.routes)


@pytest.mark.parametrize(("dtype", "experts"), [(np.uint8, 4), (np.int16, 300)])
def test_routes_round_trip_per_shard_listed_and_checksummed(tmp_path, dtype, experts):
    groups = [routed_group(i, dtype, experts) for i in range(10)]
    write_all(tmp_path, groups)
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    assert sorted(p.name for p in tmp_path.glob("routes_*")) == [f"routes_0000{i}.arrow" for i in range(3)]
    tokens = sum(len(s.routes) for g in groups for s in g.samples)
    listed = [s["routes"] for s in manifest["shards"]]
    assert [r["file"] for r in listed] == [f"routes_0000{i}.arrow" for i in range(3)]
    assert sum(r["tokens"] for r in listed) == tokens
    assert all(r["dtype"] == np.dtype(dtype).name and (r["moe_layers"], r["topk"]) == (LAYERS, TOPK) for r in listed)
    store = RolloutStore.open(tmp_path)
    assert store.manifest.shards[0].routes.bytes_per_token == LAYERS * TOPK * np.dtype(dtype).itemsize
    assert_same_routes(store.groups(), groups)
    assert_same_routes(store.groups([7, 2]), [groups[7], groups[2]])
    batch = collate(store.minibatch(0, 4, seed=1), pad_id=0)
    assert batch.routes is not None and batch.routes.shape[2:] == (LAYERS, TOPK)


def test_a_store_without_routes_is_unchanged_on_disk(tmp_path):
    write_all(tmp_path, [make_group(i) for i in range(10)])
    assert not list(tmp_path.glob("routes_*"))
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    assert all("routes" not in s for s in manifest["shards"])
    assert all(s.routes is None for g in RolloutStore.open(tmp_path).groups() for s in g.samples)


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (
            lambda p: p.write_bytes(p.read_bytes()[:-7] + b"garbage"),
            r"routes file .*routes_00001\.arrow does not match",
        ),
        (lambda p: p.unlink(), r"routes file .*routes_00001\.arrow of shard .* is missing"),
    ],
)
def test_a_damaged_routes_file_is_found_on_open_and_regenerated(tmp_path, damage, message):
    groups = [routed_group(i) for i in range(10)]
    write_all(tmp_path, groups)
    original = Checksum.of_file(tmp_path / "routes_00001.arrow")
    damage(tmp_path / "routes_00001.arrow")
    with pytest.raises(StoreError, match=message + ".*rerun the stage"):
        RolloutStore.open(tmp_path)
    plan = prepare_store(tmp_path, identity())
    assert plan.missing == [1]
    writer = ShardWriter(tmp_path, plan.manifest)
    writer.claim(1)
    writer.write_shard(1, [groups[i] for i in plan.manifest.shard_range(1)])
    seal_store(tmp_path)
    assert Checksum.of_file(tmp_path / "routes_00001.arrow") == original
    assert_same_routes(RolloutStore.open(tmp_path).groups(), groups)


def test_a_routes_file_of_another_layout_is_refused_when_read(tmp_path):
    write_all(tmp_path, [routed_group(i) for i in range(10)])
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    manifest["shards"][0]["routes"]["topk"] = 3  # a record that does not describe its file
    (tmp_path / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(StoreError, match=r"routes_00000\.arrow has columns .*rerun the stage"):
        RolloutStore.open(tmp_path).groups([0])


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (lambda s: setattr(s, "routes", s.routes[:-1]), r"response 1 has routes of shape .* rows, not \d+ \(prompt 3"),
        (lambda s: setattr(s, "routes", s.routes.astype(np.int32)), "dtype int32"),
        (lambda s: setattr(s, "routes", s.routes[:, :1]), r"per token, the shard's first response \(2, 2\)"),
        (lambda s: s.routes.__setitem__((0, 1, 1), s.routes[0, 1, 0]), "an expert repeated"),
        (lambda s: setattr(s, "routes", None), r"1 of 12 responses\) carry no routes"),
    ],
)
def test_bad_routes_are_refused_before_writing(tmp_path, corrupt, message):
    groups = [routed_group(i) for i in range(4)]
    corrupt(groups[2].samples[1])
    plan = prepare_store(tmp_path, identity(num_groups=4))
    with pytest.raises(StoreError, match=message + ".*"):
        ShardWriter(tmp_path, plan.manifest).write_shard(0, groups)
    assert not list(tmp_path.glob("shard_*")) and not list(tmp_path.glob("routes_*"))


def test_a_routes_file_without_its_record_is_cleared_as_a_leftover(tmp_path):
    groups = [routed_group(i) for i in range(10)]
    write_all(tmp_path, groups, only={0}, seal=False)
    (tmp_path / "routes_00001.arrow").write_bytes(b"written before a crash took the record")
    plan = prepare_store(tmp_path, identity())
    assert plan.missing == [1, 2] and (tmp_path / "routes_00000.arrow").is_file()
    assert not (tmp_path / "routes_00001.arrow").exists()
