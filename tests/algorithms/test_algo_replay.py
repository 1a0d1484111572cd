"""Headroom-Drift Replay, the pure parts: scores against hand-computed values, eligibility, FIFO, gate, walk."""

from __future__ import annotations

import json
import math
import random
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megatron_mugrpo.algorithms.replay import (
    GroupKey,
    GroupScore,
    ReplayBuffer,
    ReplayConfig,
    ReplayEntry,
    Selection,
    candidate_entries,
    group_headroom_drift,
    headroom_order,
    is_mixed_outcome,
    passes_drift_gate,
    recent_order,
    recheck_due,
    replay_capacity,
    replay_policy,
    replay_slots,
    select_groups,
    selection_metrics,
    stored_headroom,
)
from megatron_mugrpo.config import load_config
from megatron_mugrpo.errors import ConfigError
from megatron_mugrpo.records import RolloutGroup, RolloutSample, collate

L = math.log


def _group(stage: int, rewards: list[float], *, version: int = 0, prompt: str = "p") -> RolloutGroup:
    samples = [
        RolloutSample(
            response_ids=[5, 6], behaviour_logprobs=[-0.5, -1.0], finish_reason="stop", reward=r, advantage=r - 0.5
        )
        for r in rewards
    ]
    return RolloutGroup(
        prompt_id=prompt, prompt_ids=[1, 2], answer="3", samples=samples, stage=stage, policy_version=version
    )


def _entry(stage: int, index: int, version: int = 0, headroom: float = 0.5) -> ReplayEntry:
    return ReplayEntry(key=(stage, index), policy_version=version, headroom=headroom, group=None)


# ------------------------------------------------------------------------------------- scores


def test_headroom_and_drift_match_hand_computed_values() -> None:
    """Group 0: a positive response (2 tokens), a negative one (1 token), a zero-advantage one (1 token).
    Group 1: one negative response. Padding positions hold garbage that must not count."""
    nan = float("nan")
    logprobs = torch.tensor(
        [
            [L(0.5), L(0.25), nan],  # A = +1
            [L(0.8), 7.0, 7.0],  # A = -1 (one token, then padding)
            [L(0.9), 0.0, 0.0],  # A = 0
            [L(0.1), L(0.2), 0.0],  # group 1, A = -0.5
        ],
        dtype=torch.float32,
    )
    behaviour = torch.tensor(
        [[L(0.4), L(0.25), 3.0], [L(0.5), 0.0, 0.0], [L(0.9), 0.0, 0.0], [L(0.1), L(0.1), 0.0]], dtype=torch.float32
    )
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 0, 0], [1, 1, 0]], dtype=torch.float32)
    advantages = torch.tensor([1.0, -1.0, 0.0, -0.5])
    group_index = torch.tensor([0, 0, 0, 1])

    headroom, drift = group_headroom_drift(logprobs, behaviour, advantages, mask, group_index, 2)

    # Headroom: (1 − 0.5) + (1 − 0.25) for A > 0, 0.8 for A < 0, 0 for A = 0; 4 tokens.
    expected_h0 = (0.5 + 0.75 + 0.8 + 0.0) / 4
    expected_d0 = ((L(0.5) - L(0.4)) ** 2 + 0.0 + (L(0.8) - L(0.5)) ** 2 + 0.0) / 4
    expected_h1 = (0.1 + 0.2) / 2
    expected_d1 = (0.0 + (L(0.2) - L(0.1)) ** 2) / 2
    assert headroom.dtype == drift.dtype == torch.float64
    torch.testing.assert_close(
        headroom, torch.tensor([expected_h0, expected_h1], dtype=torch.float64), rtol=1e-6, atol=0
    )
    torch.testing.assert_close(drift, torch.tensor([expected_d0, expected_d1], dtype=torch.float64), rtol=1e-6, atol=0)


