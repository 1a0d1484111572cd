"""Headroom-Drift Replay on multi-turn mixture-of-experts trajectories, through the real Megatron trainer.

A trajectory's observation tokens are inputs the policy reads, never tokens it sampled: HDR's headroom
and drift, and the loss of the update that replays the group, must leave them out, while the routes the
engine recorded for them (it prefilled them) must travel with the group and be replayed by the trainer.

The "engine" is a tiny Qwen3-MoE routing on its own; the trainer is a copy of its weights built with
``moe.routing_replay=rollout``. Stage 0's trajectories get the engine's teacher-forced log-probs minus a
known shift per group at policy positions (0.0 at observation positions, as the engines store them)
and the engine's routes over prompt + trajectory − 1 positions. Drift is then exactly shift² when
observation tokens stay out (each would add ~(log π ≈ −4.6 − 0)² otherwise); headroom is checked
against a float64 hand computation over the policy tokens. The stage goes through the rollout store,
the replay FIFO and a checkpoint of it, and the groups HDR accepts are those read back from disk.
"""

from __future__ import annotations

import copy
import math
import random
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from dist_utils import run_distributed
from training.common import VOCAB
from training.test_routing_replay import CONFIG, TOPK, _capture_fresh_routes, _copy_weights, _other_routes

from megatron_mugrpo.algorithms.config import AlgoConfig
from megatron_mugrpo.algorithms.losses import available_losses, needs_old_logprobs
from megatron_mugrpo.algorithms.replay import ReplayConfig, group_headroom_drift, headroom_order
from megatron_mugrpo.loop import hdr
from megatron_mugrpo.loop.data import StageData
from megatron_mugrpo.metrics import MetricsLogger, read_metrics
from megatron_mugrpo.records import RolloutGroup, RolloutSample, collate
from megatron_mugrpo.rollout.placement import EnginePlacement, HostGroup
from megatron_mugrpo.rollout.store import write_store
from megatron_mugrpo.state import TrainerState
from megatron_mugrpo.training.moe import MoeConfig
from megatron_mugrpo.training.optimizer import OptimConfig
from megatron_mugrpo.training.parallel import initialize_parallel
from megatron_mugrpo.training.setup import Policy, build_policy
from megatron_mugrpo.training.stage_reference import ScoreSettings, teacher_forced_logprobs
from megatron_mugrpo.training.train_step import forward_logprobs, train_step

F64 = torch.float64
GROUP_SIZE, TRAIN_GROUPS, MINI_GROUPS = 4, 4, 1  # μ = 4 updates per stage
UPDATES = TRAIN_GROUPS // MINI_GROUPS
TAU = 1e-3
SHIFT_OK, SHIFT_FAR = 0.02, 0.05
"""Stored log-prob shifts at policy positions: drift 4e-4 ≤ τ (admitted) and 2.5e-3 > τ (rejected)."""
SHIFTS = [SHIFT_FAR, 0.0, SHIFT_OK, SHIFT_FAR]
ENV = {"kind": "search", "max_turns": 3}
SCORING = ScoreSettings(temperature=1.0, micro_batch_size=4, impl="unfused", pad_id=0, chunk_groups=MINI_GROUPS)


# ------------------------------------------------------------------------------ by hand, float64


def test_headroom_and_drift_by_hand_on_interleaved_masks():
    """Group 0: three responses with observation tokens between their turns (A = +1, −1, 0); group 1: one
    single-turn response. Observation positions hold garbage (π_θ "= e^5", β = e^−30) that would dominate
    either mean if it were counted. By hand, over policy tokens only:

    group 0 headroom: A>0: 1 − 0.5, 1 − 0.25; A<0: 0.5, 0.125, 1.0; A=0: 0, 0 → 2.875 / 7 tokens
    group 0 drift:    0.1², 0.2², 0.3², 0², 0.1², 0.2², 0² = 0.19 / 7 tokens
    group 1 (A>0, π = 0.5, 0.5, log-ratios 0, 0.4): headroom 0.5, drift 0.16 / 2 = 0.08
    """
    x = float("nan")  # observation and padding positions: garbage below
    pi = [[0.5, x, x, 0.25, x], [0.5, 0.125, x, 1.0, x], [0.5, x, 0.5, x, x], [0.5, 0.5, x, x, x]]
    log_ratio = [[0.1, x, x, -0.2, x], [0.3, 0.0, x, 0.1, x], [0.2, x, 0.0, x, x], [0.0, 0.4, x, x, x]]
    mask = torch.tensor([[1, 0, 0, 1, 0], [1, 1, 0, 1, 0], [1, 0, 1, 0, 0], [1, 1, 0, 0, 0]], dtype=F64)
    logprobs = torch.where(mask.bool(), torch.tensor(pi, dtype=F64).log(), 5.0)
    behaviour = torch.where(mask.bool(), logprobs - torch.tensor(log_ratio, dtype=F64), -30.0)
    advantages = torch.tensor([1.0, -1.0, 0.0, 0.7], dtype=F64)
    headroom, drift = group_headroom_drift(logprobs, behaviour, advantages, mask, torch.tensor([0, 0, 0, 1]), 2)
    assert headroom.tolist() == pytest.approx([2.875 / 7, 0.5], rel=1e-14)
    assert drift.tolist() == pytest.approx([0.19 / 7, 0.08], rel=1e-14)


