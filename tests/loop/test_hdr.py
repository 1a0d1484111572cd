"""Headroom-Drift Replay through the real Megatron trainer on CPU: scoring, gating, mini-batches, buffer files.

Groups get behaviour log-probs from the policy itself (teacher-forced), so their drift is exactly 0;
shifting every stored log-prob by δ makes it δ². That gives known drifts without hand-made numbers
for a whole transformer.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed
from training.common import VOCAB, hf_config

from megatron_mugrpo.algorithms.losses import available_losses, needs_old_logprobs
from megatron_mugrpo.algorithms.replay import (
    candidate_entries,
    headroom_order,
    replay_slots,
    stored_headroom,
    token_headroom,
)
from megatron_mugrpo.config import load_config
from megatron_mugrpo.loop import hdr as replay
from megatron_mugrpo.loop.data import StageData
from megatron_mugrpo.loop.setup import score_settings
from megatron_mugrpo.metrics import MetricsLogger, read_metrics
from megatron_mugrpo.records import RolloutGroup, RolloutSample, collate
from megatron_mugrpo.rollout.placement import EnginePlacement, HostGroup
from megatron_mugrpo.rollout.store import RolloutStore, write_store
from megatron_mugrpo.state import TrainerState
from megatron_mugrpo.training.checkpoint import CheckpointError
from megatron_mugrpo.training.parallel import initialize_parallel
from megatron_mugrpo.training.setup import build_policy
from megatron_mugrpo.training.stage_reference import prepare_stage_reference
from megatron_mugrpo.training.train_step import forward_logprobs, train_step

GROUP_SIZE = 4
TRAIN_GROUPS = 4
MINI_GROUPS = 1  # μ = 4 updates per stage
TAU = 1e-3
SHIFT_OK, SHIFT_FAR = 0.02, 0.05
"""Stored log-prob shifts: drift 4e-4 ≤ τ (admitted) and 2.5e-3 > τ (rejected)."""


def _cfg(*extra: str):
    return load_config(
        None,
        [
            "replay.enabled=true",
            f"replay.tau={TAU}",
            "replay.groups_per_step=2",
            f"stages.train_groups={TRAIN_GROUPS}",
            f"stages.mini_groups={MINI_GROUPS}",
            f"rollout.group_size={GROUP_SIZE}",
            "parallel.micro_batch_size=4",
            "kernels.logprob_impl=unfused",
            *extra,
        ],
    )


def _run(tmp: Path, cfg, tp: int = 1) -> SimpleNamespace:
    """The parts of a loop.run.Run that replay touches (``hdr.ReplayRun``), with a real policy, host group and
    metrics logger."""
    groups = initialize_parallel(tp, 1, seed=0)
    policy = build_policy(hf_config(), groups=groups, dtype=torch.float32, optim=cfg.optim)
    return SimpleNamespace(
        cfg=cfg,
        policy=policy,
        hosts=HostGroup.create(EnginePlacement.from_env(tensor_parallel=1, world_size=groups.world_size)),
        state=TrainerState(stage=1, global_update=4),
        rollout_dir=lambda stage: tmp / "rollouts" / f"stage_{stage:03d}",
        trainer=SimpleNamespace(
            scoring=score_settings(cfg, SimpleNamespace(pad_token_id=0)),
            replay=replay.open_replay(cfg.replay, cfg.stages.train_groups, None),
        ),
        telemetry=SimpleNamespace(logger=MetricsLogger(tmp, tensorboard=False, console=False, rank=groups.rank)),
    )


def _stage_data(run: SimpleNamespace, stage: int, store: RolloutStore) -> StageData:
    """What ``loop.staged.stage_data`` builds, without a rollout correction: D_k plus HDR's accepted groups."""
    mu = run.cfg.stages.updates_per_stage
    replayed = replay.replayed_groups(run, stage, mu)
    return StageData(store=store, replayed=replayed, updates=mu, recheck=replay.recheck(run))


def _walk(order: list, drifts: dict, k: int) -> tuple[list, list]:
    """HDR's walk by hand: (accepted, scored) in ``order`` until ``k`` groups pass τ."""
    accepted, scored = [], []
    for key in order:
        if len(accepted) == k:
            break
        scored.append(key)
        if drifts[key] <= TAU:
            accepted.append(key)
    return accepted, scored


