"""The stage reference pass (π_train(θ_old) on D_k): scores equal the trainer's log-probs, the per-shard
files round-trip, are listed in the store's manifest and bound to their shards and to θ_old, memory
stays flat in D_k, the metrics subsample, and a corrected update sees the policy ratio π_θ / π_old = 1
at a stage's first update."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from dist_utils import run_distributed

from megatron_mugrpo.algorithms.rollout_correction import RolloutCorrectionConfig
from megatron_mugrpo.records import RolloutGroup, RolloutSample, collate
from megatron_mugrpo.rollout.store import (
    MANIFEST,
    RolloutStore,
    ShardWriter,
    prepare_store,
    seal_store,
    store_identity,
    write_store,
)
from megatron_mugrpo.training.optimizer import OptimConfig
from megatron_mugrpo.training.parallel import initialize_parallel
from megatron_mugrpo.training.setup import build_policy
from megatron_mugrpo.training.stage_reference import (
    OLD_LOGPROBS_GLOB,
    ScoreSettings,
    StageReferenceError,
    minibatch,
    prepare_stage_reference,
    read_old_logprobs,
)
from megatron_mugrpo.training.train_step import forward_logprobs

from .common import VOCAB, hf_config, make_batch, mu_grpo_step

SETTINGS = ScoreSettings(temperature=0.9, micro_batch_size=3, impl="fused", pad_id=0, chunk_groups=2)


def _groups(batch_seed: int, count: int) -> list[RolloutGroup]:
    """``count`` groups of 4 responses with random behaviour log-probs (make_batch's generator)."""
    import random

    from megatron_mugrpo.records import RolloutSample

    rng = random.Random(batch_seed)
    groups = []
    for g in range(count):
        prompt = [rng.randrange(3, VOCAB) for _ in range(rng.randint(2, 5))]
        samples = []
        for _ in range(4):
            length = rng.randint(1, 6)
            samples.append(
                RolloutSample(
                    response_ids=[rng.randrange(3, VOCAB) for _ in range(length)],
                    behaviour_logprobs=[-4.6 + rng.uniform(-0.5, 0.5) for _ in range(length)],
                    finish_reason="stop",
                    reward=float(rng.random() < 0.5),
                    advantage=rng.uniform(-1, 1),
                )
            )
        groups.append(RolloutGroup(prompt_id=str(g), prompt_ids=prompt, answer="", samples=samples))
    return groups


def _store(path, groups: list[RolloutGroup]) -> RolloutStore:
    return write_store(
        path,
        groups,
        stage=0,
        policy_version=0,
        engine="test",
        sampling={},
        shard_groups=3,
        vocab_size=VOCAB,
    )


def _policy():
    groups = initialize_parallel(1, 1, seed=0)
    return build_policy(hf_config(), groups=groups, dtype=torch.float32, optim=OptimConfig(lr=1e-3))


def _prepare(policy, store, *, first_update: bool, correction=None, measure=False, version=0, barriers=None):
    return prepare_stage_reference(
        policy,
        store,
        correction=correction or RolloutCorrectionConfig(tis_cap=2.0),
        measure=measure,
        first_update=first_update,
        settings=SETTINGS,
        seed=0,
        write=True,
        policy_version=version,
        barrier=(lambda: barriers.append(1)) if barriers is not None else (lambda: None),
    )


def _reference_scores_and_file(rank: int, world_size: int, tmp_path) -> None:
    policy = _policy()
    store = _store(tmp_path / "stage", _groups(0, 5))
    barriers: list[int] = []
    old, metrics = _prepare(policy, store, first_update=True, version=12, barriers=barriers)
    assert barriers == [1]  # every rank waits for rank 0's files before reading them
    # The same numbers as one forward_logprobs over the collated store, response positions only.
    batch = collate(store.groups(), pad_id=0)
    full = forward_logprobs(policy, batch, temperature=0.9, micro_batch_size=4)
    mask = batch.response_mask.bool()
    everything = old.rows(range(store.num_groups))
    flat = torch.tensor([lp for per_group in everything for lps in per_group for lp in lps])
    torch.testing.assert_close(flat, full[mask], atol=2e-6, rtol=0)
    gap = (full - batch.behaviour_logprobs).abs()[mask]
    assert metrics["rollout/mismatch_logprob_abs_max"] == pytest.approx(float(gap.max()), abs=1e-5)
    assert metrics["rollout/mismatch_logprob_abs_mean"] == pytest.approx(float(gap.mean()), abs=1e-6)
    assert metrics["rollout/mismatch_tokens"] == float(mask.sum())
    # One file per shard, next to it, listed in the manifest with its checksum, its shard's and θ_old's version.
    listing = json.loads((store.store_dir / MANIFEST).read_text())["old_logprobs"]
    assert listing["policy_version"] == 12
    assert [info["file"] for info in listing["shards"]] == ["old_logprobs_00000.arrow", "old_logprobs_00001.arrow"]
    assert sorted(p.name for p in store.store_dir.glob(OLD_LOGPROBS_GLOB)) == [i["file"] for i in listing["shards"]]
    shard_sums = [s.checksum.hexdigest for s in RolloutStore.open(store.store_dir).manifest.shards]
    assert [info["shard_checksum"] for info in listing["shards"]] == shard_sums
    # A run resumed after the first update reads the same values back; no metrics then.
    again, none = _prepare(policy, RolloutStore.open(store.store_dir), first_update=False, measure=True, version=12)
    assert again.rows(range(5)) == everything and none == {}  # float32 values round-trip exactly
    # Attached to a minibatch, aligned with the responses.
    groups = minibatch(store, 1, 2, 0, again)
    indices = store.minibatch_indices(1, 2, 0)
    assert [s.old_logprobs for s in groups[0].samples] == everything[indices[0]]
    # Scored again at a new stage start: the listing is replaced, never two.
    _prepare(policy, store, first_update=True, version=13)
    assert read_old_logprobs(store).policy_version == 13 and len(list(store.store_dir.glob(OLD_LOGPROBS_GLOB))) == 2


def _stale_or_missing_file_is_refused(rank: int, world_size: int, tmp_path) -> None:
    policy = _policy()
    store = _store(tmp_path / "stage", _groups(1, 4))
    with pytest.raises(StageReferenceError, match="has no log π_old"):
        read_old_logprobs(store)
    _prepare(policy, store, first_update=True, version=4)
    with pytest.raises(StageReferenceError, match="computed by the weights of update 4"):
        _prepare(policy, store, first_update=False, version=8)  # a stage that started elsewhere
    # A file altered after it was listed: its checksum in the manifest no longer matches.
    path = store.store_dir / "old_logprobs_00001.arrow"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(StageReferenceError, match="does not match its checksum"):
        read_old_logprobs(store)
    path.unlink()
    with pytest.raises(StageReferenceError, match="missing"):
        read_old_logprobs(store)
    # A shard damaged and regenerated: the store is unsealed and its log π_old unlisted and deleted.
    _prepare(policy, store, first_update=True, version=4)
    (store.store_dir / "shard_00000.arrow").write_bytes(b"damaged")
    plan = prepare_store(store.store_dir, store.manifest)
    assert plan.missing == [0] and not list(store.store_dir.glob(OLD_LOGPROBS_GLOB))
    assert json.loads((store.store_dir / MANIFEST).read_text())["old_logprobs"] is None


def _metrics_only_on_a_subsample(rank: int, world_size: int, tmp_path) -> None:
    policy = _policy()
    store = _store(tmp_path / "stage", _groups(2, 6))
    correction = RolloutCorrectionConfig(mismatch_groups=2)
    old, metrics = _prepare(policy, store, correction=correction, measure=True, first_update=True)
    assert old is None and not list(store.store_dir.glob(OLD_LOGPROBS_GLOB))
    assert metrics["rollout/mismatch_kl"] > 0 and metrics["rollout/mismatch_logprob_abs_mean"] > 0
    assert metrics["rollout/mismatch_tokens"] < sum(len(s.response_ids) for g in store.groups() for s in g.samples)
    off, nothing = _prepare(policy, store, correction=correction, measure=False, first_update=True)
    assert off is None and nothing == {}


def _corrected_first_update_sees_policy_ratio_one(rank: int, world_size: int, tmp_path) -> None:
    """At a stage's first update π_θ = π_old: the corrected loss's ratio is exactly 1 although β differs,
    and the weight mean is the mean of min(π_old / β, C)."""
    policy = _policy()
    batch = make_batch(5)
    batch.old_logprobs = forward_logprobs(policy, batch, temperature=1.0, micro_batch_size=4)
    correction = RolloutCorrectionConfig(tis_cap=2.0)
    # one micro-batch: its metrics are the batch's
    metrics = mu_grpo_step(policy, batch, batch.num_sequences, rollout_correction=correction)
    assert metrics["train/ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    mask = batch.response_mask.bool()
    factor = (batch.old_logprobs - batch.behaviour_logprobs)[mask].double().exp()
    assert metrics["train/rollout_corr_weight_mean"] == pytest.approx(float(factor.clamp(max=2.0).mean()), rel=1e-5)
    assert metrics["train/rollout_corr_truncated_frac"] == pytest.approx(float((factor > 2.0).double().mean()))
    assert metrics["train/rollout_logprob_abs_diff_max"] > 0.1  # β still differs from the trainer


def _budget_and_packed_scoring_equal_fixed_rows(rank: int, world_size: int, tmp_path) -> None:
    """The scoring pass (stage reference, HDR) cuts rows as the update does: token-budget micro-batches
    and packed rows score every response token as fixed rows do (float32: 1e-6 unpacked, 1e-5 packed)."""
    from megatron_mugrpo.training.stage_reference import score_groups

    policy = _policy()
    groups = _groups(3, 5)  # rows of 3-11 tokens, and one of 16 that two short rows share when packed
    long = dataclasses.replace(groups[0].samples[0], response_ids=list(range(3, 17)), behaviour_logprobs=[-4.6] * 14)
    groups[0] = dataclasses.replace(groups[0], samples=[long, *groups[0].samples[1:]])
    fixed = score_groups(policy, groups, SETTINGS)

    def flat(scores):
        return torch.tensor([lp for per_group in scores for lps in per_group for lp in lps])

    for budget, pack, tolerance in ((16, False, 1e-6), (40, False, 1e-6), (40, True, 1e-5)):
        settings = dataclasses.replace(SETTINGS, micro_batch_tokens=budget, pack_sequences=pack)
        torch.testing.assert_close(flat(score_groups(policy, groups, settings)), flat(fixed), atol=tolerance, rtol=0)


@pytest.mark.parametrize(
    "body",
    [
        _reference_scores_and_file,
        _budget_and_packed_scoring_equal_fixed_rows,
        _stale_or_missing_file_is_refused,
        _metrics_only_on_a_subsample,
        _corrected_first_update_sees_policy_ratio_one,
    ],
    ids=lambda fn: fn.__name__.strip("_"),
)
def test_single_rank(body, tmp_path):
    run_distributed(body, 1, tmp_path)


# ------------------------------------------------------------------------------------ memory


RSS_PROBE = """
import gc, resource, sys
import psutil, torch
from megatron_mugrpo.algorithms.rollout_correction import RolloutCorrectionConfig
from megatron_mugrpo.rollout.store import RolloutStore
from megatron_mugrpo.training import stage_reference as ref

# The trainer's forward pass is not what is measured: a stand-in scores every target -0.5.
ref.teacher_forced_logprobs = lambda policy, batch, settings: torch.full(batch.targets.shape, -0.5)
settings = ref.ScoreSettings(temperature=1.0, micro_batch_size=8, impl="unfused", pad_id=0, chunk_groups=8)

def peak():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

def passes(path):
    store = RolloutStore.open(path, verify=False)
    kw = dict(correction=RolloutCorrectionConfig(tis_cap=2.0), measure=True, settings=settings, seed=0,
              write=True, policy_version=0, barrier=lambda: None)
    old, metrics = ref.prepare_stage_reference(None, store, first_update=True, **kw)   # score + write
    assert metrics["rollout/mismatch_tokens"] == store.manifest.num_responses * 256
    old, _ = ref.prepare_stage_reference(None, RolloutStore.open(path, verify=False), first_update=False, **kw)
    batch = ref.minibatch(old.store, 0, 4, 0, old)   # resume: read back, verify every file, attach
    assert all(s.old_logprobs == [-0.5] * 256 for g in batch for s in g.samples)
    gc.collect()

passes(sys.argv[1])            # warm up imports and allocator pools
before = peak()
passes(sys.argv[1])
small = peak()
passes(sys.argv[2])
large = peak()
print(small - before, large - small)
"""


def _store_of(path: Path, copies: int) -> int:
    """A sealed store of ``copies`` identical shards of 100 groups × 8 responses × 256 tokens; returns
    the bytes of log π_old it will have (float32 per token)."""
    shard = []
    for i in range(100):
        samples = [
            RolloutSample(
                response_ids=[(i + j + t) % VOCAB for t in range(256)],
                behaviour_logprobs=[-0.5] * 256,
                finish_reason="stop",
                reward=float(j % 2),
                advantage=float(j % 2) - 0.5,
            )
            for j in range(8)
        ]
        shard.append(RolloutGroup(prompt_id=str(i), prompt_ids=[1, 2, 3], answer="", samples=samples))
    plan = prepare_store(
        path,
        store_identity(
            stage=0,
            policy_version=0,
            engine="test",
            sampling={},
            num_groups=100 * copies,
            shard_groups=100,
            vocab_size=VOCAB,
        ),
    )
    ShardWriter(path, plan.manifest).write_shard(0, shard)
    record = json.loads((path / "shard_00000.json").read_text())
    for index in range(1, copies):
        shutil.copyfile(path / "shard_00000.arrow", path / f"shard_{index:05d}.arrow")
        (path / f"shard_{index:05d}.json").write_text(
            json.dumps(record | {"index": index, "file": f"shard_{index:05d}.arrow"})
        )
    seal_store(path)
    return copies * 100 * 8 * 256 * 4


def test_log_pi_old_of_a_ten_times_larger_stage_keeps_memory_flat(tmp_path: Path) -> None:
    """Scoring and writing log π_old shard by shard, then reading it back on resume (every file verified,
    a minibatch attached): 10× more data raises the process's peak memory by no more than a few MiB.
    Holding log π_old as Python lists, as before, would cost hundreds of MiB more for the larger store."""
    small_bytes = _store_of(tmp_path / "small", 3)
    large_bytes = _store_of(tmp_path / "large", 30)
    assert large_bytes == 10 * small_bytes > 20 * 2**20
    proc = subprocess.run(
        [sys.executable, "-c", RSS_PROBE, str(tmp_path / "small"), str(tmp_path / "large")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    small, large = map(int, proc.stdout.split())
    print(f"peak RSS growth: small store {small / 2**20:.2f} MiB, 10x store {large / 2**20:.2f} MiB")
    assert large < 4 * 2**20, (small, large)
    assert len(list((tmp_path / "large").glob(OLD_LOGPROBS_GLOB))) == 30
