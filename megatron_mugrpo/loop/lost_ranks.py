"""Which rank was lost when a collective fails: heartbeats of every trainer rank, read after the failure.

When a node dies mid-run, the ranks left are inside a collective with it; gloo (and NCCL with async
error handling) then fails with "Connection reset by peer" or a store error that names an address,
not a rank, and every surviving rank prints a C++ stack. Each trainer rank of a multi-rank run
therefore beats (``asynchronous.liveness.Heartbeat``) into ``RUN_DIR/ranks/rank_NNNNN.json`` with its
host, pid and what its loop is doing (``liveness.advance``). On a failed collective a surviving rank
watches the others' files for ``LOST_AFTER_S``: a file that does not change, or whose process is gone
from this host, is a lost rank. The rank then stops with ``RankFailedError`` naming the lost ranks,
their hosts and last phase, its own phase, and how to continue; the CLI prints it as one ``error:``
line (exit 1) instead of a traceback.

In async mode trainer rank 0 already beats for the rollout workers (``AsyncPaths.trainer_heartbeat``);
that file stands for rank 0 here too, so one process never runs two heartbeats.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from megatron_mugrpo.asynchronous.liveness import (
    DONE,
    FAILED,
    HEARTBEAT_S,
    Beat,
    Heartbeat,
    RankFailedError,
    read_beat,
)

RANKS_DIR = "ranks"
LOST_AFTER_S = 5 * HEARTBEAT_S
"""A peer whose heartbeat file has not changed for this long after a failed collective is lost."""
PEER_LOSS_MARKERS = (
    "Connection reset by peer",
    "Connection closed by peer",
    "Connection refused",
    "Broken pipe",
    "Failed to recv",
    "Socket Timeout",
    "NCCL communicator was aborted",
)
"""Phrases of gloo, the c10d store and NCCL when the process at the other end of a collective is gone."""
TIMEOUT_MARKERS = (
    "Timed out waiting",
    "Application timeout caused pair closure",
    "Watchdog caught collective operation timeout",
    "timed out after",
)
"""Phrases of gloo and NCCL when a collective waited longer than the process group's timeout."""


def beat_path(run_dir: Path, rank: int) -> Path:
    return run_dir / RANKS_DIR / f"rank_{rank:05d}.json"


@contextmanager
def rank_heartbeat(run_dir: Path, rank: int, *, world_size: int, beats_elsewhere: bool) -> Iterator[None]:
    """Beat for trainer ``rank`` while the block runs (multi-rank runs only). ``beats_elsewhere``: this
    process already beats (async trainer rank 0), which ``lost`` then reads in place of this file."""
    if world_size <= 1 or beats_elsewhere:
        yield
        return
    with Heartbeat(beat_path(run_dir, rank)):
        yield


def is_peer_loss(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective failing because a peer process is gone (not a bug of this rank)."""
    return isinstance(exc, RuntimeError) and any(marker in str(exc) for marker in PEER_LOSS_MARKERS)


def is_timeout(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective that waited past ``parallel.timeout_s``."""
    return isinstance(exc, RuntimeError) and any(marker in str(exc) for marker in TIMEOUT_MARKERS)


def collective_error(
    paths: dict[int, Path], *, me: int, doing: str, exc: BaseException, timeout_s: float, watch_s: float = LOST_AFTER_S
) -> RankFailedError:
    """The one-line error of rank ``me`` whose collective failed (a lost peer, or a timeout) while ``doing``."""
    if is_peer_loss(exc) or lost(paths, watch_s=watch_s):
        return lost_rank_error(paths, me=me, doing=doing, exc=exc, watch_s=watch_s)
    peers = "; ".join(f"rank {rank}: {_last_doing(path)}" for rank, path in sorted(paths.items()))
    return RankFailedError(
        f"rank {me}: a collective timed out after parallel.timeout_s={timeout_s:g} s while {doing}; the other "
        f"ranks were last {peers}. One of them hangs or is far behind: see its log and stacks (`py-spy dump "
        "--pid PID`), then continue with `mugrpo train --resume RUN_DIR`"
    )


def _last_doing(path: Path) -> str:
    beat = read_beat(path)
    return "never beat" if beat is None else f"{beat.doing or 'starting up'} (pid {beat.pid} on {beat.host})"


def lost(paths: dict[int, Path], *, watch_s: float = LOST_AFTER_S, poll_s: float = 0.1) -> dict[int, Beat | None]:
    """The ranks among ``paths`` (rank → heartbeat file) that are gone: their file did not change for
    ``watch_s`` (or never existed), or it names a process of this host that no longer runs. Returns
    each lost rank's last beat (None: it never beat). Returns early once every rank has shown life."""
    host = socket.gethostname()
    first = {rank: read_beat(path) for rank, path in paths.items()}
    alive: set[int] = set()
    deadline = time.monotonic() + watch_s
    while True:
        for rank, path in paths.items():
            beat = read_beat(path)
            if beat is not None and beat.status in (FAILED, DONE):
                alive.add(rank)  # ended through Python: a survivor reporting the same failure, not the lost one
            elif beat is not None and beat != first[rank] and _running(beat, host):
                alive.add(rank)
        if len(alive) == len(paths) or time.monotonic() >= deadline:
            return {rank: first[rank] for rank in paths if rank not in alive}
        time.sleep(poll_s)


def lost_rank_error(
    paths: dict[int, Path], *, me: int, doing: str, exc: BaseException, watch_s: float = LOST_AFTER_S
) -> RankFailedError:
    """The one-line error of rank ``me`` whose collective failed with ``exc`` while ``doing``."""
    gone = lost(paths, watch_s=watch_s)
    if not gone:
        return RankFailedError(
            f"rank {me}: a collective failed while {doing} ({_first_line(exc)}), but every other rank still "
            "beats: see their logs for the first error, then continue with `mugrpo train --resume RUN_DIR`"
        )
    names = [_describe(rank, beat) for rank, beat in sorted(gone.items())]
    return RankFailedError(
        f"lost {', '.join(names)}: rank {me}'s collective failed while {doing} ({_first_line(exc)}). "
        "A node died or was killed: restart the job; `mugrpo train --resume RUN_DIR` (or the same "
        "command, under Slurm's requeue) continues from the last checkpoint"
    )


def _describe(rank: int, beat: Beat | None) -> str:
    if beat is None:
        return f"rank {rank} (no heartbeat ever)"
    return f"rank {rank} (pid {beat.pid} on {beat.host}, last seen {beat.doing or 'starting up'})"


def _running(beat: Beat, host: str) -> bool:
    """False when the beat's process is on this host and gone (a dead rank's last write may be fresh)."""
    if beat.host != host:
        return True
    try:
        os.kill(beat.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    line = text[0] if text else type(exc).__name__
    return line if len(line) <= 200 else line[:200] + "…"
