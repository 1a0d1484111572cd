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

``$MUGRPO_ENGINE_FAULT`` breaks a rollout engine in the middle of a batch, for the engine watchdog's
tests (``rollout.watchdog``): ``raise:B`` makes the B-th batch (0-based, counted over every engine of
this process) raise ``InjectedEngineError`` after its first forward, as a dying engine does;
``hang:B`` blocks it there, as a hung engine does, until the process exits (or ``release_hangs()``).
Several faults are separated by commas: ``raise:1,hang:3``.
"""

from __future__ import annotations

import os
import signal
import threading

CRASH_ENV = "MUGRPO_CRASH_AT"
SIGNAL_ENV = "MUGRPO_SIGNAL_AT"
ENGINE_FAULT_ENV = "MUGRPO_ENGINE_FAULT"
ENGINE_FAULTS = ("raise", "hang")

_batches = 0
_batches_lock = threading.Lock()
_hangs_released = threading.Event()


class InjectedEngineError(RuntimeError):
    """The error ``$MUGRPO_ENGINE_FAULT=raise:B`` injects into an engine's batch B."""


def crash_point(name: str) -> None:
    """SIGKILL this process when ``name`` is one of the points listed in ``$MUGRPO_CRASH_AT``; send it
    the signal ``$MUGRPO_SIGNAL_AT`` names for ``name``, if any."""
    if name in os.environ.get(CRASH_ENV, "").split(","):
        os.kill(os.getpid(), signal.SIGKILL)
    for item in filter(None, os.environ.get(SIGNAL_ENV, "").split(",")):
        point, _, signame = item.partition("=")
        if point == name:
            os.kill(os.getpid(), signal.Signals[signame])


def engine_fault() -> None:
    """Called once per batch by an engine, in the middle of the batch: raise or block when
    ``$MUGRPO_ENGINE_FAULT`` names this batch (see the module docstring)."""
    global _batches
    spec = os.environ.get(ENGINE_FAULT_ENV, "")
    if not spec:
        return
    with _batches_lock:  # engines of abandoned calls may still run in other threads
        batch, _batches = _batches, _batches + 1
    for item in filter(None, spec.split(",")):
        kind, _, index = item.partition(":")
        if kind not in ENGINE_FAULTS or not index.isdigit():
            raise ValueError(f"${ENGINE_FAULT_ENV} item {item!r} is not raise:B or hang:B (B: a batch number)")
        if int(index) != batch:
            continue
        if kind == "raise":
            raise InjectedEngineError(f"injected: the engine died in the middle of batch {batch} (${ENGINE_FAULT_ENV})")
        _hangs_released.wait()


def release_hangs() -> None:
    """Unblock every batch ``hang:B`` holds (tests, so that no thread stays blocked after them); later
    hangs do not block. ``reset_engine_faults`` re-arms them."""
    _hangs_released.set()


def reset_engine_faults() -> None:
    """Count batches from 0 again and re-arm hangs (a test's start)."""
    global _batches
    with _batches_lock:
        _batches = 0
    _hangs_released.clear()
