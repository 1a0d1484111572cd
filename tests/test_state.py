"""TrainerState: typed fields survive a JSON round trip; a new stage resets only the cursor."""

from __future__ import annotations

import json

from megatron_mugrpo.state import BestEval, TrainerState


def test_round_trip_through_json() -> None:
    state = TrainerState(
        stage=2,
        update_in_stage=3,
        global_update=19,
        data_cursor=24,
        acc_before=0.1,
        acc_last=0.3,
        best=BestEval(avg_pass_at_1=0.35, global_update=16),
        train_tokens=1234.0,
        timers={"perf/t_rollout_s": 4.5},
        first_update_gap={"0": 1e-6, "1": 2e-6},
    )
    assert TrainerState.from_dict(json.loads(json.dumps(state.to_dict()))) == state


def test_at_stage_resets_the_cursor_and_keeps_the_run_figures() -> None:
    state = TrainerState(stage=1, update_in_stage=5, global_update=13, data_cursor=40, train_tokens=7.0)
    nxt = state.at_stage(2)
    assert (nxt.stage, nxt.update_in_stage, nxt.data_cursor, nxt.global_update, nxt.train_tokens) == (2, 0, 0, 13, 7.0)
    assert state.stage == 1  # a new object: the old one is untouched


def test_the_queue_cursor_rides_along_as_the_queues_own_json_value() -> None:
    """The state carries the async queue's cursor without knowing its type: the reader's cursor comes
    back equal after a checkpoint's JSON round trip, and the saved value is a copy the reader no longer moves."""
    from megatron_mugrpo.rollout.queue import QueueCursor

    cursor = QueueCursor(shards=["w000_b0000001", "w001_b0000000"], position=3, dropped=1, window={"n": 2.0})
    state = TrainerState(global_update=4, queue=cursor.to_dict())
    cursor.shards.append("w000_b0000002")
    restored = TrainerState.from_dict(json.loads(json.dumps(state.to_dict())))
    assert QueueCursor.from_dict(restored.queue) == QueueCursor(
        shards=["w000_b0000001", "w001_b0000000"], position=3, dropped=1, window={"n": 2.0}
    )
