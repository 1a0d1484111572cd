"""A finished demo run holds its plan (plan.json, written before any model was built) and what rank 0
allocated (memory.json), and its report sets one against the other: on CPU the weights, gradients and
optimizer state equal the plan's to the byte; the time is not planned (no FLOPs figures for a CPU).

Reuses the session's ``uninterrupted`` run (conftest.py): no run of its own.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

STATIC = ("weights (rank 0)", "gradients (rank 0)", "optimizer state (rank 0)")


def test_the_run_plan_matches_what_rank_0_allocated(uninterrupted: tuple[Path, subprocess.CompletedProcess]) -> None:
    run_dir, _ = uninterrupted
    plan = json.loads((run_dir / "plan.json").read_text())
    measured = json.loads((run_dir / "memory.json").read_text())
    assert "error" not in plan and plan["written_by"] == "train"
    assert plan["gpu"] == {"name": "cpu", "count": 1, "memory_bytes": plan["gpu"]["memory_bytes"]}
    assert plan["time"] is None and plan["fits"]
    assert measured["updates"] > 0 and measured["peak"]["kind"] == "cpu_peak_rss"
    for key in ("weights", "grads", "optimizer", "params"):
        assert measured[key] == plan["rank0"][key] > 0, key
    # The process holds the trainer's tensors and more (Python, torch, the engine, the data).
    assert measured["peak"]["bytes"] > plan["rank0"]["total"]
    report = json.loads((run_dir / "report" / "report.json").read_text())
    rows = {row["name"]: row for row in report["runs"][run_dir.name]["plan_vs_actual"]["rows"]}
    assert all(rows[name]["ratio"] == 1.0 for name in STATIC)
    assert rows["one update"]["plan"] is None and rows["one update"]["actual"] > 0
    text = (run_dir / "report" / "report.md").read_text()
    assert "## Plan against actual" in text and "| weights (rank 0) |" in text