def _groups(seed: int, stage: int, count: int, version: int = 0) -> list[RolloutGroup]:
    rng = random.Random(seed)
    out = []
    for g in range(count):
        samples = []
        for j in range(GROUP_SIZE):
            length = rng.randint(2, 6)
            reward = float(j % 2)  # mixed outcome: half right, half wrong
            samples.append(
                RolloutSample(
                    response_ids=[rng.randrange(3, VOCAB) for _ in range(length)],
                    behaviour_logprobs=[-1.0] * length,
                    finish_reason="stop",
                    reward=reward,
                    reward_reason="correct" if reward else "wrong",
                    advantage=reward - 0.5,
                )
            )
        prompt = [rng.randrange(3, VOCAB) for _ in range(rng.randint(2, 4))]
        out.append(
            RolloutGroup(
                prompt_id=f"{stage}-{g}",
                prompt_ids=prompt,
                answer="1",
                samples=samples,
                stage=stage,
                policy_version=version,
            )
        )
    return out


def _set_behaviour(run: SimpleNamespace, groups: list[RolloutGroup], shifts: list[float]) -> None:
    """Behaviour log-probs = the policy's own teacher-forced log-probs − shift (per group)."""
    batch = collate(groups, pad_id=0)
    logprobs = forward_logprobs(run.policy, batch, temperature=1.0, micro_batch_size=4, impl="unfused")
    row = 0
    for group, shift in zip(groups, shifts):
        for sample in group.samples:
            start = len(group.prompt_ids) - 1
            values = logprobs[row, start : start + len(sample.response_ids)]
            sample.behaviour_logprobs = [float(v) - shift for v in values]
            row += 1


def _write_store(
    directory: Path, groups: list[RolloutGroup], stage: int, version: int, sampling: dict | None = None
) -> RolloutStore:
    return write_store(
        directory,
        groups,
        stage=stage,
        policy_version=version,
        engine="test",
        sampling=sampling or {},
        shard_groups=min(len(groups), 64),
        vocab_size=VOCAB,
    )


# ------------------------------------------------------------------------------------------


