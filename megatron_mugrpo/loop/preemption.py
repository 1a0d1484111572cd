"""Preemption: on SIGTERM or SIGUSR1, checkpoint at the next safe point and exit with ``EXIT_PREEMPTED``.

A cluster that takes a job's nodes back signals it first: Slurm sends SIGTERM (or the signal chosen
with ``--signal=SIG@seconds``) and kills the job ``GraceTime`` / ``seconds`` later; ``--requeue``
restarts it. Without a handler the signal ends the process at once and every update since the last
checkpoint is lost (a paper config checkpoints at stage ends only: up to 1,023 updates).

What happens instead, on every trainer rank:

* the handler only records the signal (nothing unsafe runs inside a signal handler) and starts a
  timer of ``checkpoint.preempt_grace_s``;
* in the optimizer phase, after the update in progress, the ranks agree (one all-reduce: any rank
  signalled means all stop), checkpoint, and raise ``Preempted``: at most the update that was running
  when the signal came is redone, and since its result is saved, none is lost;
* in a rollout phase, a host claims no further shard once the one it is writing is done; the ranks
  then meet where generation ends and, if shards are left unwritten, all stop there together
  (finished shards are durable and a resume regenerates only the missing ones; the stage's starting
  state is the last stage end's checkpoint, which the ranks write at the phase's start if the cadence
  skipped it);
* ``cli`` turns ``Preempted`` into exit code ``EXIT_PREEMPTED`` and rank 0 writes ``RUN_DIR/preempted.json``,
  which ``launch/slurm.sbatch`` reads to requeue the job and ``mugrpo train --config C --run-dir R``
  reads to resume ``R`` without a new flag;
* if the checkpoint is not written within the grace period, the timer ends the process anyway with
  the same exit code and a line that says so; the resume then starts from the last complete checkpoint.

Signals are process-wide, so the recorded signal is module state: one per process, like the handler.

    install(grace_s=120.0)          # trainer ranks, once the run is open
    ...
    if agreed(run.groups.any_rank):  # after an update: every trainer rank calls it
        checkpoint(run); raise stopped(run.state.global_update, checkpointed=True)
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
"""What a scheduler sends before it kills a job (Slurm: SIGTERM, or the ``--signal`` one)."""
EXIT_PREEMPTED = 75
"""Exit code of a preempted process (BSD's EX_TEMPFAIL: "try again later")."""
MARKER = "preempted.json"
"""Written in RUN_DIR by rank 0 when the run stops for a preemption; removed when the run resumes."""

_signal: int | None = None
_lock = threading.Lock()
_timer: threading.Timer | None = None


class Preempted(Exception):  # noqa: N818 (an event, not an error: the run stopped as asked)
    """The run stopped at a safe point because it was signalled; ``global_update`` is its checkpoint's."""

    def __init__(self, signum: int, global_update: int, *, checkpointed: bool) -> None:
        self.signum, self.global_update, self.checkpointed = signum, global_update, checkpointed
        where = f"checkpoint at update {global_update}" if checkpointed else "a resume starts from the last checkpoint"
        super().__init__(f"preempted by {signal.Signals(signum).name}: stopped at a safe point ({where})")


def install(*, grace_s: float, run_dir: Path | None = None) -> None:
    """Handle ``PREEMPT_SIGNALS`` in this process (call from the main thread). ``run_dir``: where the
    grace timer writes the marker if it has to end the process (rank 0 passes it)."""

    def handle(signum: int, _frame: object) -> None:
        global _signal, _timer
        with _lock:
            if _signal is not None:
                return  # the first signal's deadline stands (torchrun forwards Slurm's SIGTERM a second time)
            _signal = signum
            _timer = threading.Timer(grace_s, _out_of_time, args=(signum, grace_s, run_dir))
            _timer.daemon = True
            _timer.start()

    for signum in PREEMPT_SIGNALS:
        signal.signal(signum, handle)


def uninstall() -> None:
    """Default handlers back, the recorded signal and its timer cleared (tests; a finished run)."""
    global _signal, _timer
    with _lock:
        if _timer is not None:
            _timer.cancel()
        _signal, _timer = None, None
    for signum in PREEMPT_SIGNALS:
        signal.signal(signum, signal.SIG_DFL)


def requested() -> int | None:
    """The signal this process received (None: none)."""
    return _signal


def agreed(any_rank: Callable[[bool], bool]) -> bool:
    """Whether any trainer rank was signalled: a collective, so every trainer rank must call it at the
    same point (``ParallelGroups.any_rank``); ranks are signalled at slightly different times."""
    return any_rank(_signal is not None)


def stopped(global_update: int, *, checkpointed: bool) -> Preempted:
    """What every rank raises once the ranks agreed to stop; a rank that was not signalled itself (the
    signal reached another) names SIGTERM. ``checkpointed``: whether a checkpoint holds the state at
    ``global_update`` (else the resume starts from the last one)."""
    return Preempted(_signal or signal.SIGTERM, global_update, checkpointed=checkpointed)


def finished() -> None:
    """The run reached its checkpoint in time: the grace timer must not end the process any more."""
    with _lock:
        if _timer is not None:
            _timer.cancel()


def write_marker(run_dir: Path, exc: Preempted) -> None:
    """RUN_DIR/preempted.json: what a requeued job (and ``mugrpo train --config --run-dir``) resumes."""
    from megatron_mugrpo.durable import atomic_write_json

    record = {"signal": signal.Signals(exc.signum).name, "global_update": exc.global_update, "time": time.time()}
    atomic_write_json(run_dir / MARKER, record)


def read_marker(run_dir: Path) -> dict | None:
    """The marker of a preempted run (None: the run was not preempted, or has resumed since)."""
    path = run_dir / MARKER
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def clear_marker(run_dir: Path) -> None:
    """The run resumed: the marker no longer describes it."""
    (run_dir / MARKER).unlink(missing_ok=True)


def _out_of_time(signum: int, grace_s: float, run_dir: Path | None) -> None:
    """The grace period ran out before the checkpoint: exit now, saying so (the scheduler kills soon)."""
    name = signal.Signals(signum).name
    print(
        f"error: preempted by {name}: no checkpoint within checkpoint.preempt_grace_s={grace_s:g}s; exiting "
        "without one. A resume starts from the last complete checkpoint (raise the grace, or Slurm's "
        "--signal lead time, to lose less)",
        file=sys.stderr,
        flush=True,
    )
    if run_dir is not None:
        try:
            from megatron_mugrpo.durable import atomic_write_json

            atomic_write_json(run_dir / MARKER, {"signal": name, "global_update": None, "time": time.time()})
        except OSError:
            pass
    os._exit(EXIT_PREEMPTED)