# ------------------------------------------------------------------------------ through the trainer


def _trajectory(rng: random.Random, reward: float) -> RolloutSample:
    """2–3 policy turns with a 2–4-token observation before each turn but the first; behaviour log-probs
    and routes are set from the engine afterwards (``_as_sampled``)."""
    ids: list[int] = []
    mask: list[int] = []
    turns: list[tuple[int, int]] = []
    for turn in range(rng.randint(2, 3)):
        if turn:
            observation = rng.randint(2, 4)
            ids += [rng.randrange(3, VOCAB) for _ in range(observation)]
            mask += [0] * observation
        length = rng.randint(1, 3)
        turns.append((len(ids), len(ids) + length))
        ids += [rng.randrange(3, VOCAB) for _ in range(length)]
        mask += [1] * length
    return RolloutSample(
        response_ids=ids,
        behaviour_logprobs=[0.0] * len(ids),
        finish_reason="stop",
        reward=reward,
        reward_reason="correct" if reward else "wrong_answer",
        advantage=reward - 0.5,
        policy_mask=mask,
        turns=turns,
        env_seconds=[0.25] * (len(turns) - 1),
    )


def _groups(seed: int, stage: int, version: int) -> list[RolloutGroup]:
    rng = random.Random(seed)
    return [
        RolloutGroup(
            prompt_id=f"{stage}-{g}",
            prompt_ids=[rng.randrange(3, VOCAB) for _ in range(rng.randint(2, 4))],
            answer='["x"]',
            samples=[_trajectory(rng, float(j % 2)) for j in range(GROUP_SIZE)],  # mixed outcome
            stage=stage,
            policy_version=version,
        )
        for g in range(TRAIN_GROUPS)
    ]


def _as_sampled(engine: Policy, groups: list[RolloutGroup], shifts: list[float]) -> list[list[list[float]]]:
    """What the engine would have stored: its routes over prompt + trajectory − 1 positions, and its
    log-probs minus the group's shift at policy positions, 0.0 at observation positions. Returns the
    engine's (= the trainer's) log-probs of each sample's tokens, for the hand computations."""
    batch = collate(groups, pad_id=0)
    logprobs = forward_logprobs(engine, batch, temperature=1.0, micro_batch_size=4, impl="unfused")
    routes = _capture_fresh_routes(engine, batch, 4)
    current, row = [], 0
    for group, shift in zip(groups, shifts):
        per_sample = []
        for sample in group.samples:
            start, count = len(group.prompt_ids) - 1, len(sample.response_ids)
            values = logprobs[row, start : start + count].tolist()
            # float32 values, as the store keeps them (the engines' log-probs are float32 too)
            sample.behaviour_logprobs = [
                float(np.float32(v - shift)) if m else 0.0 for v, m in zip(values, sample.policy_mask)
            ]
            sample.routes = routes[row, : len(group.prompt_ids) + count - 1].numpy().copy()
            per_sample.append(values)
            row += 1
        current.append(per_sample)
    return current


def _hand_headroom(group: RolloutGroup, current: list[list[float]], *, observations: bool = False) -> float:
    """H(g) in float64 over the policy tokens (``observations``: over every token, the wrong way)."""
    terms = [
        (1.0 - math.exp(lp)) if s.advantage > 0 else math.exp(lp)
        for s, values in zip(group.samples, current)
        for lp, m in zip(values, s.policy_mask)
        if m or observations
    ]
    return math.fsum(terms) / len(terms)


