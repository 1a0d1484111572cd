"""When the loops evaluate and checkpoint (``loop.cadence``): both loops ask the same object."""

from __future__ import annotations

from megatron_mugrpo.loop.cadence import Cadence

MU, STAGES = 4, 3


def _schedule(cadence: Cadence) -> tuple[list[int], list[int]]:
    """Updates after which a run of STAGES × MU updates evaluates and checkpoints."""
    evaluated, saved = [], []
    for update in range(1, MU * STAGES + 1):
        stage_end, last = update % MU == 0, update == MU * STAGES
        if cadence.evaluate_now(update, stage_end=stage_end, last=last):
            evaluated.append(update)
        if cadence.checkpoint_now(update, stage_end=stage_end, last=last, stages_done=update // MU):
            saved.append(update)
    return evaluated, saved


def test_defaults_evaluate_and_checkpoint_at_every_stage_end() -> None:
    assert _schedule(Cadence(eval_every=0, checkpoint_every=0, checkpoint_every_stages=1)) == ([4, 8, 12], [4, 8, 12])


def test_periods_in_updates_and_stages_and_always_the_end() -> None:
    evaluated, saved = _schedule(Cadence(eval_every=5, checkpoint_every=3, checkpoint_every_stages=2))
    assert evaluated == [5, 10, 12]  # the period, then once at the end
    assert saved == [3, 6, 8, 9, 12]  # every 3 updates, the end of stage 2, and the end
