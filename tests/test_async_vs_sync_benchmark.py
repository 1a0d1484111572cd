"""benchmarks/async_vs_sync.py's ``--seed``: it seeds both runs as ``mugrpo sweep`` seeds a run, and
refuses an override that would set one of those seeds differently (exit 2, naming the key)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "async_vs_sync.py"
sys.path.insert(0, str(SCRIPT.parent))

import async_vs_sync  # noqa: E402


def test_seed_sets_the_sweeps_seed_keys_after_the_other_overrides() -> None:
    out = async_vs_sync.seed_overrides(2, ["optim.lr=3e-4"])
    assert out == ["optim.lr=3e-4", "seed=2", "stages.seed=2", "data.seed=2"]


def test_without_seed_the_overrides_are_unchanged() -> None:
    assert async_vs_sync.seed_overrides(None, ["seed=5"]) == ["seed=5"]


def test_seed_and_a_seed_override_together_are_refused() -> None:
    with pytest.raises(ValueError, match=r"drop the override\(s\) of data.seed"):
        async_vs_sync.seed_overrides(1, ["data.seed=3"])


def test_the_cli_names_the_clash_and_exits_2_before_running_anything(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out), "--seed", "1", "stages.seed=4"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert proc.returncode == 2
    assert "--seed 1 sets seed, stages.seed, data.seed; drop the override(s) of stages.seed" in proc.stderr
    assert not out.exists()
