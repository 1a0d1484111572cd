"""Naming a lost rank from the trainer ranks' heartbeats (loop/lost_ranks.py), with real heartbeat threads."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

from megatron_mugrpo.asynchronous.liveness import FAILED, Beat, Heartbeat
from megatron_mugrpo.durable import atomic_write_json
from megatron_mugrpo.loop.lost_ranks import beat_path, is_peer_loss, lost, lost_rank_error


def _write(path: Path, beat: Beat) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, asdict(beat))


def test_a_silent_or_missing_rank_is_lost_a_beating_or_failed_one_is_not(tmp_path: Path) -> None:
    paths = {r: beat_path(tmp_path, r) for r in (1, 2, 3, 4)}
    host = socket.gethostname()
    _write(paths[2], Beat("n2", 7, "running", "", 999_999, "other-host", 40, "making update 5"))  # silent
    _write(paths[3], Beat("n3", 3, FAILED, "RuntimeError: reset", os.getpid(), host, 4, ""))  # a survivor
    with Heartbeat(paths[1], interval_s=0.05):  # alive and beating
        gone = lost(paths, watch_s=1.0)
    assert set(gone) == {2, 4}
    assert gone[2].doing == "making update 5" and gone[4] is None


def test_a_rank_whose_process_is_gone_from_this_host_is_lost_at_once(tmp_path: Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)
    path = beat_path(tmp_path, 1)
    _write(path, Beat("n1", 1, "running", "", pid, socket.gethostname(), 0, "checkpointing update 4"))
    _write(path, Beat("n1", 2, "running", "", pid, socket.gethostname(), 0, "checkpointing update 4"))
    assert set(lost({1: path}, watch_s=0.3)) == {1}


def test_the_error_names_the_lost_rank_its_host_and_phase() -> None:
    exc = RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:39613: Connection reset by peer.")
    assert is_peer_loss(exc)
    assert not is_peer_loss(RuntimeError("shape mismatch")) and not is_peer_loss(ValueError("Broken pipe"))
    message = str(lost_rank_error({1: Path("/nonexistent/rank_00001.json")}, me=0, doing="making update 3", exc=exc,
                                  watch_s=0.2))  # fmt: skip
    assert message.startswith("lost rank 1 (no heartbeat ever): rank 0's collective failed while making update 3")
    assert "Connection reset by peer" in message and "--resume" in message


def _hung_peer(rank: int, world_size: int, tmp: str) -> None:
    """Rank 1 beats but never joins the all-reduce (a hang); rank 0's collective times out."""
    import time

    import torch
    import torch.distributed as dist

    from megatron_mugrpo.asynchronous.liveness import advance, doing
    from megatron_mugrpo.loop.lost_ranks import collective_error, is_timeout
    from megatron_mugrpo.training.parallel import initialize_parallel

    initialize_parallel(1, 1, 0, timeout_s=2.0)
    run_dir = Path(tmp)
    with Heartbeat(beat_path(run_dir, rank), interval_s=0.2):
        if rank == 1:
            advance("generating stage 3")
            time.sleep(8)  # alive, beating, never in the collective
            os._exit(0)  # the group is broken by the timeout: no teardown barrier can succeed
        advance("syncing weights for stage 3")
        try:
            dist.all_reduce(torch.ones(1))
        except RuntimeError as exc:
            assert is_timeout(exc), str(exc)[:300]
            message = str(collective_error({1: beat_path(run_dir, 1)}, me=0, doing=doing(), exc=exc, timeout_s=2.0))
            (run_dir / "message.txt").write_text(message)
            os._exit(0)
        raise AssertionError("the all-reduce did not time out")


def test_a_collective_timeout_names_the_phase_and_what_the_other_ranks_do(tmp_path: Path) -> None:
    from dist_utils import run_distributed

    run_distributed(_hung_peer, 2, str(tmp_path))
    message = (tmp_path / "message.txt").read_text()
    assert message.startswith("rank 0: a collective timed out after parallel.timeout_s=2 s while syncing weights")
    assert "rank 1: generating stage 3 (pid" in message and "--resume" in message
