"""Heartbeats between the trainer and the rollout workers, through the run directory.

Each process runs a ``Heartbeat``: a daemon thread that rewrites ``<dir>/<name>.json`` every
``HEARTBEAT_S`` seconds with a growing count, a nonce of its own, a status (running, done, or
failed with a message) and the process's *progress*: a counter that only its main loop advances
(``advance``: per response generated, batch written, update made, and per look at the other side
while it waits), with a phrase saying what it is doing. Another process watches that file with a
``Peer``:

- a file unchanged for ``timeout_s`` means the process died (or its whole interpreter is stuck);
- a file that keeps changing while its progress does not, for ``progress_timeout_s``, means the
  process is alive but its main loop hangs (a collective that never returns, an engine that never
  answers): the heartbeat thread alone cannot tell that apart from work;
- a failed status carries the process's own error message.

Both delays are timed on the watcher's own clock, so the clocks of different nodes never matter.
Only changes seen after the watcher started count: a stale file left by an earlier launch of the
same run directory never passes for a live process, and its 'done' or 'failed' status never for
this launch's. One record that was there before the watcher started does count: one that *echoes*
the watcher's own nonce. A worker echoes the nonce of the trainer record it read last (``Peer(...,
echo=heartbeat.echo)``), written at once, and reads the trainer's record again after it finds the
trainer's first publication. The trainer publishes only after it started watching, so a worker that
wrote its last record just before the trainer looked, and died right after, is still timed out by
``timeout_s`` rather than waited for as one that never started (``startup_s``).

    with Heartbeat(beat_dir / "worker_000.json"):           # in the worker
        advance("generating batch 3")                        # its main loop, as it works or polls
    peer = Peer(beat_dir / "worker_000.json", "rollout worker 0 (rank 1)", timeout_s=300, startup_s=900,
                progress_timeout_s=1800)
    peer.check()                                             # in the trainer's wait loop: raises RankFailedError
"""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from megatron_mugrpo.asynchronous.files import write_json
from megatron_mugrpo.durable import read_json

HEARTBEAT_S = 1.0
"""Seconds between two beats; a timeout of many beats tolerates a busy file system."""
RUNNING, DONE, FAILED = "running", "done", "failed"


class RankFailedError(RuntimeError):
    """Another rank of the run died, hangs or failed: the message names it and what to do."""


@dataclass(frozen=True)
class Beat:
    """One heartbeat record."""

    nonce: str
    """Random per process: a restarted process never repeats an old record."""
    count: int
    status: str
    """running | done | failed."""
    message: str
    """Why it failed (the exception's text), else ''."""
    pid: int
    host: str
    progress: int = 0
    """Steps of the process's main loop (``Heartbeat.advance``); the heartbeat thread never moves it."""
    doing: str = ""
    """What the main loop is doing (its last ``advance``), e.g. 'generating batch 12'."""
    echo: str = ""
    """The nonce of the other side's record this process read last (``Heartbeat.echo``); '' if none."""


def read_beat(path: Path) -> Beat | None:
    values = read_json(path)
    return Beat(**values) if values is not None else None


class Heartbeat:
    """Announce that this process is alive (a daemon thread), and how it ended."""

    def __init__(self, path: Path, interval_s: float = HEARTBEAT_S, doing: str = "starting up"):
        self.path, self.interval_s = path, interval_s
        self._nonce, self._count = uuid.uuid4().hex, 0
        self._status, self._message = RUNNING, ""
        self._progress, self._doing, self._echo = 0, doing, ""
        self._lock, self._stop = threading.Lock(), threading.Event()
        self._thread: threading.Thread | None = None

    def advance(self, doing: str | None = None, steps: int = 1) -> None:
        """The main loop moved on by ``steps`` (and now does ``doing``, when given). Cheap: the next
        beat carries it; call it from the loop that does the work, never from a helper thread."""
        with self._lock:
            self._progress += steps
            if doing is not None:
                self._doing = doing

    def echo(self, nonce: str) -> None:
        """Say in this process's record that it read a record with ``nonce`` (the watcher's own, when
        that watcher is of this launch); a new nonce is written at once, not at the next beat."""
        if nonce != self._echo:
            with self._lock:
                self._echo = nonce
            self._write()

    @property
    def nonce(self) -> str:
        return self._nonce

    def start(self) -> Heartbeat:
        global _current
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._write()
        _current = self
        self._thread = threading.Thread(target=self._run, name=f"heartbeat:{self.path.stem}", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._write()

    def _write(self) -> None:
        with self._lock:
            self._count += 1
            beat = Beat(
                self._nonce,
                self._count,
                self._status,
                self._message,
                os.getpid(),
                socket.gethostname(),
                self._progress,
                self._doing,
                self._echo,
            )
            write_json(self.path, asdict(beat))

    def finish(self, status: str, message: str = "") -> None:
        """Stop beating; the last record says ``status`` (done or failed, with ``message``)."""
        global _current
        if _current is self:
            _current = None
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._status, self._message = status, message
        self._write()

    def __enter__(self) -> Heartbeat:
        return self.start()

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: object) -> None:
        if exc is None:
            self.finish(DONE)
        else:
            self.finish(FAILED, f"{type(exc).__name__}: {exc}")


