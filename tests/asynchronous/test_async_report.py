"""`mugrpo report` on async runs: lag and idle-ratio plots, the cumulative idle ratio from the timers."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_mugrpo.metrics import MetricsLogger
from megatron_mugrpo.report import idle_series, write_report


def _async_run(run_dir: Path, updates: int = 8, token_lags: bool = True) -> None:
    """Records as the async loop logs them (see report.py's convention)."""
    with MetricsLogger(run_dir, tensorboard=False, console=False) as logger:
        for update in range(1, updates + 1):
            record = {
                "train/loss": 0.1,
                "rollout/lag_mean": 1.5,
                "rollout/lag_max": float(update % 4),
                "rollout/dropped_groups_total": float(update // 3),
                "perf/trainer_idle_ratio": 0.5 if update == 1 else 0.02,
            }
            if token_lags:
                record |= {"rollout/token_lag_mean": 1.2, "rollout/token_lag_max": float(update % 4)}
            if update % 2:
                record["perf/rollout_idle_ratio"] = 0.3
            logger.log(record, step=update)
            if update % 4 == 0:
                timers = {"perf/t_rollout_s": 1.0, "perf/t_optimize_s": 9.0, "perf/t_total_s": 12.0 * update}
                logger.log({"eval/avg_pass@1": 0.3, **timers}, step=update)


def _staged_run(run_dir: Path) -> None:
    with MetricsLogger(run_dir, tensorboard=False, console=False) as logger:
        logger.log({"perf/t_rollout_s": 3.0, "perf/t_optimize_s": 1.0, "perf/t_total_s": 5.0}, step=4)
        logger.log({"perf/t_rollout_s": 6.0, "perf/t_optimize_s": 2.0, "perf/t_total_s": 10.0}, step=8)


def test_cumulative_idle_ratio_comes_from_the_timers(tmp_path: Path) -> None:
    _staged_run(tmp_path / "staged")
    from megatron_mugrpo.metrics import read_metrics

    points = idle_series(read_metrics(tmp_path / "staged"))
    assert points.x == [5.0, 10.0] and points.y == pytest.approx([0.75, 0.75])


def test_async_and_staged_runs_get_the_lag_and_idle_plots(tmp_path: Path) -> None:
    _async_run(tmp_path / "async")
    _staged_run(tmp_path / "staged")
    written = write_report([tmp_path / "async", tmp_path / "staged"], tmp_path / "out")
    names = [p.name for p in written]
    assert {"async_lag.png", "idle_ratio.png"} <= set(names)
    assert all(p.stat().st_size > 1000 for p in written if p.suffix == ".png")
    staged_only = write_report([tmp_path / "staged"], tmp_path / "out_staged")
    assert not {"async_lag.png", "idle_ratio.png"} & {p.name for p in staged_only}


def test_the_lag_plot_has_a_panel_per_lag_metric_present(tmp_path: Path) -> None:
    """Group lag (mean, max), token lag (mean, max) and drops: five panels of equal width; a run
    logged before token lags existed gets the other three."""
    from PIL import Image

    widths = {}
    for token_lags in (True, False):
        _async_run(tmp_path / f"async_{token_lags}", token_lags=token_lags)
        write_report([tmp_path / f"async_{token_lags}"], tmp_path / f"out_{token_lags}")
        with Image.open(tmp_path / f"out_{token_lags}" / "async_lag.png") as image:
            widths[token_lags] = image.width
    assert widths[True] / widths[False] == pytest.approx(5 / 3, rel=0.02)
