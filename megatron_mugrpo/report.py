"""Plots that compare runs: accuracy vs wall clock, NAV / clip fractions, E[ρ | A<0], reward per stage,
and for async-mode runs the lag and idle ratios.

    python -m megatron_mugrpo.report runs/mu_grpo runs/grpo --out reports/mu_vs_grpo

reads each run's ``metrics.jsonl`` (written by ``metrics.MetricsLogger``) and writes PNGs plus a
``report.md`` summary into ``--out``. The legend of every plot is the run directory's name.

Logging convention the training loop follows (the plots rely on it):

- **Eval records**: one ``logger.log`` call per evaluation holding ``eval/<benchmark>/pass@1`` for every
  benchmark, ``eval/avg_pass@1`` (their mean) and ``perf/t_total_s`` (wall-clock seconds of the run so
  far, resumed time included) in the *same* record. ``perf/t_total_s`` is the x-axis of the accuracy
  plot; a record without it falls back to the logger's ``wall_s`` (noted in report.md).
- **Update records**: one record per optimizer update, ``step`` = updates done (1-based after the step),
  with ``train/nav_vetoed_frac``, ``train/clip_frac_low``, ``train/clip_frac_high`` and
  ``train/ratio_mean_neg_adv`` (E[ρ | A<0]; ``train/ratio_mean_pos_adv`` is drawn too when present).
- **Rollout records**: one record per stage after generation, ``step`` = updates done before the stage,
  with ``rollout/reward_mean`` and ``rollout/stage`` (0-based stage index; without it the records'
  order of appearance is used).

- **Async updates** (``mode: async``): each update record also holds ``rollout/lag_mean``,
  ``rollout/lag_max`` (updates between the behaviour policy and the trained one),
  ``rollout/dropped_groups_total``, ``perf/trainer_idle_ratio`` (time waiting for and assembling samples
  / the update's time) and, when shards arrived during it, ``perf/rollout_idle_ratio``. With them come
  ``async_lag.png`` and ``idle_ratio.png``; the latter also draws every run's cumulative trainer idle
  ratio, ``perf/t_rollout_s / (perf/t_rollout_s + perf/t_optimize_s)`` from the timers of its eval
  records, against wall-clock seconds, so staged and async runs compare on one axis.

A metric missing from every run is skipped with a note (the async plots, without one, when no run is
an async one); a directory without ``metrics.jsonl`` is an error.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: never needs a display, safe on headless nodes and in CI

import matplotlib.pyplot as plt  # the backend above must be chosen before pyplot loads

from megatron_mugrpo.metrics import read_metrics

EVAL_AVG = "eval/avg_pass@1"
EVAL_X = "perf/t_total_s"
UPDATE_FRACTIONS = ("train/nav_vetoed_frac", "train/clip_frac_low", "train/clip_frac_high")
RATIO_NEG = "train/ratio_mean_neg_adv"
RATIO_POS = "train/ratio_mean_pos_adv"
REWARD = "rollout/reward_mean"
STAGE = "rollout/stage"
LAG_KEYS = ("rollout/lag_mean", "rollout/lag_max", "rollout/dropped_groups_total")
IDLE_KEYS = ("perf/trainer_idle_ratio", "perf/rollout_idle_ratio")
T_ROLLOUT, T_OPTIMIZE = "perf/t_rollout_s", "perf/t_optimize_s"
FIGURE_DPI = 120
SMOOTH_MIN_POINTS = 200
"""Series at least this long (per-update metrics of a long run) also get a moving average."""
SMOOTH_WINDOW = 32
"""Moving-average window in points (= updates for per-update metrics)."""
SUBPLOT_SIZE = (5.0, 3.6)
"""Inches per subplot (width, height)."""


@dataclass
class Run:
    """One run's records and the label its lines carry in every legend."""

    label: str
    records: list[dict[str, Any]]


@dataclass
class Series:
    """x/y points of one metric of one run."""

    x: list[float] = field(default_factory=list)
    y: list[float] = field(default_factory=list)


def _labels(run_dirs: Sequence[Path]) -> list[str]:
    """Directory names; parent/name where two runs share a name."""
    names = [p.resolve().name for p in run_dirs]
    return [f"{p.resolve().parent.name}/{n}" if names.count(n) > 1 else n for p, n in zip(run_dirs, names)]


def load_runs(run_dirs: Sequence[str | Path]) -> list[Run]:
    """Read every run's metrics; a directory without metrics.jsonl raises FileNotFoundError."""
    paths = [Path(p) for p in run_dirs]
    if not paths:
        raise ValueError("write_report needs at least one run directory")
    return [Run(label, read_metrics(path)) for label, path in zip(_labels(paths), paths)]