def _run(tmp: Path, trainer: Policy) -> SimpleNamespace:
    """The parts of a loop.run.Run that HDR touches (``loop.hdr.ReplayRun``)."""
    # K_rep = 3 while only 2 groups pass τ: the walk scores every group whatever the headroom order
    config = ReplayConfig(enabled=True, policy="hdr", tau=TAU, groups_per_step=3)
    return SimpleNamespace(
        policy=trainer,
        hosts=HostGroup.create(EnginePlacement.from_env(tensor_parallel=1, world_size=1)),
        state=TrainerState(stage=0, global_update=UPDATES),
        rollout_dir=lambda stage: tmp / "rollouts" / f"stage_{stage:03d}",
        trainer=SimpleNamespace(scoring=SCORING, replay=hdr.open_replay(config, TRAIN_GROUPS, None)),
        telemetry=SimpleNamespace(logger=MetricsLogger(tmp, tensorboard=False, console=False, rank=0)),
    )


def _store(run: SimpleNamespace, groups: list[RolloutGroup], stage: int):
    return write_store(
        run.rollout_dir(stage),
        groups,
        stage=stage,
        policy_version=stage * UPDATES,
        engine="transformers",
        sampling={"env": ENV},
        shard_groups=2,
        vocab_size=VOCAB,
    )


def _trajectory_fields(group: RolloutGroup) -> list[tuple]:
    return [
        (s.response_ids, s.behaviour_logprobs, s.policy_mask, [tuple(t) for t in s.turns], s.env_seconds)
        for s in group.samples
    ]


def _observation_routes_changed(group: RolloutGroup) -> RolloutGroup:
    """A copy of ``group`` whose routes differ from the recorded ones at observation inputs only."""
    changed = copy.deepcopy(group)
    for sample in changed.samples:
        rows = [len(group.prompt_ids) + i for i, m in enumerate(sample.policy_mask) if not m]
        other = _other_routes(None, torch.from_numpy(sample.routes)).numpy()
        sample.routes[rows] = other[rows]
    return changed