_current: Heartbeat | None = None
"""The heartbeat this process started last (one per process in a launch): what ``advance`` moves."""


def advance(doing: str | None = None, steps: int = 1) -> None:
    """``Heartbeat.advance`` on this process's heartbeat; nothing when it has none (staged mode, a
    trainer rank other than 0). The trainer's heartbeat is the CLI's, so its loop reports through this."""
    beat = _current
    if beat is not None:
        beat.advance(doing, steps)


def own_nonce() -> str:
    """The nonce of this process's heartbeat, or '' without one (what a watcher's ``launch`` is)."""
    beat = _current
    return beat.nonce if beat is not None else ""


def doing() -> str:
    """What this process's main loop said it does last (``advance``), or '' without a heartbeat."""
    beat = _current
    return beat._doing if beat is not None else ""


@contextmanager
def beating(path: Path, *, enabled: bool) -> Iterator[None]:
    """``with Heartbeat(path)`` when ``enabled``, else nothing (the CLI's trainer rank 0 in async mode)."""
    if not enabled:
        yield
        return
    with Heartbeat(path):
        yield


class Peer:
    """Watch another process's heartbeat file (see the module docstring)."""

    def __init__(
        self,
        path: Path,
        name: str,
        *,
        timeout_s: float,
        startup_s: float,
        progress_timeout_s: float | None = None,
        launch: str = "",
        echo: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        """``launch``: the watcher's own heartbeat nonce; a record present already that echoes it is
        this launch's, alive when read. ``echo``: called with the nonce of every record read (the
        watched side's ``Heartbeat.echo``, so that it can prove it read this launch's record)."""
        self.path, self.name, self.timeout_s, self.startup_s, self._clock = path, name, timeout_s, startup_s, clock
        self.progress_timeout_s = progress_timeout_s
        """None: a live process is never declared hung (only a silent one, dead)."""
        self._echo = echo
        self._seen = self._stale = self._read()  # what an earlier launch may have left: not a sign of life
        self._changed_at = self._progressed_at = clock()
        self.live: Beat | None = None
        """The latest record written since this watcher started (None: nothing yet)."""
        if launch and self._stale is not None and self._stale.echo == launch:
            self.live, self._stale = self._stale, None  # written during this launch, after reading its record

    def _read(self) -> Beat | None:
        beat = read_beat(self.path)
        if beat is not None and self._echo is not None:
            self._echo(beat.nonce)
        return beat

    def poll(self) -> Beat | None:
        beat = self._read()
        if beat is not None and beat != self._seen:
            now, live = self._clock(), self.live
            if live is None or (beat.nonce, beat.progress) != (live.nonce, live.progress):
                self._progressed_at = now
            self._seen, self._changed_at, self.live = beat, now, beat
        return self.live

    @property
    def done(self) -> bool:
        """The process ended normally (during this launch)."""
        return self.live is not None and self.live.status == DONE

    def check(self) -> None:
        """Raise RankFailedError when the process failed, or has been silent for longer than the timeout."""
        beat = self.poll()
        if beat is not None and beat.status == FAILED:
            raise RankFailedError(f"{self.name} failed: {beat.message} (pid {beat.pid} on {beat.host}; see its log)")
        if beat is not None and beat.status == DONE:
            return
        silent = self._clock() - self._changed_at
        if beat is not None and silent > self.timeout_s:
            raise RankFailedError(
                f"{self.name} has sent no heartbeat for {silent:.0f} s (async.worker_timeout_s={self.timeout_s:g}; "
                f"{self.path}): it died or hangs. See its log, then continue with `mugrpo train --resume RUN_DIR`"
            )
        stalled = self._clock() - self._progressed_at
        if beat is not None and self.progress_timeout_s is not None and stalled > self.progress_timeout_s:
            raise RankFailedError(
                f"{self.name} hangs: its heartbeat goes on, but its main loop has not moved for {stalled:.0f} s, "
                f"while {beat.doing or 'starting up'} (async.progress_timeout_s={self.progress_timeout_s:g}; "
                f"pid {beat.pid} on {beat.host}). See its log and its stacks (`py-spy dump --pid {beat.pid}` on "
                "that host), then continue with `mugrpo train --resume RUN_DIR`"
            )
        if beat is None and silent > self.startup_s:
            older = ""
            if (
                self._stale is not None and self._stale.status == FAILED
            ):  # maybe this launch's, written before we looked
                older = f"; the file holds an older record: failed: {self._stale.message}"
            raise RankFailedError(
                f"{self.name} has not sent a heartbeat in the {silent:.0f} s since this rank started watching "
                f"(async.startup_timeout_s={self.startup_s:g}; {self.path}){older}. It never started or died "
                "at once: see its log"
            )
