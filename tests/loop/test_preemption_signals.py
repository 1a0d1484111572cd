"""Preemption's signal handling (loop/preemption.py): what a signal records, the collective agreement,
the grace timer that ends a process that cannot checkpoint in time, and the run directory's marker."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from megatron_mugrpo.loop import preemption


@pytest.fixture
def handlers():
    yield
    preemption.uninstall()


def test_a_signal_is_recorded_and_every_rank_stops_on_any_ranks_signal(handlers: None) -> None:
    preemption.install(grace_s=60)
    assert preemption.requested() is None
    assert preemption.agreed(lambda flag: flag) is False
    assert preemption.agreed(lambda flag: True) is True  # another rank was signalled: this one stops too
    assert preemption.stopped(3, checkpointed=True).signum == signal.SIGTERM  # not signalled itself

    os.kill(os.getpid(), signal.SIGUSR1)
    os.kill(os.getpid(), signal.SIGTERM)  # a second notice (torchrun forwards Slurm's) changes nothing
    assert preemption.requested() == signal.SIGUSR1
    assert preemption.agreed(lambda flag: flag) is True
    raised = preemption.stopped(3, checkpointed=False)
    assert raised.signum == signal.SIGUSR1 and raised.global_update == 3 and not raised.checkpointed
    assert "SIGUSR1" in str(raised) and "last checkpoint" in str(raised)
    preemption.finished()  # the grace timer is cancelled: the process lives on


def test_the_marker_round_trips_and_is_cleared(tmp_path: Path) -> None:
    assert preemption.read_marker(tmp_path) is None
    preemption.write_marker(tmp_path, preemption.Preempted(signal.SIGTERM, 5, checkpointed=True))
    marker = preemption.read_marker(tmp_path)
    assert marker["signal"] == "SIGTERM" and marker["global_update"] == 5
    preemption.clear_marker(tmp_path)
    assert preemption.read_marker(tmp_path) is None


STUCK = """
import sys, time
from pathlib import Path
from megatron_mugrpo.loop import preemption
preemption.install(grace_s=0.5, run_dir=Path(sys.argv[1]))
print("ready", flush=True)
while True:  # a checkpoint that never finishes
    time.sleep(0.05)
"""


def test_a_process_that_cannot_checkpoint_in_time_exits_anyway_and_says_so(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(STUCK), str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == preemption.EXIT_PREEMPTED
    assert "no checkpoint within checkpoint.preempt_grace_s=0.5s" in stderr
    assert json.loads((tmp_path / preemption.MARKER).read_text())["global_update"] is None
