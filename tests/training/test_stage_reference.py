"""The stage reference pass (π_train(θ_old) on D_k): scores equal the trainer's log-probs, the stored
file round-trips and is bound to its store, the metrics subsample, and a corrected update sees the
policy ratio π_θ / π_old = 1 at a stage's first update."""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_distributed

from megatron_mugrpo.algorithms.rollout_correction import RolloutCorrectionConfig
from megatron_mugrpo.config import AlgoConfig, OptimConfig
from megatron_mugrpo.records import RolloutGroup, collate
from megatron_mugrpo.rollout.store import RolloutStore, write_store
from megatron_mugrpo.training.parallel import initialize_parallel
from megatron_mugrpo.training.setup import build_policy
from megatron_mugrpo.training.stage_reference import (
    OLD_LOGPROBS_FILE,
    ScoreSettings,
    StageReferenceError,
    minibatch,
    prepare_stage_reference,
    read_old_logprobs,
    write_old_logprobs,
)
from megatron_mugrpo.training.train_step import forward_logprobs, train_step

from .common import VOCAB, hf_config, make_batch

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


def _reference_scores_and_file(rank: int, world_size: int, tmp_path) -> None:
    policy = _policy()
    store = _store(tmp_path / "stage", _groups(0, 5))
    correction = RolloutCorrectionConfig(tis_cap=2.0)
    old, metrics = prepare_stage_reference(
        policy, store, correction=correction, measure=False, first_update=True, settings=SETTINGS, seed=0, write=True
    )
    # The same numbers as one forward_logprobs over the collated store, response positions only.
    batch = collate(store.groups(), pad_id=0)
    full = forward_logprobs(policy, batch, temperature=0.9, micro_batch_size=4)
    mask = batch.response_mask.bool()
    flat = torch.tensor([lp for per_group in old.per_group for lps in per_group for lp in lps])
    torch.testing.assert_close(flat, full[mask], atol=2e-6, rtol=0)
    gap = (full - batch.behaviour_logprobs).abs()[mask]
    assert metrics["rollout/mismatch_logprob_abs_max"] == pytest.approx(float(gap.max()), abs=1e-5)
    assert metrics["rollout/mismatch_tokens"] == float(mask.sum())
    # A run resumed after the first update reads the same values back; no metrics then.
    again, none = prepare_stage_reference(
        policy, store, correction=correction, measure=True, first_update=False, settings=SETTINGS, seed=0, write=True
    )
    assert again.per_group == old.per_group and none == {}  # float32 values round-trip exactly
    # Attached to a minibatch, aligned with the responses.
    groups = minibatch(store, 1, 2, 0, again)
    indices = store.minibatch_indices(1, 2, 0)
    assert [s.old_logprobs for s in groups[0].samples] == again.per_group[indices[0]]


def _stale_or_missing_file_is_refused(rank: int, world_size: int, tmp_path) -> None:
    store = _store(tmp_path / "stage", _groups(1, 4))
    with pytest.raises(StageReferenceError, match="missing"):
        read_old_logprobs(store)
    write_old_logprobs(store.store_dir / OLD_LOGPROBS_FILE, [[[0.0]]] * 4, fingerprint="another store")
    with pytest.raises(StageReferenceError, match="another rollout dataset"):
        read_old_logprobs(store)


def _metrics_only_on_a_subsample(rank: int, world_size: int, tmp_path) -> None:
    policy = _policy()
    store = _store(tmp_path / "stage", _groups(2, 6))
    correction = RolloutCorrectionConfig(mismatch_groups=2)
    old, metrics = prepare_stage_reference(
        policy, store, correction=correction, measure=True, first_update=True, settings=SETTINGS, seed=0, write=True
    )
    assert old is None and not (store.store_dir / OLD_LOGPROBS_FILE).exists()
    assert metrics["rollout/mismatch_kl"] > 0 and metrics["rollout/mismatch_logprob_abs_mean"] > 0
    assert metrics["rollout/mismatch_tokens"] < sum(len(s.response_ids) for g in store.groups() for s in g.samples)
    off, nothing = prepare_stage_reference(
        policy, store, correction=correction, measure=False, first_update=True, settings=SETTINGS, seed=0, write=True
    )
    assert off is None and nothing == {}


def _corrected_first_update_sees_policy_ratio_one(rank: int, world_size: int, tmp_path) -> None:
    """At a stage's first update π_θ = π_old: the corrected loss's ratio is exactly 1 although β differs,
    and the weight mean is the mean of min(π_old / β, C)."""
    policy = _policy()
    batch = make_batch(5)
    batch.old_logprobs = forward_logprobs(policy, batch, temperature=1.0, micro_batch_size=4)
    correction = RolloutCorrectionConfig(tis_cap=2.0)
    metrics = train_step(
        policy,
        batch,
        loss_name="mu_grpo",
        loss_options=AlgoConfig().loss_options(),
        temperature=1.0,
        micro_batch_size=batch.num_sequences,  # one micro-batch: its metrics are the batch's
        rollout_correction=correction,
    )
    assert metrics["train/ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    mask = batch.response_mask.bool()
    factor = (batch.old_logprobs - batch.behaviour_logprobs)[mask].double().exp()
    assert metrics["train/rollout_corr_weight_mean"] == pytest.approx(float(factor.clamp(max=2.0).mean()), rel=1e-5)
    assert metrics["train/rollout_corr_truncated_frac"] == pytest.approx(float((factor > 2.0).double().mean()))
    assert metrics["train/rollout_logprob_abs_diff_max"] > 0.1  # β still differs from the trainer


@pytest.mark.parametrize(
    "body",
    [
        _reference_scores_and_file,
        _stale_or_missing_file_is_refused,
        _metrics_only_on_a_subsample,
        _corrected_first_update_sees_policy_ratio_one,
    ],
    ids=lambda fn: fn.__name__.strip("_"),
)
def test_single_rank(body, tmp_path):
    run_distributed(body, 1, tmp_path)