def series(records: list[dict[str, Any]], y_key: str, x_key: str = "step") -> Series:
    """Points (record[x_key], record[y_key]) of the records holding both keys, in file order."""
    out = Series()
    for record in records:
        if y_key in record and x_key in record:
            out.x.append(float(record[x_key]))
            out.y.append(float(record[y_key]))
    return out


def eval_series(records: list[dict[str, Any]], key: str, notes: list[str], label: str) -> Series:
    """Accuracy vs perf/t_total_s; records without perf/t_total_s use wall_s (and add a note)."""
    out = Series()
    fallback = 0
    for record in records:
        if key not in record:
            continue
        fallback += EVAL_X not in record
        out.x.append(float(record.get(EVAL_X, record.get("wall_s", 0.0))))
        out.y.append(float(record[key]))
    if fallback:
        notes.append(f"{label}: {fallback} '{key}' record(s) lack '{EVAL_X}'; plotted against wall_s")
    return out


def stage_series(records: list[dict[str, Any]]) -> Series:
    """rollout/reward_mean per stage (rollout/stage, or the order of appearance without it).

    A stage logged twice (a run resumed while generating it) keeps its last record.
    """
    by_stage: dict[float, float] = {}
    for index, record in enumerate(r for r in records if REWARD in r):
        by_stage[float(record.get(STAGE, index))] = float(record[REWARD])
    stages = sorted(by_stage)
    return Series(x=stages, y=[by_stage[k] for k in stages])


def idle_series(records: list[dict[str, Any]]) -> Series:
    """Cumulative trainer idle ratio t_rollout / (t_rollout + t_optimize) against perf/t_total_s.

    Staged mode's trainer idles while its stage's data is generated; async mode's while it waits for
    and assembles samples; both accumulate that time in perf/t_rollout_s.
    """
    out = Series()
    for record in records:
        if T_ROLLOUT in record and T_OPTIMIZE in record and EVAL_X in record:
            busy = record[T_ROLLOUT] + record[T_OPTIMIZE]
            out.x.append(float(record[EVAL_X]))
            out.y.append(record[T_ROLLOUT] / busy if busy > 0 else 0.0)
    return out


def moving_average(values: list[float], window: int) -> list[float]:
    """Trailing mean over the last ``window`` values (fewer at the start); same length as ``values``."""
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def eval_keys(runs: list[Run]) -> list[str]:
    """eval/avg_pass@1 first, then the per-benchmark eval/<name>/pass@1 keys in sorted order."""
    names = {k for run in runs for record in run.records for k in record}
    per_benchmark = sorted(k for k in names if k.startswith("eval/") and k.endswith("/pass@1"))
    return ([EVAL_AVG] if EVAL_AVG in names else []) + per_benchmark


def _plot_panels(
    runs: list[Run],
    panels: list[tuple[str, list[Series], str]],
    out_path: Path,
    *,
    xlabel: str,
    marker: str = "",
) -> Path:
    """One subplot per (title, one series per run, ylabel) panel; runs overlaid with a shared legend."""
    fig, axes = plt.subplots(1, len(panels), figsize=(SUBPLOT_SIZE[0] * len(panels), SUBPLOT_SIZE[1]), squeeze=False)
    for ax, (title, per_run, ylabel) in zip(axes[0], panels):
        for run, points in zip(runs, per_run):
            if not points.x:
                continue
            if len(points.y) < SMOOTH_MIN_POINTS:
                ax.plot(points.x, points.y, marker=marker, label=run.label)
                continue
            # Thousands of per-update values: faint raw curve, labelled moving average on top.
            (raw,) = ax.plot(points.x, points.y, alpha=0.25, linewidth=0.8)
            ax.plot(
                points.x,
                moving_average(points.y, SMOOTH_WINDOW),
                color=raw.get_color(),
                label=f"{run.label} (mean of {SMOOTH_WINDOW})",
            )
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(out_path, dpi=FIGURE_DPI)
    plt.close(fig)
    return out_path


def _present(runs: list[Run], key: str) -> bool:
    return any(key in r for run in runs for r in run.records)


def _plot_eval(runs: list[Run], out_dir: Path, notes: list[str]) -> list[Path]:
    keys = eval_keys(runs)
    if not keys:
        notes.append(f"skipped eval_accuracy.png: no run logged '{EVAL_AVG}' or 'eval/<benchmark>/pass@1'")
        return []
    panels = [(key, [eval_series(run.records, key, notes, run.label) for run in runs], "pass@1") for key in keys]
    path = out_dir / "eval_accuracy.png"
    return [_plot_panels(runs, panels, path, xlabel="wall-clock seconds", marker="o")]


