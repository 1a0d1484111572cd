"""When the loops evaluate and checkpoint: one answer for the staged and the async loop.

After every update both loops ask ``Cadence`` "evaluate now? checkpoint now?" with the update count
and whether it ends a stage (μ updates) or the run. Evaluation comes first, so a checkpoint written
at the same update holds its result and a resume never loses the record.

    cadence = Cadence(eval_every=0, checkpoint_every=0, checkpoint_every_stages=1)
    cadence.evaluate_now(64, stage_end=True, last=False)                    # True: every stage end
    cadence.checkpoint_now(32, stage_end=False, last=False, stages_done=0)  # False: mid-stage
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class Cadence:
    """The evaluation and checkpoint periods of a run."""

    eval_every: int
    """eval.every_updates: evaluate every N updates; 0: at every stage end."""
    checkpoint_every: int
    """checkpoint.every_updates: also checkpoint every N updates (0: only at stage ends)."""
    checkpoint_every_stages: int
    """checkpoint.every_stages: checkpoint at the end of every N-th stage."""

    def evaluate_now(self, update: int, *, stage_end: bool, last: bool) -> bool:
        """After ``update`` updates: on its period, at stage ends without one, and always once at the end."""
        return _due(self.eval_every, update) or (stage_end and (self.eval_every == 0 or last))

    def checkpoint_now(self, update: int, *, stage_end: bool, last: bool, stages_done: int) -> bool:
        """After ``update`` updates (``stages_done`` stages finished): on either period, and always at the end."""
        at_stage_end = stage_end and _due(self.checkpoint_every_stages, stages_done)
        return last or at_stage_end or _due(self.checkpoint_every, update)


def _due(every: int, count: int) -> bool:
    return every > 0 and count % every == 0