def _score_gate_and_replay_stored_logprobs(rank: int, world_size: int, tmp: str) -> None:
    tmp_path = Path(tmp)
    run = _run(tmp_path, _cfg())
    old = _groups(0, stage=0, count=4)
    shifts = [SHIFT_FAR, 0.0, SHIFT_OK, SHIFT_FAR]
    _set_behaviour(run, old, shifts)
    run.trainer.replay.buffer.push(candidate_entries(enumerate(old)))
    stored = [[list(s.behaviour_logprobs) for s in g.samples] for g in old]

    fresh = _groups(1, stage=1, count=TRAIN_GROUPS, version=4)
    _set_behaviour(run, fresh, [0.0] * len(fresh))
    store = _write_store(run.rollout_dir(1), fresh, stage=1, version=4)

    # Every group is ranked by the headroom it entered with (from its stored log-probs), none is "unscored first".
    order = headroom_order(run.trainer.replay.buffer)
    entered = [stored_headroom(g) for g in old]
    assert [entered[i] for _, i in order] == sorted(entered, reverse=True)
    drifts = {(0, i): shift**2 for i, shift in enumerate(shifts)}
    accepted, scored = _walk(order, drifts, k=2)
    data = _stage_data(run, 1, store)
    assert run.trainer.replay.plan.accepted == accepted and run.trainer.replay.plan.accepted_at == 4
    assert (0, 1) in accepted and (0, 2) in accepted  # the two within τ, whatever the order
    scores = {key: run.trainer.replay.buffer.score(key) for key in run.trainer.replay.buffer}
    assert all(scores[key] is None for key in order if key not in scored)  # never reached: the walk stopped at K_rep
    assert run.trainer.replay.buffer.headroom((0, 1)) == scores[(0, 1)].headroom  # re-scoring replaced the entry's rank
    for key in scored:  # drift = shift², exactly what the stored log-probs were moved by
        assert scores[key].drift == pytest.approx(drifts[key], rel=1e-4, abs=1e-12)
    assert len(scored) > 2, "the walk met a group the gate rejects"
    assert scores[(0, 1)].scored_at == 4
    # Headroom against the formula on the policy's log-probs (= behaviour + shift here).
    batch = collate([old[1]], pad_id=0)
    current = batch.behaviour_logprobs + 0.0
    expected = token_headroom(current, batch.advantages, batch.response_mask).sum() / batch.response_mask.sum()
    assert scores[(0, 1)].headroom == pytest.approx(float(expected), rel=1e-5)

    # Scoring refreshed scores but never the stored records.
    assert [[list(s.behaviour_logprobs) for s in g.samples] for g in old] == stored
    # Update 0 is all fresh; the replayed groups come first in updates 1 and 2, exactly as stored.
    assert data.minibatch(0, MINI_GROUPS, 0) == store.minibatch(0, MINI_GROUPS, 0)
    first, second = data.minibatch(1, MINI_GROUPS, 0), data.minibatch(2, MINI_GROUPS, 0)
    assert (
        first[0] is run.trainer.replay.buffer.get(accepted[0]).group
        and second[0] is run.trainer.replay.buffer.get(accepted[1]).group
    )
    assert first[1:] == store.minibatch(1, MINI_GROUPS, 0)
    assert data.minibatch(3, MINI_GROUPS, 0) == store.minibatch(3, MINI_GROUPS, 0)

    # The update's ratio uses the stored generation-time log-probs: fresh rows are on-policy (gap 0), the
    # SHIFT_OK group's rows are off by exactly SHIFT_OK, so the batch's mean |log π_θ − b| is SHIFT_OK × their share.
    first = [run.trainer.replay.buffer.get((0, 2)).group, *store.minibatch(1, MINI_GROUPS, 0)]
    batch = collate(first, pad_id=0)
    replayed_tokens = sum(len(s.response_ids) for s in first[0].samples)
    metrics = train_step(
        run.policy,
        batch,
        loss_name="grpo",
        loss_options={"clip_eps": 0.2},
        temperature=1.0,
        micro_batch_size=4,
        impl="unfused",
    )
    expected_gap = SHIFT_OK * replayed_tokens / float(batch.response_mask.sum())
    assert metrics["train/rollout_logprob_abs_diff_mean"] == pytest.approx(expected_gap, rel=1e-3)
    assert metrics["train/rollout_logprob_abs_diff_max"] == pytest.approx(SHIFT_OK, rel=1e-3)
    # Replayed groups are ordinary rows to the loss: every registry loss takes the mixed batch, but for
    # icepop, which the config refuses with replay (replayed groups carry no log π_old of their stage).
    for name in (n for n in available_losses() if not needs_old_logprobs(n)):
        cfg = load_config(None, [f"algo.loss={name}"])
        out = train_step(
            run.policy,
            batch,
            loss_name=name,
            loss_options=cfg.algo.loss_options(),
            temperature=1.0,
            micro_batch_size=4,
            impl="unfused",
        )
        assert math.isfinite(out["train/loss"]) and out["train/update_successful"] == 1.0, name

    run.telemetry.logger.close()
    record = next(r for r in read_metrics(tmp_path) if "replay/accepted" in r)
    assert record["step"] == 5  # the stage's first update
    assert record["replay/scored"] == len(scored) and record["replay/accepted"] == 2
    assert record["replay/buffer_groups"] == 4
    assert record["replay/acceptance_rate"] == pytest.approx(2 / len(scored))
    assert record["replay/drift_mean"] == pytest.approx(sum(drifts[k] for k in scored) / len(scored), rel=1e-3)
    assert record["replay/age_mean"] == 4.0

    # E: the stage's mixed groups enter the FIFO after its updates; the decision is cleared.
    replay.end_stage(run, 1, store)
    assert run.trainer.replay.buffer.keys() == [(0, 0), (0, 1), (0, 2), (0, 3)] + [(1, i) for i in range(TRAIN_GROUPS)]
    assert run.trainer.replay.plan is None


def test_scoring_gate_and_stored_logprobs_through_the_trainer(tmp_path: Path) -> None:
    run_distributed(_score_gate_and_replay_stored_logprobs, 1, str(tmp_path))


# ------------------------------------------------------------------------------------------