def test_scores_through_collate_are_per_group_and_order_free() -> None:
    """Collating groups in another order permutes their scores, nothing else."""
    rng = random.Random(0)
    groups = []
    for g in range(3):
        samples = []
        for _ in range(4):
            n = rng.randint(1, 5)
            samples.append(
                RolloutSample(
                    response_ids=[rng.randrange(3, 50) for _ in range(n)],
                    behaviour_logprobs=[-rng.uniform(0.1, 3) for _ in range(n)],
                    finish_reason="stop",
                    advantage=rng.uniform(-1, 1),
                )
            )
        groups.append(RolloutGroup(prompt_id=str(g), prompt_ids=[1] * (g + 2), answer="", samples=samples))

    def scores(order: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        batch = collate([groups[i] for i in order], pad_id=0)
        # A "current policy" that is a deterministic function of the token: the same whatever the layout.
        current = torch.where(batch.response_mask.bool(), -0.01 * batch.targets.double(), 0.0)
        return group_headroom_drift(
            current, batch.behaviour_logprobs, batch.advantages, batch.response_mask, batch.group_index, len(order)
        )

    h, d = scores([0, 1, 2])
    h2, d2 = scores([2, 0, 1])
    torch.testing.assert_close(h2, h[[2, 0, 1]])
    torch.testing.assert_close(d2, d[[2, 0, 1]])


def test_drift_is_zero_on_policy_and_the_square_of_a_constant_shift() -> None:
    logprobs = torch.tensor([[-0.3, -1.2, -2.0]], dtype=torch.float64)
    mask = torch.ones(1, 3)
    _, on_policy = group_headroom_drift(logprobs, logprobs, torch.tensor([1.0]), mask, torch.tensor([0]), 1)
    _, shifted = group_headroom_drift(logprobs, logprobs - 0.03, torch.tensor([1.0]), mask, torch.tensor([0]), 1)
    assert on_policy.item() == 0.0
    assert shifted.item() == pytest.approx(0.03**2, rel=1e-9)


def test_stored_headroom_matches_hand_computed_values_and_prefers_old_logprobs() -> None:
    """H(g) when a group enters the buffer: the headroom formula with π_θ = the stored log-probs."""
    group = _group(0, [1.0, 0.0, 0.5])  # advantages +0.5, -0.5, 0 over tokens with p = e^-0.5, e^-1
    p1, p2 = math.exp(-0.5), math.exp(-1.0)
    expected = ((1 - p1) + (1 - p2) + p1 + p2 + 0 + 0) / 6
    assert stored_headroom(group) == pytest.approx(expected, rel=1e-12)
    # The same as the teacher-forced scoring formula when the "current policy" is the stored one.
    batch = collate([group], pad_id=0)
    h, _ = group_headroom_drift(
        batch.behaviour_logprobs, batch.behaviour_logprobs, batch.advantages, batch.response_mask, batch.group_index, 1
    )
    assert stored_headroom(group) == pytest.approx(float(h[0]), rel=1e-6)
    # A quantized stage's group carries the trainer's log π_old: its headroom is measured from that.
    for sample in group.samples:
        sample.old_logprobs = [L(0.9), L(0.9)]
    assert stored_headroom(group) == pytest.approx((0.1 + 0.1 + 0.9 + 0.9) / 6, rel=1e-12)


# --------------------------------------------------------------------------------- eligibility


@pytest.mark.parametrize(
    ("rewards", "mixed"),
    [
        ([1.0, 0.0, 1.0], True),
        ([0.0, 0.0, 1.0, 0.0], True),
        ([1.0, 1.0, 1.0], False),  # all correct
        ([0.0, 0.0], False),  # all wrong
        ([0.5, 0.5], False),  # equal rewards: zero advantages
        ([1.0], False),
        ([], False),
    ],
)
def test_mixed_outcome(rewards: list[float], mixed: bool) -> None:
    assert is_mixed_outcome(rewards) is mixed


def test_only_mixed_outcome_groups_enter_the_buffer_as_copies() -> None:
    groups = [_group(3, [1, 1]), _group(3, [0, 1]), _group(3, [0, 0]), _group(3, [1, 0, 0], version=12)]
    entries = candidate_entries(enumerate(groups))
    assert [e.key for e in entries] == [(3, 1), (3, 3)]
    assert entries[1].policy_version == 12
    groups[1].samples[0].behaviour_logprobs[0] = -99.0  # the caller's object changes later ...
    assert (
        entries[0].group is not None and entries[0].group.samples[0].behaviour_logprobs[0] == -0.5
    )  # ... not the copy
    references = candidate_entries(enumerate(groups), copy_groups=False)
    assert [e.key for e in references] == [(3, 1), (3, 3)] and all(e.group is None for e in references)
    # Every entry is ranked from the moment it enters: its headroom from the stored log-probs.
    assert [e.headroom for e in entries] == [stored_headroom(e.group) for e in entries]  # the copies as entered
    assert entries[1].headroom == stored_headroom(groups[3]) and math.isfinite(entries[0].headroom)
    assert [e.headroom for e in references] == [stored_headroom(groups[1]), stored_headroom(groups[3])]
    buffer = ReplayBuffer(capacity=10)
    buffer.push(entries)
    assert buffer.keys() == [(3, 1), (3, 3)]


# -------------------------------------------------------------------------------------- FIFO


def test_fifo_evicts_the_oldest_at_capacity_and_forgets_their_scores() -> None:
    buffer = ReplayBuffer(capacity=3)
    assert buffer.push([_entry(0, i) for i in range(2)]) == []
    buffer.update_scores({(0, 0): GroupScore(headroom=0.5, drift=0.1, scored_at=4)})
    evicted = buffer.push([_entry(1, i) for i in range(3)])
    assert evicted == [(0, 0), (0, 1)]
    assert buffer.keys() == [(1, 0), (1, 1), (1, 2)] and len(buffer) == 3
    assert buffer.score((0, 0)) is None
    with pytest.raises(ValueError, match="already in the replay buffer"):
        buffer.push([_entry(1, 2)])
    with pytest.raises(KeyError, match="not in the replay buffer"):
        buffer.update_scores({(0, 0): GroupScore(headroom=0.0, drift=0.0, scored_at=0)})
    with pytest.raises(ValueError, match="capacity"):
        ReplayBuffer(capacity=0)


def test_buffer_state_round_trip() -> None:
    buffer = ReplayBuffer(capacity=4)
    groups = [_group(0, [1, 0], prompt="a"), _group(0, [0, 1], prompt="b")]
    buffer.push(candidate_entries(enumerate(groups)))
    buffer.push([_entry(1, 7, version=4)])
    buffer.update_scores({(0, 1): GroupScore(headroom=0.25, drift=3e-4, scored_at=4)})
    copies = [e.group for e in buffer.entries() if e.group is not None]
    restored = ReplayBuffer.from_state_dict(buffer.state_dict(), copies)
    assert restored.state_dict() == buffer.state_dict()
    assert restored.entries() == buffer.entries()
    assert restored.score((0, 1)) == GroupScore(headroom=0.25, drift=3e-4, scored_at=4)
    smaller = ReplayBuffer.from_state_dict(buffer.state_dict(), copies, capacity=2)
    assert smaller.keys() == [(0, 1), (1, 7)]


# ---------------------------------------------------------------------------------- ordering


def test_headroom_order_follows_headroom_for_new_and_old_groups_alike() -> None:
    """Old groups (re-scored at an earlier stage) and new ones (only their headroom at entry) in one
    order by headroom: a new group does not jump the queue for being new, nor an old one for being scored."""
    buffer = ReplayBuffer(capacity=10)
    buffer.push([_entry(0, i, headroom=h) for i, h in enumerate([0.7, 0.8, 0.1, 0.6, 0.3])])  # stage 0
    buffer.update_scores(
        {  # re-scored at stage 1: the policy learned from (0, 1) and (0, 0), (0, 2) has more left
            (0, 0): GroupScore(headroom=0.2, drift=0.0, scored_at=4),
            (0, 1): GroupScore(headroom=0.05, drift=0.0, scored_at=4),
            (0, 2): GroupScore(headroom=0.65, drift=0.0, scored_at=4),
        }
    )
    buffer.push([_entry(1, i, headroom=h) for i, h in enumerate([0.4, 0.9, 0.2])])  # stage 1: new
    assert buffer.headroom((0, 2)) == 0.65 and buffer.headroom((1, 1)) == 0.9 and buffer.headroom((0, 3)) == 0.6
    expected = [(1, 1), (0, 2), (0, 3), (1, 0), (0, 4), (1, 2), (0, 0), (0, 1)]
    assert headroom_order(buffer) == expected
    # Ties go to the newest; a NaN headroom (no response tokens) goes last.
    tied = ReplayBuffer(capacity=10)
    tied.push([_entry(0, 0, headroom=0.3), _entry(0, 1, headroom=float("nan")), _entry(1, 0, headroom=0.3)])
    assert headroom_order(tied) == [(1, 0), (0, 0), (0, 1)]
    # The walk scores in that order: the new group with the most headroom first, then the old one.
    calls: list[list[GroupKey]] = []
    drifts = {key: 0.0 for key in buffer}
    select_groups(headroom_order(buffer), k=2, max_scored=8, tau=1.0, score=_fake_scores(drifts, calls))
    assert calls == [[(1, 1), (0, 2)]]
    recent = ReplayBuffer(capacity=10)
    recent.push([_entry(0, i) for i in range(5)])
    assert recent_order(recent) == [(0, 4), (0, 3), (0, 2), (0, 1), (0, 0)]
    assert replay_policy("hdr").gated and not replay_policy("recent").gated
    with pytest.raises(ValueError, match=r"replay\.policy"):
        replay_policy("oldest")


# -------------------------------------------------------------------------------- gate, walk


def test_drift_gate_boundary() -> None:
    tau = 1e-3
    assert passes_drift_gate(tau, tau)  # D = τ is admitted
    assert passes_drift_gate(math.nextafter(tau, 0.0), tau)
    assert not passes_drift_gate(math.nextafter(tau, 1.0), tau)
    assert not passes_drift_gate(float("nan"), tau)


def _fake_scores(drifts: dict[GroupKey, float], calls: list[list[GroupKey]]):
    def score(keys: list[GroupKey]) -> list[GroupScore]:
        calls.append(list(keys))
        return [GroupScore(headroom=0.5, drift=drifts[k], scored_at=9) for k in keys]

    return score


def test_selection_accepts_at_the_boundary_and_rejects_above() -> None:
    tau = 1e-3
    order = [(0, i) for i in range(5)]
    drifts = dict(zip(order, [2e-3, tau, math.nextafter(tau, 1.0), 5e-4, 0.0]))
    calls: list[list[GroupKey]] = []
    selection = select_groups(order, k=2, max_scored=10, tau=tau, score=_fake_scores(drifts, calls))
    assert selection.accepted == [(0, 1), (0, 3)]
    assert selection.rejected == [(0, 0), (0, 2)]
    assert set(selection.scores) == {(0, 0), (0, 1), (0, 2), (0, 3)}
    assert calls == [[(0, 0), (0, 1)], [(0, 2)], [(0, 3)]]  # chunk = acceptances still needed: never overshoots k


def _walk_one_at_a_time(order, *, k, max_scored, tau, drifts) -> Selection:
    """The walk exactly as the method states it: score one group, decide, repeat."""
    accepted, rejected, scores = [], [], {}
    for key in order:
        if len(accepted) >= k or len(scores) >= max_scored:
            break
        scores[key] = GroupScore(headroom=0.5, drift=drifts[key], scored_at=9)
        (accepted if drifts[key] <= tau else rejected).append(key)
    return Selection(accepted=accepted, rejected=rejected, scores=scores)


@pytest.mark.parametrize("seed", range(20))
def test_chunked_walk_equals_the_one_at_a_time_walk(seed: int) -> None:
    rng = random.Random(seed)
    order = [(rng.randrange(5), i) for i in range(rng.randint(0, 30))]
    drifts = {key: rng.choice([0.0, 5e-4, 1e-3, 2e-3, 1.0]) for key in order}
    k, max_scored = rng.randint(1, 8), rng.randint(1, 20)
    calls: list[list[GroupKey]] = []
    got = select_groups(order, k=k, max_scored=max_scored, tau=1e-3, score=_fake_scores(drifts, calls))
    assert got == _walk_one_at_a_time(order, k=k, max_scored=max_scored, tau=1e-3, drifts=drifts)
    assert [key for chunk in calls for key in chunk] == list(got.scores)  # every group scored once, in order


def test_naive_selection_takes_the_first_k_ungated() -> None:
    order = [(2, 3), (2, 1), (1, 0)]
    selection = select_groups(order, k=2, max_scored=0, tau=0.0, score=None)
    assert selection.accepted == [(2, 3), (2, 1)] and selection.rejected == [] and selection.scores == {}


def test_no_group_is_replayed_in_its_own_step() -> None:
    """A loop over steps: select from the buffer, update, then push the step's candidates."""
    buffer = ReplayBuffer(capacity=6)
    rng = random.Random(1)
    for step in range(6):
        for name in ("hdr", "recent"):
            policy = replay_policy(name)
            score = _fake_scores({k: 0.0 for k in buffer}, []) if policy.gated else None
            selection = select_groups(policy.order(buffer), k=3, max_scored=6, tau=1.0, score=score)
            assert all(stage < step for stage, _ in selection.accepted)
            assert len(selection.accepted) == min(3, len(buffer))
        groups = [_group(step, [rng.choice([0.0, 1.0]) for _ in range(4)]) for _ in range(4)]
        buffer.push(candidate_entries(enumerate(groups)))


def test_selection_metrics() -> None:
    buffer = ReplayBuffer(capacity=10)
    buffer.push([_entry(0, 0, version=0), _entry(1, 0, version=4), _entry(1, 1, version=4)])
    selection = Selection(
        accepted=[(1, 0), (0, 0)],
        rejected=[(1, 1)],
        scores={
            (1, 0): GroupScore(headroom=0.4, drift=1e-4, scored_at=8),
            (0, 0): GroupScore(headroom=0.2, drift=3e-4, scored_at=8),
            (1, 1): GroupScore(headroom=0.9, drift=5e-3, scored_at=8),
        },
    )
    m = selection_metrics(selection, buffer, policy_version=8)
    assert m["buffer_groups"] == 3 and m["scored"] == 3 and m["accepted"] == 2
    assert m["acceptance_rate"] == pytest.approx(2 / 3)
    assert m["headroom_mean"] == pytest.approx(0.3) and m["headroom_mean_rejected"] == pytest.approx(0.9)
    assert m["drift_mean"] == pytest.approx((1e-4 + 3e-4 + 5e-3) / 3)
    assert m["drift_mean_accepted"] == pytest.approx(2e-4) and m["drift_mean_rejected"] == pytest.approx(5e-3)
    assert m["age_mean"] == pytest.approx((4 + 8) / 2)
    empty = selection_metrics(Selection(accepted=[], rejected=[], scores={}), ReplayBuffer(capacity=1), 0)
    assert empty["accepted"] == 0 and math.isnan(empty["acceptance_rate"]) and math.isnan(empty["age_mean"])


# ---------------------------------------------------------------------------------- placement


@pytest.mark.parametrize(("replayed", "updates"), [(8, 4), (7, 4), (2, 4), (0, 4), (0, 1), (3, 2), (1, 64)])
def test_replay_slots_spread_all_groups_over_updates_after_the_first(replayed: int, updates: int) -> None:
    slots = replay_slots(replayed, updates)
    assert len(slots) == updates
    assert [i for s in slots for i in s] == list(range(replayed))  # each once, priority order kept
    assert len(slots[0]) == 0  # the first update of a stage stays on-policy
    if updates > 1:
        sizes = [len(s) for s in slots[1:]]
        assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
    assert [len(s) for s in replay_slots(8, 4)] == [0, 3, 3, 2]


def test_mu_one_replays_nothing_so_the_first_update_stays_a_check_of_the_engine() -> None:
    """μ = 1: the only update is the first, which replayed groups never join; the decision accepts none."""
    assert replay_capacity(8, updates=1) == 0 and replay_capacity(8, updates=2) == 8
    assert replay_slots(0, 1) == [range(0)]
    with pytest.raises(ValueError, match="cannot replay 3 groups"):
        replay_slots(3, 1)
    calls: list[list[GroupKey]] = []
    selection = select_groups(
        [(0, 0), (0, 1)], k=replay_capacity(2, 1), max_scored=8, tau=1.0, score=_fake_scores({}, calls)
    )
    assert selection.accepted == [] and calls == []  # nothing scored either


def test_recheck_is_due_only_after_more_than_recheck_updates() -> None:
    """At μ = 256 a group accepted at update 512 (the stage's start) and placed at slot u is trained on at
    update 512 + u: re-checked from slot 65 on with the default 64."""
    slots = replay_slots(64, 256)
    due = [u for u, share in enumerate(slots) if share and recheck_due(512, 512 + u, 64)]
    assert due == [u for u in range(65, 256) if slots[u]] and len(due) > 0
    assert not recheck_due(512, 512 + 64, 64) and recheck_due(512, 512 + 65, 64)
    assert recheck_due(0, 1, 0)  # 0: every slot (the first update never has one)


# ------------------------------------------------------------------------------------- config


def test_config_defaults_and_resolution() -> None:
    cfg = ReplayConfig()
    assert not cfg.enabled and cfg.policy == "hdr" and cfg.tau == 1e-3 and not cfg.cross_stage
    assert cfg.recheck_updates == 64
    assert cfg.groups_for(32) == 8 and cfg.capacity_groups(32) == 256 and cfg.max_scored(32) == 32
    assert cfg.groups_for(2) == 1  # at least one group
    custom = ReplayConfig(groups_per_step=3, capacity=50, max_scored_per_step=7)
    assert custom.groups_for(32) == 3 and custom.capacity_groups(32) == 50 and custom.max_scored(32) == 7
    run = load_config(None, ["replay.enabled=true", "replay.tau=2e-3", "replay.cross_stage=true"])
    assert run.replay.enabled and run.replay.tau == 2e-3 and run.replay.cross_stage


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("algo.rollout_correction.tis_cap=2", "replay.enabled cannot be combined with algo.rollout_correction"),
        ("replay.policy=oldest", "replay.policy='oldest' is unknown"),
        ("replay.tau=-1", "replay.tau=-1.0 must be >= 0"),
        ("replay.groups_per_step=-2", "replay.groups_per_step=-2 must be >= 0"),
        ("replay.groups_fraction=0", "replay.groups_fraction=0.0 must be in (0, 1]"),
        ("replay.capacity=-1", "replay.capacity=-1 must be >= 0"),
        ("replay.max_scored_per_step=-1", "replay.max_scored_per_step=-1 must be >= 0"),
        ("replay.recheck_updates=-1", "replay.recheck_updates=-1 must be >= 0"),
    ],
)
def test_config_validation_names_the_key(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, ["replay.enabled=true", override])