def _plot_per_update(runs: list[Run], out_dir: Path, notes: list[str]) -> list[Path]:
    written = []
    fractions = [key for key in UPDATE_FRACTIONS if _present(runs, key)]
    notes += [
        f"skipped '{key}' in nav_clip_fractions.png: no run logged it"
        for key in UPDATE_FRACTIONS
        if key not in fractions
    ]
    if fractions:
        panels = [(key, [series(run.records, key) for run in runs], "fraction of tokens") for key in fractions]
        path = out_dir / "nav_clip_fractions.png"
        written.append(_plot_panels(runs, panels, path, xlabel="optimizer update"))
    ratios = [key for key in (RATIO_NEG, RATIO_POS) if _present(runs, key)]
    if RATIO_NEG not in ratios:
        notes.append(f"skipped ratio_neg_adv.png: no run logged '{RATIO_NEG}'")
    else:
        panels = [(key, [series(run.records, key) for run in runs], "mean ratio ρ") for key in ratios]
        written.append(_plot_panels(runs, panels, out_dir / "ratio_neg_adv.png", xlabel="optimizer update"))
    return written


def _plot_reward(runs: list[Run], out_dir: Path, notes: list[str]) -> list[Path]:
    if not _present(runs, REWARD):
        notes.append(f"skipped reward_per_stage.png: no run logged '{REWARD}'")
        return []
    panels = [(REWARD, [stage_series(run.records) for run in runs], "mean reward")]
    return [_plot_panels(runs, panels, out_dir / "reward_per_stage.png", xlabel="stage", marker="o")]


def _plot_async(runs: list[Run], out_dir: Path) -> list[Path]:
    """Lag and idle ratios of async runs (nothing, and no note, when no run is an async one)."""
    written = []
    lags = [key for key in LAG_KEYS if _present(runs, key)]
    if lags:
        panels = [
            (key, [series(run.records, key) for run in runs], "updates" if "lag" in key else "groups") for key in lags
        ]
        written.append(_plot_panels(runs, panels, out_dir / "async_lag.png", xlabel="optimizer update"))
    idle = [key for key in IDLE_KEYS if _present(runs, key)]
    if idle:
        cumulative = ("trainer idle ratio (cumulative)", [idle_series(run.records) for run in runs], "fraction")
        per_update = [(key, [series(run.records, key, "wall_s") for run in runs], "fraction") for key in idle]
        path = out_dir / "idle_ratio.png"
        written.append(_plot_panels(runs, [cumulative, *per_update], path, xlabel="wall-clock seconds"))
    return written


def summary_table(runs: list[Run]) -> list[str]:
    """Markdown rows: updates, final / best eval/avg_pass@1 and perf/t_total_s per run."""
    rows = ["| run | updates | final avg pass@1 | best avg pass@1 | t_total_s |", "|---|---|---|---|---|"]
    for run in runs:
        acc = series(run.records, EVAL_AVG).y
        times = series(run.records, EVAL_X).y
        updates = max((int(r["step"]) for r in run.records), default=0)
        final, best = (f"{acc[-1]:.4f}", f"{max(acc):.4f}") if acc else ("-", "-")
        total = f"{times[-1]:.0f}" if times else "-"
        rows.append(f"| {run.label} | {updates} | {final} | {best} | {total} |")
    return rows


def write_report(run_dirs: Sequence[str | Path], out_dir: str | Path) -> list[Path]:
    """Write the comparison PNGs and report.md into ``out_dir``; return the written paths (report.md last)."""
    runs = load_runs(run_dirs)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    notes: list[str] = []
    written = [
        *_plot_eval(runs, out, notes),
        *_plot_per_update(runs, out, notes),
        *_plot_reward(runs, out, notes),
        *_plot_async(runs, out),
    ]
    lines = ["# Run comparison", "", *summary_table(runs), "", "## Plots", ""]
    lines += [f"![{p.stem}]({p.name})" for p in written]
    lines += ["", "## Notes", ""] + ([f"- {n}" for n in notes] or ["- none"])
    report = out / "report.md"
    report.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return [*written, report]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_mugrpo.report", description=__doc__.split("\n")[0])
    parser.add_argument("run_dirs", nargs="+", type=Path, help="run directories holding metrics.jsonl")
    parser.add_argument("--out", required=True, type=Path, help="directory for the PNGs and report.md")
    args = parser.parse_args(argv)
    try:
        paths = write_report(args.run_dirs, args.out)
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