def _persistence(rank: int, world_size: int, tmp: str) -> None:
    tmp_path = Path(tmp)
    for cross_stage in (False, True):
        cfg = _cfg(f"replay.cross_stage={str(cross_stage).lower()}", "replay.capacity=6")
        run = _run(tmp_path / f"cross_{cross_stage}", cfg)
        stage0 = _groups(2, stage=0, count=4)
        stage0[1].samples = [*stage0[1].samples[:1], *stage0[1].samples[2:3]]  # rewards 0, 0: not mixed
        _set_behaviour(run, stage0, [0.0] * 4)
        store0 = _write_store(run.rollout_dir(0), stage0, stage=0, version=0)
        replay.end_stage(run, 0, store0)
        assert run.trainer.replay.buffer.keys() == [(0, 0), (0, 2), (0, 3)]
        assert all((e.group is None) == cross_stage for e in run.trainer.replay.buffer.entries())

        stage1 = _groups(3, stage=1, count=4, version=4)
        _set_behaviour(run, stage1, [0.0] * 4)
        store1 = _write_store(run.rollout_dir(1), stage1, stage=1, version=4)
        data = _stage_data(run, 1, store1)
        first_two = headroom_order(run.trainer.replay.buffer)[:2]  # every drift is 0: the two with the most headroom
        assert run.trainer.replay.plan.accepted == first_two
        assert [g.prompt_id for g in data.replayed] == [f"0-{i}" for _, i in first_two]  # read back when by reference

        step_dir = tmp_path / f"step_{cross_stage}"
        replay.checkpoint_writer(run.trainer.replay)(step_dir)
        restored = replay.open_replay(cfg.replay, cfg.stages.train_groups, step_dir)
        assert restored.buffer.state_dict() == run.trainer.replay.buffer.state_dict()
        assert restored.buffer.entries() == run.trainer.replay.buffer.entries()
        assert restored.plan == run.trainer.replay.plan
        # A resumed run does not re-score: the restored decision is used as it is.
        run.trainer.replay = restored
        again = _stage_data(run, 1, store1)
        assert again.replayed == data.replayed

        replay.end_stage(run, 1, store1)  # 4 more mixed groups: capacity 6 evicts the oldest
        assert run.trainer.replay.buffer.keys() == [(0, 2), (0, 3)] + [(1, i) for i in range(4)]
        assert [e.headroom for e in run.trainer.replay.buffer.entries()[2:]] == [stored_headroom(g) for g in stage1]

        if not cross_stage:
            groups_file = step_dir / replay.REPLAY_DIR / replay.GROUPS_FILE
            groups_file.write_bytes(groups_file.read_bytes()[:-10] + b"0123456789")
            with pytest.raises(CheckpointError, match="does not match its checksum"):
                replay.open_replay(cfg.replay, cfg.stages.train_groups, step_dir)
        state_file = step_dir / replay.REPLAY_DIR / replay.STATE_FILE
        state_file.write_text(json.dumps({"format": "other"}))
        with pytest.raises(CheckpointError, match="format"):
            replay.open_replay(cfg.replay, cfg.stages.train_groups, step_dir)
        run.telemetry.logger.close()
    assert replay.open_replay(load_config(None, []).replay, 4, tmp_path) is None  # replay off: no state at all


def test_buffer_and_decision_survive_a_checkpoint(tmp_path: Path) -> None:
    run_distributed(_persistence, 1, str(tmp_path))


# ------------------------------------------------------------------------------------------


def _ranks_decide_alike(rank: int, world_size: int, tmp: str) -> None:
    """Rank 1's copies of the buffered groups hold other behaviour log-probs than rank 0's (every group
    SHIFT_FAR away: its own drifts would reject them all), with the same tokens and the same rank in the
    buffer. Rank 0's drifts all pass. With a scoring budget of K_rep = 2 groups both ranks make the same
    single collective scoring pass whatever they decide, so a missing broadcast shows as rank 1 deciding
    otherwise (an assertion on both ranks), not as a hang: only rank 0's broadcast scores make rank 1
    accept what rank 0 accepts, at the stage's start and at the slot re-check."""
    tmp_path = Path(tmp)
    run = _run(tmp_path / f"rank{rank}", _cfg("replay.max_scored_per_step=2"), tp=2)
    old = _groups(4, stage=0, count=6)
    shifts = [0.0, SHIFT_OK, 0.0, SHIFT_OK, 0.0, SHIFT_OK]
    _set_behaviour(run, old, shifts)
    run.trainer.replay.buffer.push(candidate_entries(enumerate(old)))
    if rank == 1:  # local data that disagrees: what this rank alone would measure is drift SHIFT_FAR² everywhere
        for entry, shift in zip(run.trainer.replay.buffer.entries(), shifts):
            for sample in entry.group.samples:
                sample.behaviour_logprobs = [lp + shift - SHIFT_FAR for lp in sample.behaviour_logprobs]
    fresh = _groups(5, stage=1, count=TRAIN_GROUPS, version=4)
    _set_behaviour(run, fresh, [0.0] * TRAIN_GROUPS)
    store = _write_store(run.rollout_dir(1), fresh, stage=1, version=4)
    expected = headroom_order(run.trainer.replay.buffer)[:2]  # rank 0: every drift passes
    data = _stage_data(run, 1, store)
    decisions = [None] * world_size
    dist.all_gather_object(decisions, (run.trainer.replay.plan.accepted, run.trainer.replay.buffer.state_dict()))
    assert decisions[0] == decisions[1]
    assert run.trainer.replay.plan.accepted == expected and len(expected) == 2
    # The slot re-check broadcasts too: at recheck_updates=0 every slot is re-checked, and rank 1 keeps
    # what rank 0's drift keeps (its own would skip every group).
    run.trainer.replay.config.recheck_updates = 0
    run.state.global_update = 5
    kept = [g.prompt_id for g in data.minibatch(1, MINI_GROUPS, 0)[: len(replay_slots(2, 4)[1])]]
    all_kept = [None] * world_size
    dist.all_gather_object(all_kept, kept)
    assert all_kept[0] == all_kept[1] == [f"0-{expected[0][1]}"]
    run.telemetry.logger.close()


