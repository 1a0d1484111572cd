"""End to end: token-budget micro-batches with packed sequences in a staged run, a Headroom-Drift
Replay run and an async run, through the `mugrpo` CLI, against the same runs unpacked.

The rollouts do not depend on how the trainer cuts its updates, so the first update of a packed run
trains on the same rows from the same weights as the unpacked run: its loss must be the same up to
float32 summation order. Later updates drift apart only by that rounding. In the replay run the
replay decision re-scores the buffer through the trainer (headroom and drift), which now packs as
the update does: its drift statistics must match the unpacked run's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from e2e_runs import records, train
from test_async import ok, start
from test_stages import REPLAY, replay_uninterrupted  # noqa: F401  (the shared replay run, a fixture)

PACKED = ["parallel.micro_batch_tokens=128", "parallel.pack_sequences=true"]
"""Rows of at most 16 + 40 tokens: about four sequences per micro-batch, several per packed row."""
FLOAT32_REL = 1e-5
"""A loss summed in another order (packed rows, other micro-batches) in float32."""


def _updates(run_dir: Path) -> list[dict]:
    return [r for r in records(run_dir) if "train/loss" in r]


@pytest.mark.slow
def test_packed_staged_run_makes_the_unpacked_first_update(tmp_path: Path, base_model: Path, uninterrupted) -> None:
    """One stage (4 updates) packed: the run finishes, packs (less padding than the unpacked run) and
    its first update equals the unpacked run's."""
    run_dir = tmp_path / "packed"
    proc = train(run_dir, base_model, *PACKED, "stages.num_stages=1")
    assert proc.stdout.strip().splitlines()[-1].startswith("acc_before=")
    packed, unpacked = _updates(run_dir), _updates(uninterrupted[0])[:4]
    assert len(packed) == 4
    assert packed[0]["train/loss"] == pytest.approx(unpacked[0]["train/loss"], rel=FLOAT32_REL, abs=1e-7)
    assert packed[0]["train/normaliser"] == unpacked[0]["train/normaliser"]
    assert packed[0]["train/rollout_logprob_abs_diff_max"] < 1e-4  # pi_theta = beta at the stage's first update
    assert all(p["perf/padding_frac"] < u["perf/padding_frac"] for p, u in zip(packed, unpacked, strict=True))


@pytest.mark.slow
def test_packed_replay_run_scores_and_updates_as_unpacked(
    tmp_path: Path,
    easy_base_model: Path,
    replay_uninterrupted: Path,  # noqa: F811
) -> None:
    """Two stages with replay, packed: the same first update, and at stage 1 the same groups scored
    with the same headroom / drift (the scoring pass packs too) and the same number accepted."""
    run_dir = tmp_path / "packed_replay"
    train(run_dir, easy_base_model, *REPLAY, *PACKED)
    packed, unpacked = _updates(run_dir), _updates(replay_uninterrupted)
    assert len(packed) == len(unpacked) == 8
    assert packed[0]["train/loss"] == pytest.approx(unpacked[0]["train/loss"], rel=FLOAT32_REL, abs=1e-7)
    plan = {r["step"]: r for r in records(run_dir) if "replay/accepted" in r}
    reference = {r["step"]: r for r in records(replay_uninterrupted) if "replay/accepted" in r}
    assert plan[5]["replay/scored"] == reference[5]["replay/scored"] >= 2
    assert plan[5]["replay/accepted"] == reference[5]["replay/accepted"] > 0
    # Stage 1's weights differ from the unpacked run's by four updates' rounding only.
    assert plan[5]["replay/drift_mean"] == pytest.approx(reference[5]["replay/drift_mean"], rel=1e-3)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_packed_async_run_makes_the_unpacked_first_update(tmp_path: Path, base_model: Path) -> None:
    """A trainer and a rollout worker, one update each way: it trains on the worker's first groups from
    the initial weights in both runs, so packing leaves its loss unchanged."""
    short = ["stages.num_stages=1", "stages.train_groups=4", "eval.benchmarks.0.limit=4"]
    unpacked_dir, packed_dir = tmp_path / "async", tmp_path / "async_packed"
    ok(start(unpacked_dir, base_model, *short))
    ok(start(packed_dir, base_model, *short, *PACKED))
    packed, unpacked = _updates(packed_dir), _updates(unpacked_dir)
    assert [r["step"] for r in packed] == [r["step"] for r in unpacked] == [1]
    assert packed[0]["train/loss"] == pytest.approx(unpacked[0]["train/loss"], rel=FLOAT32_REL, abs=1e-7)
    assert packed[0]["train/normaliser"] == unpacked[0]["train/normaliser"]
    assert packed[0]["perf/padding_frac"] < unpacked[0]["perf/padding_frac"]