def _routed(group: RolloutGroup, seed: int, experts: int = 4) -> RolloutGroup:
    """``group`` with routes on every response: [prompt + response - 1, 2 layers, top-2] distinct uint8 ids."""
    rng = np.random.default_rng(seed)
    for sample in group.samples:
        rows = len(group.prompt_ids) + len(sample.response_ids) - 1
        sample.routes = np.stack([rng.permutation(experts)[:2] for _ in range(rows * 2)]).reshape(rows, 2, 2)
        sample.routes = sample.routes.astype(np.uint8)
    return group


def _assert_same_routes(read: list[RolloutGroup], written: list[RolloutGroup]) -> None:
    for a_group, b_group in zip(read, written, strict=True):
        for a, b in zip(a_group.samples, b_group.samples, strict=True):
            assert a.routes.dtype == b.routes.dtype and a.routes.tobytes() == b.routes.tobytes()


def test_replayed_groups_carry_their_routes_through_the_buffer_and_a_checkpoint(tmp_path) -> None:
    """moe.routing_replay=rollout with replay.enabled: the buffer's copies keep each response's routes, a
    checkpoint writes them (checksummed) and a load gives them back bit for bit; a batch of fresh and
    replayed groups collates with routes; a damaged routes file is a CheckpointError."""
    from megatron_mugrpo.loop.hdr import ROUTES_FILE, STATE_FILE, ReplayState, load_replay, save_replay
    from megatron_mugrpo.training.checkpoint import CheckpointError

    load_config(None, ["replay.enabled=true", "model.tiny.arch=qwen3_moe", "moe.routing_replay=rollout"])
    stored = [_routed(_group(1, [1.0, 0.0, 1.0], prompt=f"p{i}"), seed=i) for i in range(3)]
    entries = candidate_entries(enumerate(stored))
    for group in stored:  # later changes to the stage's objects cannot reach the buffer's copies
        group.samples[0].routes = group.samples[0].routes.copy()
    buffer = ReplayBuffer(8)
    buffer.push(entries)
    _assert_same_routes([e.group for e in buffer.entries()], stored)
    state = ReplayState(config=ReplayConfig(enabled=True), train_groups=4, buffer=buffer)
    save_replay(state, tmp_path)
    assert json.loads((tmp_path / "replay" / STATE_FILE).read_text())["routes"]["dtype"] == "uint8"
    loaded, _ = load_replay(tmp_path / "replay", capacity=8)
    _assert_same_routes([e.group for e in loaded.entries()], stored)

    fresh = _routed(_group(2, [0.0, 1.0, 1.0], prompt="fresh"), seed=9)
    fresh.samples[0].response_ids = [5, 6, 7]  # a longer response: routes pad with the tokens
    fresh.samples[0].behaviour_logprobs = [-0.5, -1.0, -0.25]
    fresh.samples[0].routes = np.concatenate([fresh.samples[0].routes, fresh.samples[0].routes[-1:]])
    batch = collate([fresh, loaded.get((1, 2)).group], pad_id=0)
    assert batch.routes is not None and tuple(batch.routes.shape) == (6, 5, 2, 2)  # lined up with tokens
    assert batch.routes[3, :3].numpy().tobytes() == stored[2].samples[0].routes.tobytes()

    routes_file = tmp_path / "replay" / ROUTES_FILE
    routes_file.write_bytes(routes_file.read_bytes()[:-8] + bytes(8))
    with pytest.raises(CheckpointError, match=r"replay routes .*routes\.arrow .*checksum.*older checkpoint"):
        load_replay(tmp_path / "replay", capacity=8)
    routes_file.unlink()
    with pytest.raises(CheckpointError, match=r"replay routes .*routes\.arrow are missing"):
        load_replay(tmp_path / "replay", capacity=8)