@pytest.mark.multiprocess
def test_every_rank_takes_the_same_decisions_with_tensor_parallelism(tmp_path: Path) -> None:
    run_distributed(_ranks_decide_alike, 2, str(tmp_path))


def test_replay_off_leaves_d_k_alone(tmp_path: Path) -> None:
    cfg = load_config(None, [])
    run = SimpleNamespace(
        cfg=cfg, trainer=SimpleNamespace(replay=replay.open_replay(cfg.replay, cfg.stages.train_groups, None))
    )
    store = object()
    data = _stage_data(run, 0, store)
    assert data.store is store and data.replayed == []  # D_k alone
    replay.end_stage(run, 0, store)
    assert replay.checkpoint_writer(run.trainer.replay) is None


# ------------------------------------------------------------------------------------------


RECHECK_MU = 256
"""A far-off-policy stage: the last slot is 255 updates after the decision."""


def _recheck_at_mu_256(rank: int, world_size: int, tmp: str) -> None:
    """Groups accepted at a stage's start are used up to μ − 1 = 255 updates later. At a slot more than
    replay.recheck_updates = 64 updates after the decision, the group's drift is scored again against the
    current policy and the group is skipped if it fails; before that it is used as decided.

    The policy's move is made exact by moving the stored copies instead (drift depends only on
    log π_θ − log π_gen): after the decision three accepted groups are put SHIFT_FAR away."""
    tmp_path = Path(tmp)
    cfg = _cfg(f"stages.train_groups={RECHECK_MU}", "replay.groups_per_step=8", "replay.recheck_updates=64")
    run = _run(tmp_path, cfg)
    old = _groups(6, stage=0, count=8)
    _set_behaviour(run, old, [0.0] * 8)
    run.trainer.replay.buffer.push(candidate_entries(enumerate(old)))
    store = _write_store(run.rollout_dir(1), _groups(7, stage=1, count=RECHECK_MU, version=4), stage=1, version=4)
    data = _stage_data(run, 1, store)
    plan = run.trainer.replay.plan
    assert len(plan.accepted) == 8 and plan.accepted_at == 4
    slots = replay_slots(8, RECHECK_MU)
    slot_of = {position: u for u, share in enumerate(slots) for position in share}
    early = [p for p in range(8) if slot_of[p] <= 64]
    late = [p for p in range(8) if slot_of[p] > 64]
    assert early and len(late) >= 3
    moved = {early[-1], late[0], late[-1]}  # one that is not due yet, two that are
    for position in moved:
        for sample in run.trainer.replay.buffer.get(plan.accepted[position]).group.samples:
            sample.behaviour_logprobs = [lp - SHIFT_FAR for lp in sample.behaviour_logprobs]

    used = []
    for update in range(RECHECK_MU):
        run.state.global_update = plan.accepted_at + update  # the update is made at this version
        batch = data.minibatch(update, MINI_GROUPS, 0)
        replayed = batch[: len(batch) - MINI_GROUPS]
        used += [int(g.prompt_id.split("-")[1]) for g in replayed]
        assert batch[len(replayed) :] == store.minibatch(update, MINI_GROUPS, 0)  # fresh groups untouched
    keys = [plan.accepted[p] for p in range(8)]
    expected = [keys[p][1] for p in range(8) if not (p in moved and slot_of[p] > 64)]
    assert used == expected  # the not-yet-due moved group is still used; the due moved ones are skipped

    run.telemetry.logger.close()
    rechecks = [r for r in read_metrics(tmp_path) if "replay/recheck_scored" in r]
    assert [r["step"] for r in rechecks] == [plan.accepted_at + slot_of[p] + 1 for p in late]
    assert sum(r["replay/recheck_skipped"] for r in rechecks) == 2
    assert all(r["replay/recheck_age"] > 64 for r in rechecks)
    for p in late:  # re-scoring updated the buffer's scores at the slot's version
        score = run.trainer.replay.buffer.score(plan.accepted[p])
        assert score.scored_at == plan.accepted_at + slot_of[p]
        assert score.drift == pytest.approx(SHIFT_FAR**2 if p in moved else 0.0, rel=1e-4, abs=1e-12)


