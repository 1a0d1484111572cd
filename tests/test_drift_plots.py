"""The drift diagnostics' plots (drift_plots): update index within a stage, one line per stage."""

from __future__ import annotations

import json
import math
from pathlib import Path

from megatron_mugrpo.drift_plots import DRIFT_PANELS, plot_drift, stage_curves
from megatron_mugrpo.report import write_report


def _records() -> list[dict]:
    """Two stages of three updates (steps 1-3 and 4-6), an eval record between them, one NaN."""
    out = []
    for step in range(1, 7):
        stage = (step - 1) // 3
        out.append(
            {
                "step": step,
                "train/stage": float(stage),
                "train/ratio_mean_neg_adv": 1.0 - 0.1 * step,
                "train/trigger_pos_frac": math.nan if step == 2 else 0.5,
                "train/kl_behaviour_k3": 0.01 * step,
            }
        )
        if step == 3:
            out.append({"step": 3, "eval/avg_pass@1": 0.5})
    return out


def test_index_restarts_at_each_stage_and_nan_is_left_out() -> None:
    curves = stage_curves(_records(), "train/ratio_mean_neg_adv")
    assert curves[0] == ([1, 2, 3], [0.9, 0.8, 0.7])
    assert curves[1][0] == [1, 2, 3] and curves[1][1][0] == 1.0 - 0.4
    assert stage_curves(_records(), "train/trigger_pos_frac")[0] == ([1, 3], [0.5, 0.5])
    assert stage_curves(_records(), "train/nav_vetoed_frac") == {}


def test_report_writes_one_drift_figure_per_run_and_names_what_is_missing(tmp_path: Path) -> None:
    run = tmp_path / "mu grpo"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _records()))
    paths = write_report([run], tmp_path / "report")
    drift = [p for p in paths if p.name.startswith("drift_")]
    assert [p.name for p in drift] == ["drift_mu_grpo.png"] and drift[0].stat().st_size > 0
    report = (tmp_path / "report" / "report.md").read_text()
    assert "![drift_mu_grpo](drift_mu_grpo.png)" in report
    missing = {key for key, _ in DRIFT_PANELS} - {
        "train/ratio_mean_neg_adv",
        "train/trigger_pos_frac",
        "train/kl_behaviour_k3",
    }
    assert all(f"no update logged '{key}'" in report for key in missing)


def test_a_run_without_stages_gets_no_drift_figure(tmp_path: Path) -> None:
    notes: list[str] = []
    async_like = [{"step": 1, "train/ratio_mean_neg_adv": 0.9}, {"step": 1, "eval/avg_pass@1": 0.1}]
    assert plot_drift([("async", async_like)], tmp_path, notes) == [] and notes == []
