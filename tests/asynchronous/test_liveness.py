"""Heartbeats: a live peer, a silent one, a failed one, a hung one (beating, no progress), and a stale
file from an earlier launch."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from megatron_mugrpo.asynchronous import liveness
from megatron_mugrpo.asynchronous.liveness import DONE, FAILED, Heartbeat, Peer, RankFailedError, read_beat


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def wait_for_count(path: Path, count: int) -> None:
    deadline = time.monotonic() + 30
    while (beat := read_beat(path)) is None or beat.count < count:
        assert time.monotonic() < deadline, "the heartbeat thread does not beat"
        time.sleep(0.01)


def test_a_beating_peer_is_alive_and_a_silent_one_is_named(tmp_path: Path) -> None:
    path, clock = tmp_path / "worker_000.json", Clock()
    peer = Peer(path, "rollout worker 0 (rank 1)", timeout_s=10, startup_s=60, clock=clock)
    beat = Heartbeat(path, interval_s=0.01).start()
    wait_for_count(path, 3)
    clock.now = 9.0
    peer.check()  # beats seen: alive
    beat.finish(DONE)
    assert peer.poll().status == DONE and peer.done
    clock.now = 100.0
    peer.check()  # finished normally: silence is expected

    other = Peer(tmp_path / "worker_001.json", "rollout worker 1 (rank 2)", timeout_s=10, startup_s=60, clock=clock)
    Heartbeat(tmp_path / "worker_001.json", interval_s=1e6).start()  # one beat, then silence (as if killed)
    other.check()
    clock.now = 111.0
    with pytest.raises(RankFailedError, match=r"rollout worker 1 \(rank 2\) has sent no heartbeat for 11 s"):
        other.check()


def test_a_failure_travels_with_its_message(tmp_path: Path) -> None:
    path = tmp_path / "trainer.json"
    peer = Peer(path, "the trainer (rank 0)", timeout_s=60, startup_s=60)
    with pytest.raises(ValueError), Heartbeat(path, interval_s=0.01):
        raise ValueError("optimizer diverged")
    assert read_beat(path).status == FAILED
    with pytest.raises(RankFailedError, match="the trainer \\(rank 0\\) failed: ValueError: optimizer diverged"):
        peer.check()


def test_an_earlier_launchs_file_is_not_a_live_process(tmp_path: Path) -> None:
    path, clock = tmp_path / "trainer.json", Clock()
    old = Heartbeat(path)
    old.start()
    old.finish(DONE)  # the previous launch finished: its 'done' must not end this one
    peer = Peer(path, "the trainer (rank 0)", timeout_s=5, startup_s=30, clock=clock)
    assert not peer.done and peer.poll() is None
    clock.now = 29.0
    peer.check()  # not started yet: ranks get startup_s for their first beat
    clock.now = 31.0
    with pytest.raises(RankFailedError, match=r"has not sent a heartbeat in the 31 s since .*startup_timeout_s=30;"):
        peer.check()

    failed = tmp_path / "worker_000.json"
    with pytest.raises(RuntimeError), Heartbeat(failed):
        raise RuntimeError("engine out of memory")  # perhaps this launch's, written before the watcher looked
    watcher = Peer(failed, "rollout worker 0 (rank 1)", timeout_s=5, startup_s=1, clock=clock)
    clock.now = 40.0
    with pytest.raises(RankFailedError, match="older record: failed: RuntimeError: engine out of memory"):
        watcher.check()


def test_a_record_echoing_the_watchers_nonce_is_this_launchs_even_if_written_before_it_looked(
    tmp_path: Path,
) -> None:
    """The race CI hit: a worker's last record was written just before the trainer started watching,
    and the worker died before its next beat. Without the echo the trainer took it for an earlier
    launch's file and waited startup_s (900 s) instead of timeout_s."""
    trainer_path, worker_path, clock = tmp_path / "trainer.json", tmp_path / "worker_000.json", Clock()
    trainer = Heartbeat(trainer_path, interval_s=1e6).start()
    worker = Heartbeat(worker_path, interval_s=1e6).start()
    count = read_beat(worker_path).count
    seen = Peer(trainer_path, "the trainer (rank 0)", timeout_s=5, startup_s=30, echo=worker.echo, clock=clock)
    echoed = read_beat(worker_path)
    assert echoed.echo == trainer.nonce and echoed.count == count + 1, "a new nonce is written at once"
    seen.check()
    assert read_beat(worker_path).count == count + 1, "the same nonce again is not a new record"

    watcher = Peer(
        worker_path, "rollout worker 0 (rank 1)", timeout_s=5, startup_s=30, launch=trainer.nonce, clock=clock
    )
    assert watcher.poll() is not None, "echoes this launch's nonce: alive when read"
    clock.now = 6.0
    with pytest.raises(RankFailedError, match=r"rollout worker 0 \(rank 1\) has sent no heartbeat for 6 s"):
        watcher.check()

    other_launch = Peer(
        worker_path, "rollout worker 0 (rank 1)", timeout_s=5, startup_s=30, launch="0" * 32, clock=clock
    )
    assert other_launch.poll() is None, "echoes another launch's nonce: a stale file, as before"