def test_replayed_groups_are_rechecked_at_their_slot_at_mu_256(tmp_path: Path) -> None:
    run_distributed(_recheck_at_mu_256, 1, str(tmp_path))


# ------------------------------------------------------------------------------------------


def _quantized_stage_drift_from_pi_old(rank: int, world_size: int, tmp: str) -> None:
    """A stage generated by a quantized engine: its behaviour log-probs sit SHIFT_FAR off the trainer (the
    quantization gap), the trainer itself has not moved. Drift is measured from the stage reference's
    log π_old, so the gate admits the groups, in copies and by reference, and through a checkpoint; the
    same groups from a full-precision store are rejected (their behaviour log-probs are all HDR has)."""
    tmp_path = Path(tmp)
    for cross_stage in (False, True):
        for quantized in (True, False):
            name = f"cross_{cross_stage}_q_{quantized}"
            cfg = _cfg(f"replay.cross_stage={str(cross_stage).lower()}")
            run = _run(tmp_path / name, cfg)
            stage0 = _groups(8, stage=0, count=4)
            _set_behaviour(run, stage0, [SHIFT_FAR] * 4)  # the quantization gap
            sampling = {"quantization": "fp8"} if quantized else {}
            store0 = _write_store(run.rollout_dir(0), stage0, stage=0, version=0, sampling=sampling)
            if quantized:  # the stage reference keeps log π_old for HDR (rank 0 writes, every rank reads)
                old, _ = prepare_stage_reference(
                    run.policy,
                    store0,
                    correction=cfg.algo.rollout_correction,
                    measure=True,
                    first_update=True,
                    settings=run.trainer.scoring,
                    seed=0,
                    write=True,
                    policy_version=0,
                    barrier=run.hosts.barrier,
                    keep=True,
                )
                assert old is None  # no correction: nothing is attached to the stage's own updates
            replay.end_stage(run, 0, store0)
            carried = [
                replay.resolve_group(run, run.trainer.replay, key).samples[0].old_logprobs is not None
                for key in run.trainer.replay.buffer
            ]
            assert all(carried) if quantized else not any(carried)
            if quantized:  # entered with the headroom measured from π_old, not from the quantized β
                entry = run.trainer.replay.buffer.entries()[0]
                assert entry.headroom == stored_headroom(replay.resolve_group(run, run.trainer.replay, entry.key))
                assert entry.headroom != stored_headroom(stage0[entry.key[1]])

            fresh = _groups(9, stage=1, count=TRAIN_GROUPS, version=4)
            store1 = _write_store(run.rollout_dir(1), fresh, stage=1, version=4)
            _stage_data(run, 1, store1)
            scores = [
                run.trainer.replay.buffer.score(k)
                for k in run.trainer.replay.buffer
                if run.trainer.replay.buffer.score(k)
            ]
            if quantized:
                assert len(run.trainer.replay.plan.accepted) == 2 and all(s.drift < 1e-10 for s in scores), name
            else:
                assert run.trainer.replay.plan.accepted == [] and all(
                    s.drift == pytest.approx(SHIFT_FAR**2, rel=1e-4) for s in scores
                ), name
            step_dir = tmp_path / f"step_{name}"
            replay.checkpoint_writer(run.trainer.replay)(step_dir)
            restored = replay.open_replay(cfg.replay, cfg.stages.train_groups, step_dir)
            assert restored.buffer.entries() == run.trainer.replay.buffer.entries()  # copies keep log π_old
            run.telemetry.logger.close()


def test_a_quantized_stage_drifts_from_the_trainers_pi_old_not_from_the_engine(tmp_path: Path) -> None:
    run_distributed(_quantized_stage_drift_from_pi_old, 1, str(tmp_path))
