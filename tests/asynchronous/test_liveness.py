"""Heartbeats: a live peer, a silent one, a failed one, and a stale file from an earlier launch."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

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
