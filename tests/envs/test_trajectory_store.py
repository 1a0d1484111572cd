"""Multi-turn trajectories in the rollout store: their policy masks, turns and environment seconds go into
the Arrow shards under the shard's checksum and come back exactly; a store planned with an environment
takes trajectories only, one planned without takes none."""

from __future__ import annotations

import pytest

from megatron_mugrpo.records import RolloutGroup, RolloutSample, collate
from megatron_mugrpo.rollout.shards import StoreError, groups_to_table, row_to_group
from megatron_mugrpo.rollout.store import RolloutStore, write_store

ENV = {"kind": "search", "max_turns": 4}


def trajectory(seed: int) -> RolloutSample:
    """Turn 0 (3 tokens), an observation (2), turn 1 (seed % 3 + 1 tokens)."""
    last = seed % 3 + 1
    ids = [10 + seed, 11, 12, 30, 31, *range(13, 13 + last)]
    mask = [1, 1, 1, 0, 0, *[1] * last]
    lps = [-0.5 - 0.125 * seed if m else 0.0 for m in mask]  # float32-exact: shards store float32
    return RolloutSample(
        response_ids=ids,
        behaviour_logprobs=lps,
        finish_reason="stop",
        reward=float(seed % 2),
        reward_reason="correct" if seed % 2 else "wrong_answer",
        advantage=0.5 - seed % 2,
        policy_mask=mask,
        turns=[(0, 3), (5, 5 + last)],
        env_seconds=[0.25 * seed],
    )


def groups(n: int = 4) -> list[RolloutGroup]:
    return [
        RolloutGroup(
            prompt_id=f"q{g}", prompt_ids=[1, 2 + g], answer='["x"]', samples=[trajectory(g), trajectory(g + 1)]
        )
        for g in range(n)
    ]


def fields(group: RolloutGroup) -> list[tuple]:
    return [
        (s.response_ids, s.behaviour_logprobs, s.policy_mask, [tuple(t) for t in s.turns], s.env_seconds, s.reward)
        for s in group.samples
    ]


def test_a_trajectory_row_round_trips_through_arrow():
    table = groups_to_table(groups(2))
    assert {"policy_mask", "turns", "env_seconds"} <= set(table.column_names)
    back = [row_to_group(row) for row in table.to_pylist()]
    assert [fields(g) for g in back] == [fields(g) for g in groups(2)]


def test_a_store_planned_with_an_environment_keeps_the_trajectories_and_collates_their_masks(tmp_path):
    written = groups()
    sampling = {"temperature": 1.0, "env": ENV}
    store = write_store(
        tmp_path / "s", written, stage=0, policy_version=0, engine="t", sampling=sampling, shard_groups=2, vocab_size=64
    )
    reopened = RolloutStore.open(tmp_path / "s", verify=True)  # every shard through its checksum
    assert [fields(g) for g in reopened.groups()] == [fields(g) for g in written]
    batch = collate(store.groups([0]), pad_id=0)
    # prompt [1, 2]: targets from position 1 are the response; the observation's 2 targets are masked out
    assert batch.response_mask[0, 1:9].tolist() == [1, 1, 1, 0, 0, 1, 0, 0]


def test_a_store_takes_trajectories_exactly_when_planned_with_an_environment(tmp_path):
    plain = [
        RolloutGroup(
            prompt_id="p",
            prompt_ids=[1],
            answer="a",
            samples=[RolloutSample(response_ids=[5, 6], behaviour_logprobs=[-1.0, -1.0], finish_reason="stop")],
        )
    ]
    kwargs = {"stage": 0, "policy_version": 0, "engine": "t", "shard_groups": 1, "vocab_size": 64}
    with pytest.raises(StoreError, match="planned with an environment"):
        write_store(tmp_path / "a", plain, sampling={"env": ENV}, **kwargs)
    with pytest.raises(StoreError, match="planned without an environment"):
        write_store(tmp_path / "b", groups(1), sampling={}, **kwargs)
    mixed = groups(1)
    mixed[0].samples.append(plain[0].samples[0])
    with pytest.raises(StoreError, match="1 of 3 responses are single-turn"):
        write_store(tmp_path / "c", mixed, sampling={"env": ENV}, **kwargs)


def test_a_trajectory_that_does_not_end_on_a_policy_turn_is_refused(tmp_path):
    bad = groups(1)
    sample = bad[0].samples[0]
    sample.response_ids, sample.behaviour_logprobs = sample.response_ids[:5], sample.behaviour_logprobs[:5]
    sample.policy_mask, sample.turns = sample.policy_mask[:5], [(0, 3)]
    with pytest.raises(StoreError, match="starts and ends with a policy turn"):
        write_store(
            tmp_path / "s",
            bad,
            stage=0,
            policy_version=0,
            engine="t",
            sampling={"env": ENV},
            shard_groups=1,
            vocab_size=64,
        )
