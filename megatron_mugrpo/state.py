"""Where a run is: the staged loop's cursor and the figures it carries across restarts.

``TrainerState`` is saved in every checkpoint's metadata and restored on ``--resume``, so a resumed
run continues at the same update with the same data, best evaluation and accumulated timers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass(kw_only=True)
class BestEval:
    """The best held-out evaluation so far."""

    avg_pass_at_1: float
    """eval/avg_pass@1 (the mean over benchmarks)."""
    global_update: int
    """Update count of the evaluated policy (0: the starting policy)."""


@dataclass(kw_only=True)
class TrainerState:
    """Where the staged loop is; enough to resume exactly."""

    stage: int = 0
    """Stage k (0-based) the next update belongs to."""
    update_in_stage: int = 0
    """Updates already done within ``stage``."""
    global_update: int = 0
    """Updates done since the start of training (the policy version)."""
    data_cursor: int = 0
    """Position in the stage's minibatch permutation (groups consumed)."""
    acc_before: float | None = None
    """eval/avg_pass@1 of the starting policy (None until it was evaluated)."""
    acc_last: float | None = None
    """eval/avg_pass@1 of the latest evaluation."""
    best: BestEval | None = None
    """The best evaluation so far (its checkpoint is kept from pruning)."""
    train_tokens: float = 0.0
    """Response tokens trained on so far."""
    timers: dict[str, float] = field(default_factory=dict)
    """perf/ seconds accumulated by the processes of this run up to the checkpoint."""
    first_update_gap: dict[str, float] = field(default_factory=dict)
    """Stage (as a string) → max |trainer − rollout log-prob| at the stage's first update."""
    metrics_records: int | None = None
    """Records in metrics.jsonl when the checkpoint was taken: a run resumed from it drops exactly the
    ones logged after (the work it redoes). None until the first checkpoint."""
    queue: dict[str, Any] | None = None
    """Async mode: how far the trainer has consumed the rollout queue (None in staged mode). An opaque JSON
    value that the queue's reader writes and reads (``rollout.queue.QueueCursor.to_dict``), so the state
    carries it without importing the queue."""

    def at_stage(self, stage: int) -> TrainerState:
        """The state at the start of ``stage`` (same run figures, cursor reset)."""
        return dataclasses.replace(self, stage=stage, update_in_stage=0, data_cursor=0)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TrainerState:
        """Inverse of ``to_dict``."""
        values = dict(values)
        best = values.get("best")
        if isinstance(best, dict):
            values["best"] = BestEval(**best)
        return cls(**values)
