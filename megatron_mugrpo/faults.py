"""Fault injection for the resume tests: SIGKILL this process at a named point.

A test sets ``$MUGRPO_CRASH_AT`` to one point name, or several separated by commas, and the process
that reaches the point dies at once:

- ``shard:K:I``: on the host that just wrote shard I of stage K's dataset (``loop.staged``);
- ``rollout:K``: after stage K's dataset is complete (``loop.staged``);
- ``update_start:N``: as global update N starts (``loop.staged``);
- ``update:N``: after global update N is applied and logged (``loop.staged``, ``loop.asynchronous``);
- ``worker:W:shard:N``: rollout worker W, after the N-th shard this process wrote is in place but
  before its record is: a half-written batch (``rollout.queue``).

SIGKILL, not an exception: nothing gets to clean up, exactly as when a node dies. This module
imports nothing from the package, so any layer (a rollout worker included) can hold a crash point
without pulling in the trainer.

``$MUGRPO_SIGNAL_AT`` sends another signal at a point instead, as a scheduler's preemption notice
would arrive there: ``update_start:5=SIGTERM,shard:0:0=SIGUSR1`` (the preemption tests).
"""

from __future__ import annotations

import os
import signal

CRASH_ENV = "MUGRPO_CRASH_AT"
SIGNAL_ENV = "MUGRPO_SIGNAL_AT"


def crash_point(name: str) -> None:
    """SIGKILL this process when ``name`` is one of the points listed in ``$MUGRPO_CRASH_AT``; send it
    the signal ``$MUGRPO_SIGNAL_AT`` names for ``name``, if any."""
    if name in os.environ.get(CRASH_ENV, "").split(","):
        os.kill(os.getpid(), signal.SIGKILL)
    for item in filter(None, os.environ.get(SIGNAL_ENV, "").split(",")):
        point, _, signame = item.partition("=")
        if point == name:
            os.kill(os.getpid(), signal.Signals[signame])