def test_a_cross_stage_reference_reads_its_routes_back_from_the_store(tmp_path) -> None:
    """replay.cross_stage keeps only (stage, index): resolving it reads the group, routes included, from D_stage."""
    from megatron_mugrpo.loop.hdr import ReplayState, resolve_group
    from megatron_mugrpo.rollout.store import RolloutStore, ShardWriter, prepare_store, seal_store, store_identity

    groups = [_routed(_group(1, [1.0, 0.0, 1.0], prompt=f"p{i}"), seed=i) for i in range(3)]
    wanted = store_identity(
        stage=1, policy_version=0, engine="transformers", sampling={"seed": 1}, num_groups=3, shard_groups=2,
        vocab_size=8,
    )  # fmt: skip
    plan = prepare_store(tmp_path / "stage_1", wanted)
    writer = ShardWriter(tmp_path / "stage_1", plan.manifest)
    for shard in plan.missing:
        assert writer.claim(shard)
        writer.write_shard(shard, [groups[i] for i in plan.manifest.shard_range(shard)])
    seal_store(tmp_path / "stage_1")
    buffer = ReplayBuffer(8)
    buffer.push(candidate_entries(enumerate(RolloutStore.open(tmp_path / "stage_1").groups()), copy_groups=False))
    state = ReplayState(config=ReplayConfig(enabled=True, cross_stage=True), train_groups=4, buffer=buffer)
    run = SimpleNamespace(trainer=SimpleNamespace(replay=state), rollout_dir=lambda stage: tmp_path / f"stage_{stage}")
    _assert_same_routes([resolve_group(run, state, (1, i)) for i in (2, 0)], [groups[2], groups[0]])