def test_a_peer_that_beats_without_progress_hangs(tmp_path: Path) -> None:
    path, clock = tmp_path / "worker_000.json", Clock()
    peer = Peer(path, "rollout worker 0 (rank 1)", timeout_s=10, startup_s=60, progress_timeout_s=30, clock=clock)
    beat = Heartbeat(path, interval_s=0.01).start()
    try:
        beat.advance("generating batch 3")
        wait_for_count(path, 3)
        peer.check()
        assert peer.live.progress == 1 and peer.live.doing == "generating batch 3"
        for now in (20.0, 40.0):  # progress at 20 s: its stall counts from there
            clock.now = now
            beat.advance(steps=8)  # 8 responses finished
            wait_for_count(path, read_beat(path).count + 2)
            peer.check()
        clock.now = 69.0
        wait_for_count(path, read_beat(path).count + 2)  # the thread beats on: not silent, not dead
        peer.check()
        clock.now = 71.0
        wait_for_count(path, read_beat(path).count + 2)
        with pytest.raises(RankFailedError) as failure:
            peer.check()
        message = str(failure.value)
        assert "rollout worker 0 (rank 1) hangs" in message and "not moved for 31 s" in message
        assert "while generating batch 3 (async.progress_timeout_s=30;" in message and "\n" not in message

        patient = Peer(path, "rollout worker 0 (rank 1)", timeout_s=10, startup_s=60, clock=clock)  # no timeout
        wait_for_count(path, read_beat(path).count + 2)
        patient.check()
        clock.now = 1e6
        wait_for_count(path, read_beat(path).count + 2)
        patient.poll()
        patient.check()  # off: only silence counts
    finally:
        beat.finish(DONE)


def test_advance_reaches_the_heartbeat_this_process_started(tmp_path: Path) -> None:
    liveness.advance("nothing to move")  # no heartbeat yet: a no-op (staged mode, trainer ranks > 0)
    path = tmp_path / "trainer.json"
    with Heartbeat(path, interval_s=0.01):
        liveness.advance("making update 1")
        liveness.advance(steps=2)
        wait_for_count(path, read_beat(path).count + 2)
        assert (read_beat(path).progress, read_beat(path).doing) == (3, "making update 1")
    assert liveness._current is None
    old = {k: v for k, v in read_beat(path).__dict__.items() if k not in ("progress", "doing")}
    assert liveness.Beat(**old).progress == 0  # a record written before beats carried progress still reads


HUNG_WORKER = """
import threading, sys
from pathlib import Path
from megatron_mugrpo.asynchronous.liveness import Heartbeat, advance
with Heartbeat(Path(sys.argv[1]), interval_s=0.05):
    for batch in range(3):
        advance(f"generating batch {batch}", steps=8)
    print("blocked", flush=True)
    threading.Event().wait()  # the main thread never returns (an engine call that never answers)
"""


def test_a_worker_whose_main_thread_blocks_is_detected(tmp_path: Path) -> None:
    """A real process: its heartbeat thread keeps beating while its main thread waits forever."""
    path = tmp_path / "worker_001.json"
    peer = Peer(path, "rollout worker 1 (rank 2)", timeout_s=5, startup_s=30, progress_timeout_s=1.0)
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(HUNG_WORKER), str(path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "blocked"
        blocked = time.monotonic()
        deadline = blocked + 30
        while True:
            assert time.monotonic() < deadline, "the hang was not detected"
            try:
                peer.check()
            except RankFailedError as exc:
                detected, message = time.monotonic(), str(exc)
                break
            time.sleep(0.02)
        beats = read_beat(path).count
        wait_for_count(path, beats + 2)  # still beating: a hang, not a death
    finally:
        proc.kill()
        proc.wait()
    assert "rollout worker 1 (rank 2) hangs" in message and "while generating batch 2" in message
    assert f"pid {proc.pid}" in message
    latency = detected - blocked
    print(f"hang detected {latency:.2f} s after the main thread blocked (progress_timeout_s=1, beats every 0.05 s)")
    assert 1.0 <= latency < 10.0