def _around_first_observation(group: RolloutGroup) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, L] masks of ``collate([group])``'s policy targets read before any observation token was fed, and
    those read after one."""
    batch = collate([group], pad_id=0)
    first = torch.tensor([len(group.prompt_ids) + s.policy_mask.index(0) for s in group.samples])
    columns = torch.arange(batch.tokens.shape[1])[None, :]
    policy = batch.response_mask.bool()
    return policy & (columns < first[:, None]), policy & (columns >= first[:, None])


def _replay_moe_trajectories(rank: int, world_size: int, tmp: str) -> None:
    tmp_path = Path(tmp)
    groups = initialize_parallel(1, 1, seed=0)
    optim = OptimConfig(lr=1e-3)
    engine = build_policy(CONFIG, groups=groups, dtype=torch.float32, optim=None, moe=MoeConfig())
    trainer = build_policy(
        CONFIG, groups=groups, dtype=torch.float32, optim=optim, moe=MoeConfig(routing_replay="rollout")
    )
    _copy_weights(engine, trainer)
    run = _run(tmp_path, trainer)

    # E of stage 0: its trajectories enter the FIFO from the rollout store (masks from the shards, routes
    # from the routes files), then the buffer goes through a checkpoint and back.
    stage0 = _groups(0, stage=0, version=0)
    current = _as_sampled(engine, stage0, SHIFTS)
    assert sum(m == 0 for g in stage0 for s in g.samples for m in s.policy_mask) > 0
    hdr.end_stage(run, 0, _store(run, stage0, 0))
    assert run.trainer.replay.buffer.keys() == [(0, i) for i in range(TRAIN_GROUPS)]
    hdr.save_replay(run.trainer.replay, tmp_path / "step")
    run.trainer.replay = hdr.open_replay(run.trainer.replay.config, TRAIN_GROUPS, tmp_path / "step")
    restored = [run.trainer.replay.buffer.get((0, i)).group for i in range(TRAIN_GROUPS)]
    for got, written in zip(restored, stage0):
        assert _trajectory_fields(got) == _trajectory_fields(written)
        for a, b in zip(got.samples, written.samples):
            assert a.routes.shape == (len(written.prompt_ids) + len(b.response_ids) - 1, 2, TOPK)
            assert a.routes.dtype == b.routes.dtype and a.routes.tobytes() == b.routes.tobytes()

    # B-C of stage 1: rank by headroom, re-score teacher-forced with routing replay, gate on drift.
    run.state = TrainerState(stage=1, global_update=UPDATES)
    stage1 = _groups(1, stage=1, version=UPDATES)
    _as_sampled(engine, stage1, [0.0] * TRAIN_GROUPS)
    store1 = _store(run, stage1, 1)
    order = headroom_order(run.trainer.replay.buffer)
    data = StageData(
        store=store1, replayed=hdr.replayed_groups(run, 1, UPDATES), updates=UPDATES, recheck=hdr.recheck(run)
    )
    scored, accepted = order, [key for key in order if SHIFTS[key[1]] ** 2 <= TAU]
    plan = run.trainer.replay.plan
    assert plan.accepted == accepted and sorted(accepted) == [(0, 1), (0, 2)]
    scores = {key: run.trainer.replay.buffer.score(key) for key in scored}
    for key in scored:
        group, shift = stage0[key[1]], SHIFTS[key[1]]
        # Drift: exactly the shift of the policy tokens' stored log-probs (observation tokens left out).
        assert scores[key].drift == pytest.approx(shift**2, rel=1e-3, abs=1e-10), key
        assert scores[key].headroom == pytest.approx(_hand_headroom(group, current[key[1]]), rel=1e-6), key
        assert abs(scores[key].headroom - _hand_headroom(group, current[key[1]], observations=True)) > 1e-3
    assert [g.prompt_id for g in data.replayed] == [f"0-{i}" for _, i in accepted]
    assert all(0 in s.policy_mask and s.routes is not None for g in data.replayed for s in g.samples)

    # The routes recorded for observation positions are what the trainer replays: other experts there move
    # the log-probs of the policy tokens after them, not of those before.
    on_policy = run.trainer.replay.buffer.get((0, 1)).group
    own, moved = (
        teacher_forced_logprobs(trainer, collate([g], pad_id=0), SCORING)
        for g in (on_policy, _observation_routes_changed(on_policy))
    )
    before, after = _around_first_observation(on_policy)
    # Measured: 0 before the first observation, 2.5e-3 at most after it (float32 GEMMs of other row counts may
    # round differently, hence 1e-6 before).
    assert (own - moved)[before].abs().max() <= 1e-6 < 1e-4 < (own - moved)[after].abs().max()

    # D: updates 1 and 2 each replay one accepted group before their fresh one. Under every registry loss
    # at update 1 and μ-GRPO's at update 2 (from β's weights each time) the loss counts policy tokens only,
    # the trainer's routing agrees with the replayed routes everywhere (observation inputs included), and
    # the replayed rows' ratio is against their stored generation-time log-probs: |log π_θ − b| is the
    # group's shift on them, 0 on fresh rows.
    for update in (1, 2):
        minibatch = data.minibatch(update, MINI_GROUPS, 0)
        assert minibatch[0] is data.replayed[update - 1] and len(minibatch) == 1 + MINI_GROUPS
        batch = collate(minibatch, pad_id=0)
        policy_tokens = [sum(s.policy_mask) for g in minibatch for s in g.samples]
        all_tokens = sum(len(s.response_ids) for g in minibatch for s in g.samples)
        shift, replayed_tokens = SHIFTS[accepted[update - 1][1]], sum(policy_tokens[:GROUP_SIZE])
        # icepop is refused with replay (replayed groups carry no log π_old of their stage)
        losses = [n for n in available_losses() if not needs_old_logprobs(n)] if update == 1 else ["mu_grpo"]
        for name in losses:
            _copy_weights(engine, trainer)
            metrics = train_step(
                trainer,
                batch,
                loss_name=name,
                loss_options=AlgoConfig(loss=name).loss_options(),
                temperature=1.0,
                micro_batch_size=4,
                impl="unfused",
            )
            assert math.isfinite(metrics["train/loss"]) and metrics["train/update_successful"] == 1.0, name
            assert metrics["train/response_tokens"] == sum(policy_tokens) < all_tokens, name
            assert metrics["train/routing_agreement"] == 1.0, name
            assert metrics["train/rollout_logprob_abs_diff_max"] == pytest.approx(shift, abs=1e-5), name
            assert metrics["train/rollout_logprob_abs_diff_mean"] == pytest.approx(
                shift * replayed_tokens / sum(policy_tokens), abs=1e-5
            ), name

    run.telemetry.logger.close()
    record = next(r for r in read_metrics(tmp_path) if "replay/accepted" in r)
    assert record["step"] == UPDATES + 1 and record["replay/accepted"] == 2 and record["replay/scored"] == len(scored)
    assert record["replay/drift_mean"] == pytest.approx(sum(SHIFTS[k[1]] ** 2 for k in scored) / len(scored), rel=1e-3)
    assert record["replay/headroom_mean"] == pytest.approx(
        sum(_hand_headroom(stage0[k[1]], current[k[1]]) for k in accepted) / 2, rel=1e-6
    )
    assert record["replay/age_mean"] == UPDATES


def test_hdr_replays_moe_trajectories_with_their_policy_masks_and_routes(tmp_path: Path):
    run_distributed(_replay_moe_trajectories, 1, str(tmp_path))
