"""HDR with multi-turn trajectories: the buffer's headroom counts the policy's tokens only, and the buffer's
copies keep their policy masks, turns and environment seconds through a checkpoint."""

from __future__ import annotations

import copy
import math

from test_trajectory_store import fields, groups

from megatron_mugrpo.algorithms.replay import ReplayBuffer, ReplayConfig, candidate_entries, stored_headroom
from megatron_mugrpo.loop.hdr import ReplayState, load_replay, save_replay
from megatron_mugrpo.records import RolloutSample


def policy_only(sample: RolloutSample) -> RolloutSample:
    keep = [i for i, m in enumerate(sample.policy_mask) if m]
    return RolloutSample(
        response_ids=[sample.response_ids[i] for i in keep],
        behaviour_logprobs=[sample.behaviour_logprobs[i] for i in keep],
        finish_reason=sample.finish_reason,
        reward=sample.reward,
        advantage=sample.advantage,
    )


def test_stored_headroom_counts_policy_tokens_only():
    group = groups(1)[0]
    alone = copy.deepcopy(group)
    alone.samples = [policy_only(s) for s in group.samples]
    by_hand = [
        (1 - math.exp(lp)) if s.advantage > 0 else math.exp(lp) for s in alone.samples for lp in s.behaviour_logprobs
    ]
    assert stored_headroom(group) == stored_headroom(alone) == math.fsum(by_hand) / len(by_hand)


def test_the_replay_buffer_keeps_trajectories_through_a_checkpoint(tmp_path):
    stored = groups(3)
    for stage, group in enumerate(stored):
        group.stage = stage
    buffer = ReplayBuffer(8)
    buffer.push(candidate_entries(enumerate(stored)))
    assert len(buffer) == 3  # every group holds one correct and one wrong trajectory
    save_replay(ReplayState(config=ReplayConfig(enabled=True), train_groups=4, buffer=buffer), tmp_path)
    loaded, _ = load_replay(tmp_path / "replay", capacity=8)
    assert [fields(e.group) for e in loaded.entries()] == [fields(g) for g in stored]


def test_the_stage_reference_mismatch_leaves_observation_tokens_out():
    from megatron_mugrpo.training.stage_reference import group_mismatch_metrics

    group = groups(1)[0]
    alone = copy.deepcopy(group)
    alone.samples = [policy_only(s) for s in group.samples]
    # the trainer agrees with β on every policy token and disagrees (by -3) on every observation token
    reference = [[[lp - 3.0 * (1 - m) for lp, m in zip(s.behaviour_logprobs, s.policy_mask)] for s in group.samples]]
    got = group_mismatch_metrics([group], reference)
    assert got == group_mismatch_metrics([alone], [[s.behaviour_logprobs for s in alone.samples]])
    assert got["rollout/mismatch_logprob_abs_max"] == 0.0
    assert got["rollout/mismatch_tokens"] == sum(sum(s.policy_mask) for s in group.samples)
