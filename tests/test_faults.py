"""megatron_mugrpo.faults: a crash point SIGKILLs exactly the process that reaches a listed point."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import pytest

from megatron_mugrpo import faults
from megatron_mugrpo.faults import CRASH_ENV, crash_point


def _reach(point: str, listed: str) -> int:
    code = f"from megatron_mugrpo.faults import crash_point; crash_point({point!r}); print('survived')"
    env = {**os.environ, CRASH_ENV: listed}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, check=False).returncode


def test_a_listed_point_kills_the_process() -> None:
    assert _reach("update:3", "rollout:0,update:3") == -signal.SIGKILL


def test_other_points_pass() -> None:
    assert _reach("update:30", "rollout:0,update:3") == 0
    assert _reach("worker:0:shard:1", "") == 0


def test_no_variable_is_a_no_op(monkeypatch) -> None:
    monkeypatch.delenv(CRASH_ENV, raising=False)
    crash_point("update:1")  # still alive


def test_engine_faults_hit_exactly_the_listed_batches(monkeypatch) -> None:
    """raise:B raises in batch B only (0-based over the process); other batches pass; hang:B blocks
    until released (here in a thread, released by the test)."""
    faults.reset_engine_faults()
    monkeypatch.setenv(faults.ENGINE_FAULT_ENV, "raise:1,hang:2")
    faults.engine_fault()  # batch 0 passes
    with pytest.raises(faults.InjectedEngineError, match="batch 1"):
        faults.engine_fault()
    hung = threading.Thread(target=faults.engine_fault, daemon=True)  # batch 2
    hung.start()
    hung.join(0.2)
    assert hung.is_alive()  # blocked, as a hung engine
    faults.release_hangs()
    hung.join(30)
    assert not hung.is_alive()
    faults.engine_fault()  # batch 3 passes
    faults.reset_engine_faults()


def test_a_malformed_engine_fault_is_refused(monkeypatch) -> None:
    faults.reset_engine_faults()
    monkeypatch.setenv(faults.ENGINE_FAULT_ENV, "explode:1")
    with pytest.raises(ValueError, match="MUGRPO_ENGINE_FAULT item 'explode:1' is not raise:B or hang:B"):
        faults.engine_fault()
    faults.reset_engine_faults()
