"""benchmarks/agentic_replay.py: its three methods are the search demo as standard GRPO at μ = 4 with equal
fresh trajectories and updates; its pure pieces, on hand-written metrics records: the accuracy curve and the
training wall clock (evaluation excluded), the environment's share, the mean curve over seeds, the time to
the target accuracy and the last line's format.

The end-to-end ``--quick`` run (inputs with a 20-step warm start, then three tiny trainings) takes about
40 s on the 2-core machine, so it runs only when asked:
``MUGRPO_AGENTIC_REPLAY_SMOKE=1 pytest tests/test_agentic_replay_benchmark.py``.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "agentic_replay.py"
sys.path.insert(0, str(SCRIPT.parent))

import agentic_replay as bench  # noqa: E402

from megatron_mugrpo.config import load_config  # noqa: E402

LAST_LINE = re.compile(
    r"^acc_grpo=\d\.\d{4} acc_naive=\d\.\d{4} acc_hdr=\d\.\d{4} "
    r"wall_grpo=(\d+|not_reached) wall_naive=(\d+|not_reached) wall_hdr=(\d+|not_reached) "
    r"env_share=\d\.\d{2} seeds=\d+$"
)


def records() -> list[dict]:
    """A 2-stage run as the staged loop logs it: evaluations at updates 0 and 4, a rollout record with the
    environment's counters and the phase timers per stage."""
    return [
        {"step": 0, "eval/search/pass@1": 0.10, "perf/t_eval_s": 3.0, "perf/t_total_s": 3.5},
        {"step": 0, "rollout/env_wall_s": 16.0, "rollout/env_seconds": 900.0},
        {"step": 0, "perf/t_rollout_s": 20.0, "perf/t_optimize_s": 0.0, "perf/t_total_s": 23.5},
        {"step": 1, "replay/buffer_groups": 0.0, "replay/accepted": 0.0, "replay/acceptance_rate": math.nan},
        {"step": 2, "rollout/env_wall_s": 8.0, "rollout/env_seconds": 400.0},
        {"step": 2, "perf/t_rollout_s": 34.0, "perf/t_optimize_s": 6.0, "perf/t_total_s": 43.5},
        {
            "step": 3,
            "replay/buffer_groups": 4.0,
            "replay/accepted": 2.0,
            "replay/scored": 3.0,
            "replay/acceptance_rate": 2 / 3,
            "replay/drift_mean": 4e-4,
            "replay/age_mean": 4.0,
        },
        {"step": 4, "eval/search/pass@1": 0.25, "perf/t_eval_s": 5.0, "perf/t_total_s": 50.0},
        {"step": 4, "perf/t_rollout_s": 34.0, "perf/t_optimize_s": 10.0, "perf/t_total_s": 50.0},
    ]


def test_methods_are_grpo_at_mu_4_with_equal_fresh_trajectories_and_updates(tmp_path):
    for name in ("train.jsonl", "test.jsonl"):
        (tmp_path / name).write_text(json.dumps({"question": "Who?", "answers": ["Ada"]}) + "\n")
    (tmp_path / "corpus.jsonl").write_text(json.dumps({"id": "0", "title": "Ada", "text": "Ada."}) + "\n")
    (tmp_path / "base_model").mkdir()
    for name, method in bench.METHODS.items():
        cfg = load_config(bench.CONFIG, [*bench.GRPO_SHAPE, *bench.input_overrides(tmp_path), *method])
        assert (cfg.algo.loss, cfg.stages.updates_per_stage, cfg.env.enabled) == ("grpo", 4, True)
        assert cfg.stages.num_stages * cfg.stages.train_groups * cfg.rollout.group_size == 6 * 32 * 8
        assert cfg.stages.num_stages * cfg.stages.updates_per_stage == 24
        assert cfg.replay.enabled == (name != "grpo")
        assert cfg.replay.policy == {"naive": "recent"}.get(name, "hdr")
        assert cfg.model.hf_dir == str(tmp_path / "base_model")


def test_curve_is_training_wall_clock_at_each_evaluation():
    # Wall clock less the evaluations' seconds: 3.5 - 3.0 before training, 50 - 5 after 4 updates.
    assert bench.curve(records()) == [(0, 0.5, 0.10), (4, 45.0, 0.25)]


def test_env_share_is_environment_wall_over_rollout_plus_optimizer_seconds():
    # (16 + 8) s of environment wall clock over 34 s of rollouts + 10 s of updates; env_seconds (the calls'
    # summed seconds, concurrent within a turn) is not the wall clock and is ignored.
    assert bench.env_share(records()) == pytest.approx(24.0 / 44.0)


def test_mean_curve_averages_seeds_at_the_updates_all_of_them_evaluated():
    seed0 = [(0, 0.0, 0.10), (8, 100.0, 0.20), (16, 200.0, 0.30)]
    seed1 = [(0, 0.0, 0.20), (8, 120.0, 0.30)]  # stopped early: update 16 is left out
    mean = bench.mean_curve([seed0, seed1])
    assert [u for u, _, _ in mean] == [0, 8]
    assert [w for _, w, _ in mean] == [0.0, 110.0]
    assert [a for _, _, a in mean] == pytest.approx([0.15, 0.25])


def test_time_to_target_is_the_first_evaluation_reaching_it():
    points = [(16, 200.0, 0.30), (0, 0.0, 0.10), (8, 110.0, 0.25), (24, 300.0, 0.20)]  # any order
    assert bench.time_to_target(points, 0.25) == 110.0  # reached exactly at update 8
    assert bench.time_to_target(points, 0.26) == 200.0
    assert bench.time_to_target(points, 0.05) == 0.0  # the base model already reaches it
    assert bench.time_to_target(points, 0.31) is None


def test_replay_summary_skips_stages_with_an_empty_buffer():
    summary = bench.replay_summary(records())
    assert summary["replay/accepted"] == 2.0
    assert summary["replay/acceptance_rate"] == pytest.approx(2 / 3)
    assert summary["replay/drift_mean"] == 4e-4
    assert math.isnan(bench.replay_summary([])["replay/drift_mean"])


def test_last_line_format():
    line = bench.last_line(
        {"grpo": 0.2, "naive": 0.19, "hdr": 0.215}, {"grpo": 301.4, "naive": None, "hdr": 250.6}, 0.6234, 3
    )
    assert line == (
        "acc_grpo=0.2000 acc_naive=0.1900 acc_hdr=0.2150 wall_grpo=301 wall_naive=not_reached wall_hdr=251 "
        "env_share=0.62 seeds=3"
    )
    assert LAST_LINE.match(line)


def test_bad_arguments_exit_2_with_the_fix(tmp_path):
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--methods", "hdr,naive", "--out", str(tmp_path / "out")],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 2
    assert "--methods must include grpo" in run.stderr


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("MUGRPO_AGENTIC_REPLAY_SMOKE"), reason="set MUGRPO_AGENTIC_REPLAY_SMOKE=1")
def test_quick_runs_end_to_end(tmp_path):
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--seeds", "1", "--out", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert LAST_LINE.match(run.stdout.strip().splitlines()[-1])
    assert (tmp_path / "out" / "results.json").is_file()
