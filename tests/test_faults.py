"""megatron_mugrpo.faults: a crash point SIGKILLs exactly the process that reaches a listed point."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

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
