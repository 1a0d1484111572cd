"""benchmarks/replay.py (HDR on the math demo): what it keeps of a run, on hand-written metrics records: the
held-out accuracy keyed by fresh responses, the replay statistics with the re-check skips summed, the wall
clock. The run loop itself is ``benchmarks/common.py:run_methods`` (tests/test_benchmarks_common.py)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import replay as bench  # noqa: E402
from common import REPLAY_KEYS  # noqa: E402


def records() -> list[dict]:
    """Evaluations at updates 0 and 4, one stage's replay decision (a non-empty buffer) and two re-check counts."""
    return [
        {"step": 0, "eval/avg_pass@1": 0.25, "perf/t_total_s": 3.0},
        {"step": 3, "replay/buffer_groups": 4.0, "replay/recheck_skipped": 1.0}
        | {key: 2.0 for key in REPLAY_KEYS if key != "replay/acceptance_rate"}
        | {"replay/acceptance_rate": 0.5},
        {"step": 4, "replay/recheck_skipped": 2.0},
        {"step": 4, "eval/avg_pass@1": 0.5, "perf/t_total_s": 40.0},
    ]


def test_summarize_keys_accuracy_by_fresh_responses_and_sums_the_recheck_skips():
    for name in ("grpo", "mu_grpo"):  # both make 64 fresh responses per update: 32 × 8 / 4 and 512 × 8 / 64
        config, method = bench.METHODS[name]
        summary = bench.summarize(config, [*bench.COMMON, *method], records())
        assert summary["acc"] == {0: 0.25, 256: 0.5}
        assert summary["t_total_s"] == 40.0
        assert summary["replay"]["replay/acceptance_rate"] == 0.5 and summary["replay"]["replay/accepted"] == 2.0
        assert summary["replay"]["replay/recheck_skipped"] == 3.0
    no_replay = bench.summarize(bench.CONFIG, bench.COMMON, [records()[0]])["replay"]
    assert math.isnan(no_replay["replay/accepted"]) and no_replay["replay/recheck_skipped"] == 0.0
