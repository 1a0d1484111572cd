"""Plots and tables that compare runs: accuracy vs wall clock, NAV / clip fractions, E[ρ | A<0], reward per
stage, replay, and for async-mode runs the lag and idle ratios.

    python -m megatron_mugrpo.report runs/mu_grpo runs/grpo --out reports/mu_vs_grpo

reads each run's ``metrics.jsonl`` (written by ``metrics.MetricsLogger``) and writes PNGs plus a
``report.md`` summary and ``report.json`` into ``--out``. The legend of every plot is the run directory's
name. Both set each run's plan (``RUN_DIR/plan.json``, written when it started) against what it measured
(``RUN_DIR/memory.json`` and the metrics): ``plan.actual`` makes the rows, docs/plan.md lists them.
Metric names come from ``metric_names``, beside their producers.

``write_sweep_report`` does the same for groups of runs that differ only by seed (``mugrpo sweep``):
one line per group at the mean over seeds with a ±1 std band, and ``summary.csv`` / ``summary.md``
with mean ± std (and n) of each run's figures (``run_figures``: final, best and gain of accuracy,
T_rollout, T_total, veto and clip rates).

Logging convention the training loop follows (the plots rely on it):

- **Eval records**: one ``logger.log`` call per evaluation holding ``eval/<benchmark>/pass@1`` for every
  benchmark, ``eval/avg_pass@1`` (their mean) and ``perf/t_total_s`` (wall-clock seconds of the run so
  far, resumed time included) in the *same* record. ``perf/t_total_s`` is the x-axis of the accuracy
  plot; a record without it falls back to the logger's ``wall_s`` (noted in report.md).
- **Update records**: one record per optimizer update, ``step`` = updates done (1-based after the step),
  with ``train/nav_vetoed_frac``, ``train/clip_frac_low``, ``train/clip_frac_high``,
  ``train/masked_frac`` (tokens any loss's mask removed: NAV, M2PO, OPSM, IcePop) and
  ``train/ratio_mean_neg_adv`` (E[ρ | A<0]; ``train/ratio_mean_pos_adv`` is drawn too when present).
- **Replay records** (runs with ``replay.enabled``): one per stage, ``step`` = the stage's first update,
  with ``replay/headroom_mean`` (accepted groups; ``replay/headroom_mean_rejected`` for the rejected
  ones), ``replay/drift_mean`` (groups scored) and ``replay/age_mean`` (updates since generation).
- **Rollout records**: one record per stage after generation, ``step`` = updates done before the stage,
  with ``rollout/reward_mean`` and ``rollout/stage`` (0-based stage index; without it the records'
  order of appearance is used).
- **Async updates** (``mode: async``): each update record also holds ``rollout/lag_mean``,
  ``rollout/lag_max`` (updates between the behaviour policy and the trained one; a group's is its
  oldest token's), ``rollout/token_lag_mean`` / ``_max`` (the same per response token, which differ
  from the group's with partial rollouts),
  ``rollout/dropped_groups_total``, ``perf/trainer_idle_ratio`` (time waiting for and assembling samples
  / the update's time) and, when shards arrived during it, ``perf/rollout_idle_ratio``. With them come
  ``async_lag.png`` and ``idle_ratio.png``; the latter also draws every run's cumulative trainer idle
  ratio, ``perf/t_rollout_s / (perf/t_rollout_s + perf/t_optimize_s)`` from the timers of its eval
  records, against wall-clock seconds, so staged and async runs compare on one axis.
- **Mixture-of-experts updates**: ``train/moe_load_min`` / ``_max`` (the smallest and largest share of
  routed slots any expert got), ``train/routing_agreement`` (with routing replay) and
  ``train/moe_aux_loss`` give ``moe.png``; the same bounds per layer (``train/moe_load_{min,max}_layer_NN``)
  give ``moe_load_layers.png``.

A metric missing from every run is skipped with a note (the async plots, without one, when no run is
an async one); a directory without ``metrics.jsonl`` is an error.

Sweep bands are aligned by update: at every update (or evaluation) that all of a group's seeds
logged, the line is the mean over seeds and the band ±1 sample standard deviation (none for a
single seed). Accuracy vs wall clock puts each evaluation at the seeds' mean ``perf/t_total_s``.
"""

from __future__ import annotations

import argparse
import csv
import io
import math
import re
import statistics
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: never needs a display, safe on headless nodes and in CI

import matplotlib.pyplot as plt  # the backend above must be chosen before pyplot loads

from megatron_mugrpo import durable
from megatron_mugrpo.drift_plots import plot_drift
from megatron_mugrpo.metric_names import (
    CLIP_HIGH,
    CLIP_LOW,
    DROPPED_GROUPS_TOTAL,
    EVAL_AVG,
    EVAL_PREFIX,
    LAG_MAX,
    LAG_MEAN,
    MASKED_FRAC,
    MOE_AUX_LOSS,
    MOE_LAYER_LOAD_PATTERN,
    MOE_LOAD_MAX,
    MOE_LOAD_MIN,
    PASS_AT_1_SUFFIX,
    RATIO_NEG,
    RATIO_POS,
    REPLAY_AGE,
    REPLAY_DRIFT,
    REPLAY_HEADROOM,
    REPLAY_HEADROOM_REJECTED,
    RESPONSE_TOKENS,
    REWARD,
    ROLLOUT_IDLE_RATIO,
    ROUTING_AGREEMENT,
    STAGE,
    T_OPTIMIZE,
    T_ROLLOUT,
    T_TOTAL,
    TOKEN_LAG_MAX,
    TOKEN_LAG_MEAN,
    TRAINER_IDLE_RATIO,
    VETO_FRAC,
)
from megatron_mugrpo.metrics import read_metrics
from megatron_mugrpo.plan.actual import PLAN_FILE, Row, compare, read_run_files

EVAL_X = T_TOTAL
UPDATE_FRACTIONS = (VETO_FRAC, CLIP_LOW, CLIP_HIGH, MASKED_FRAC)
REPLAY_PANELS = (
    (REPLAY_HEADROOM, REPLAY_HEADROOM_REJECTED),
    (REPLAY_DRIFT,),
    (REPLAY_AGE,),
)
"""Headroom-Drift Replay panels, one per tuple (the first key titles it; the others share its axes)."""
LAG_KEYS = (LAG_MEAN, LAG_MAX, TOKEN_LAG_MEAN, TOKEN_LAG_MAX, DROPPED_GROUPS_TOTAL)
IDLE_KEYS = (TRAINER_IDLE_RATIO, ROLLOUT_IDLE_RATIO)
MOE_PANELS = (MOE_LOAD_MIN, MOE_LOAD_MAX, ROUTING_AGREEMENT, MOE_AUX_LOSS)
"""Mixture-of-experts panels: the model's expert-load bounds, routing agreement with the engine, aux loss."""
LAYER_LOAD = re.compile(MOE_LAYER_LOAD_PATTERN)
"""Per-layer expert-load bounds (``metric_names.moe_layer_load_key``, which ``training.moe`` writes)."""
LAYER_LEGEND_MAX = 8
"""Up to this many layers get a legend entry each; more are told apart by colour (early: dark)."""
FIGURE_DPI = 120
SMOOTH_MIN_POINTS = 200
"""Series at least this long (per-update metrics of a long run) also get a moving average."""
SMOOTH_WINDOW = 32
"""Moving-average window in points (= updates for per-update metrics)."""
SUBPLOT_SIZE = (5.0, 3.6)
"""Inches per subplot (width, height)."""
TOKENS = RESPONSE_TOKENS
BAND_ALPHA = 0.2
"""Opacity of the ±1 std band around a group's mean line."""
LINE_STYLES = ("-", "--", ":", "-.")
"""A sweep's groups past the 10 default colours repeat the colours in the next style (``group_style``)."""
RUN_FIGURES = {
    "final_acc": "final eval/avg_pass@1 (last evaluation)",
    "best_acc": "best eval/avg_pass@1 over all evaluations (the one before training included)",
    "acc_gain": "final minus first eval/avg_pass@1 (the first is taken before any update)",
    "t_rollout_s": "perf/t_rollout_s at the end of the run (seconds generating rollouts)",
    "t_total_s": "perf/t_total_s at the end of the run (wall-clock seconds, resumes included)",
    "veto_rate": "vetoed / response tokens over all updates (train/nav_vetoed_frac, token-weighted)",
    "clip_low": "fraction of response tokens at the lower ratio clip over all updates (token-weighted)",
    "clip_high": "fraction of response tokens at the upper ratio clip over all updates (token-weighted)",
    "masked_rate": "response tokens the loss's mask removed over all updates (train/masked_frac, token-weighted)",
}
"""The figures ``run_figures`` reads from one run's metrics (NaN where the run did not log them)."""


@dataclass
class Run:
    """One run's records and the label its lines carry in every legend."""

    label: str
    records: list[dict[str, Any]]
    path: Path | None = None
    """The run directory (for its plan.json and memory.json); None for records not read from one."""


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
    """Read every run's training metrics; a directory without metrics.jsonl raises FileNotFoundError.

    Records of standalone commands (``"source"``, e.g. a later ``mugrpo eval`` of an old checkpoint)
    are left out: the curves follow the training run in time.
    """
    paths = [Path(p) for p in run_dirs]
    if not paths:
        raise ValueError("write_report needs at least one run directory")
    return [
        Run(label, [r for r in read_metrics(path) if "source" not in r], path)
        for label, path in zip(_labels(paths), paths)
    ]


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
    per_benchmark = sorted(k for k in names if k.startswith(EVAL_PREFIX) and k.endswith(PASS_AT_1_SUFFIX))
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


def _plot_replay(runs: list[Run], out_dir: Path) -> list[Path]:
    """replay.png: headroom (accepted, and rejected dashed), drift and age of the replayed groups per stage."""
    panels = [keys for keys in REPLAY_PANELS if _present(runs, keys[0])]
    if not panels:  # replay is optional: runs without it get no plot and no note
        return []
    fig, axes = plt.subplots(1, len(panels), figsize=(SUBPLOT_SIZE[0] * len(panels), SUBPLOT_SIZE[1]), squeeze=False)
    for ax, keys in zip(axes[0], panels):
        for run in runs:
            color = None
            for key, style in zip(keys, ("-", "--")):
                points = series(run.records, key)
                if points.x:
                    suffix = "" if key == keys[0] else " (rejected)"
                    (line,) = ax.plot(points.x, points.y, style, marker=".", color=color, label=run.label + suffix)
                    color = line.get_color()
        ax.set_title(keys[0])
        ax.set_xlabel("optimizer update")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.tight_layout()
    path = out_dir / "replay.png"
    fig.savefig(path, dpi=FIGURE_DPI)
    plt.close(fig)
    return [path]


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


def _plot_moe(runs: list[Run], out_dir: Path) -> list[Path]:
    """``moe.png`` (expert-load bounds, routing agreement, aux loss per update) and ``moe_load_layers.png``
    (every MoE layer's smallest and largest expert share, one panel per run); nothing for dense runs."""
    keys = [key for key in MOE_PANELS if _present(runs, key)]
    if not keys:
        return []
    panels = [
        (key, [series(run.records, key) for run in runs], "loss" if "loss" in key else "fraction") for key in keys
    ]
    written = [_plot_panels(runs, panels, out_dir / "moe.png", xlabel="optimizer update")]
    layered = [(run, _layer_loads(run.records)) for run in runs]
    layered = [(run, loads) for run, loads in layered if loads]
    if layered:
        written.append(_plot_layer_loads(layered, out_dir / "moe_load_layers.png"))
    return written


def _layer_loads(records: list[dict[str, Any]]) -> dict[int, dict[str, Series]]:
    """{layer: {"min": Series, "max": Series}} of the per-layer expert-load bounds in ``records``."""
    out: dict[int, dict[str, Series]] = {}
    for record in records:
        for key, value in record.items():
            if (match := LAYER_LOAD.match(key)) and "step" in record:
                bound, layer = match.group(1), int(match.group(2))
                points = out.setdefault(layer, {"min": Series(), "max": Series()})[bound]
                points.x.append(float(record["step"]))
                points.y.append(float(value))
    return out


def _plot_layer_loads(layered: list[tuple[Run, dict[int, dict[str, Series]]]], out_path: Path) -> Path:
    """One panel per run: each layer's largest (solid) and smallest (dashed) expert share per update."""
    fig, axes = plt.subplots(1, len(layered), figsize=(SUBPLOT_SIZE[0] * len(layered), SUBPLOT_SIZE[1]), squeeze=False)
    for ax, (run, loads) in zip(axes[0], layered):
        colours = plt.get_cmap("viridis")
        for i, layer in enumerate(sorted(loads)):
            colour = colours(i / max(1, len(loads) - 1))
            label = f"layer {layer}" if len(loads) <= LAYER_LEGEND_MAX else None
            ax.plot(loads[layer]["max"].x, loads[layer]["max"].y, color=colour, label=label, linewidth=0.9)
            ax.plot(loads[layer]["min"].x, loads[layer]["min"].y, color=colour, linestyle="--", linewidth=0.9)
        ax.set_title(f"{run.label}: expert share per MoE layer (max solid, min dashed)", fontsize="small")
        ax.set_xlabel("optimizer update")
        ax.set_ylabel("fraction of routed slots")
        ax.grid(alpha=0.3)
        if len(loads) <= LAYER_LEGEND_MAX:
            ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(out_path, dpi=FIGURE_DPI)
    plt.close(fig)
    return out_path


def summary_table(runs: list[Run]) -> list[str]:
    """Markdown rows: updates, final / best eval/avg_pass@1 and perf/t_total_s per run."""
    rows = ["| run | updates | final avg pass@1 | best avg pass@1 | t_total_s |", "|---|---|---|---|---|"]
    for run in runs:
        figures = run_figures(run.records)
        updates = max((int(r["step"]) for r in run.records), default=0)
        final, best, total = (
            _fmt(figures[k], spec) for k, spec in (("final_acc", ".4f"), ("best_acc", ".4f"), ("t_total_s", ".0f"))
        )
        rows.append(f"| {run.label} | {updates} | {final} | {best} | {total} |")
    return rows


def run_figures(records: list[dict[str, Any]]) -> dict[str, float]:
    """One run's summary figures (keys and meaning: RUN_FIGURES); NaN for what the run did not log."""
    acc = series(records, EVAL_AVG).y
    return {
        "final_acc": acc[-1] if acc else math.nan,
        "best_acc": max(acc) if acc else math.nan,
        "acc_gain": acc[-1] - acc[0] if acc else math.nan,
        "t_rollout_s": last_value(records, T_ROLLOUT),
        "t_total_s": last_value(records, EVAL_X),
        "veto_rate": token_weighted_rate(records, VETO_FRAC),
        "clip_low": token_weighted_rate(records, CLIP_LOW),
        "clip_high": token_weighted_rate(records, CLIP_HIGH),
        "masked_rate": token_weighted_rate(records, MASKED_FRAC),
    }


def last_value(records: list[dict[str, Any]], key: str) -> float:
    """The value of ``key`` in the last record holding it (NaN if none does)."""
    values = series(records, key).y
    return values[-1] if values else math.nan


def token_weighted_rate(records: list[dict[str, Any]], key: str) -> float:
    """Σ_u key_u · tokens_u / Σ_u tokens_u over update records: the run's fraction of tokens, not a mean of
    per-update fractions (updates differ in length). Unweighted mean when no update logged its tokens."""
    pairs = [(float(r[key]), float(r.get(TOKENS, 1.0))) for r in records if key in r and math.isfinite(r[key])]
    if not pairs:
        return math.nan
    weight = sum(w for _, w in pairs)
    return sum(v * w for v, w in pairs) / weight if weight > 0 else math.nan


def _fmt(value: float, spec: str) -> str:
    return "-" if math.isnan(value) else format(value, spec)


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
        *_plot_replay(runs, out),
        *_plot_async(runs, out),
        *_plot_moe(runs, out),
        *plot_drift([(run.label, run.records) for run in runs], out, notes),  # per update in a stage
    ]
    lines = ["# Run comparison", "", *summary_table(runs), "", "## Plots", ""]
    lines += [f"![{p.stem}]({p.name})" for p in written]
    lines += ["", "## Plan against actual", "", *plan_tables(runs)]
    lines += ["", "## Notes", ""] + ([f"- {n}" for n in notes] or ["- none"])
    summary = out / "report.json"
    durable.atomic_write_json(summary, report_json(runs), fsync=False)  # regenerated from the runs, never resumed
    report = out / "report.md"
    report.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return [*written, summary, report]


def _plan_of(run: Run) -> tuple[dict[str, Any] | None, list[Row]]:
    """The run's plan.json and its rows against what the run measured (none without a run directory)."""
    if run.path is None:
        return None, []
    plan, measured = read_run_files(run.path)
    return plan, compare(plan, measured, run.records)


def _cell(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "bytes":
        for name, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
            if abs(value) >= size:
                return f"{value / size:.2f} {name}"
        return f"{value:.0f} B"
    if unit == "s":
        return f"{value / 3600:.2f} h" if abs(value) >= 3600 else f"{value:.2f} s"
    return f"{value:.3f}"


def plan_tables(runs: list[Run]) -> list[str]:
    """Markdown: per run, its plan (``plan.json``, written when it started) against what it measured."""
    lines: list[str] = []
    for run in runs:
        plan, rows = _plan_of(run)
        lines.append(f"### {run.label}")
        if plan is None:
            lines += ["", f"no {PLAN_FILE}: the run started before `mugrpo train` wrote its plan", ""]
            continue
        if "error" in plan:
            lines += ["", f"{PLAN_FILE}: the run could not be planned: {plan['error']}", ""]
            continue
        gpu = plan.get("gpu", {})
        lines += ["", f"planned for {gpu.get('count')} × {gpu.get('name')} ({plan.get('device_source', '')})", ""]
        lines += ["| quantity | plan | actual | actual / plan | note |", "|---|---|---|---|---|"]
        for row in rows:
            ratio = "-" if row.ratio is None else f"{row.ratio:.2f}"
            lines.append(
                f"| {row.name} | {_cell(row.plan, row.unit)} | {_cell(row.actual, row.unit)} | {ratio} | {row.note} |"
            )
        lines.append("")
    return lines


def report_json(runs: list[Run]) -> dict[str, Any]:
    """report.json: per run its figures (RUN_FIGURES) and its plan against actual (units: bytes, seconds)."""
    out: dict[str, Any] = {}
    for run in runs:
        plan, rows = _plan_of(run)
        against = {
            "plan": PLAN_FILE if plan is not None else None,
            "error": (plan or {}).get("error"),
            "rows": [{**asdict(row), "ratio": row.ratio} for row in rows],
        }
        out[run.label] = {"figures": run_figures(run.records), "plan_vs_actual": against}
    return {"runs": out}


# ---------------------------------------------------------------------------------------------------
# Groups of seeds (mugrpo sweep): mean ± std tables and band plots
# ---------------------------------------------------------------------------------------------------


@dataclass
class SeedGroup:
    """The runs of one sweep variant, one per seed (``Run.label`` is ``seed_<s>``)."""

    label: str
    runs: list[Run]


@dataclass
class MeanStd:
    """Mean and sample standard deviation (n − 1 in the denominator; NaN for n < 2) of n values."""

    mean: float
    std: float
    n: int


@dataclass
class Band:
    """A group's mean ± std over seeds at the x values every seed has (``n`` seeds)."""

    x: list[float] = field(default_factory=list)
    mean: list[float] = field(default_factory=list)
    std: list[float] = field(default_factory=list)
    n: int = 0


def mean_std(values: Sequence[float]) -> MeanStd:
    """Mean ± sample std of the finite values (NaNs, e.g. the veto rate of a loss without a veto, are left out)."""
    finite = [v for v in values if math.isfinite(v)]
    mean = statistics.fmean(finite) if finite else math.nan
    std = statistics.stdev(finite) if len(finite) >= 2 else math.nan
    return MeanStd(mean=mean, std=std, n=len(finite))


def seed_band(per_seed: Sequence[dict[float, float]]) -> Band:
    """Mean ± std over seeds (x → y maps) at the x values all of them have; seeds without points are left out."""
    present = [points for points in per_seed if points]
    if not present:
        return Band()
    xs = sorted(set.intersection(*(set(points) for points in present)))
    stats = [mean_std([points[x] for points in present]) for x in xs]
    return Band(x=xs, mean=[s.mean for s in stats], std=[s.std for s in stats], n=len(present))


def _update_points(records: list[dict[str, Any]], key: str) -> dict[float, float]:
    """update → value of a per-update metric, smoothed like the single-run plots when the run is long."""
    points = series(records, key)
    values = moving_average(points.y, SMOOTH_WINDOW) if len(points.y) >= SMOOTH_MIN_POINTS else points.y
    return dict(zip(points.x, values))


def _eval_points(records: list[dict[str, Any]]) -> tuple[dict[float, float], dict[float, float]]:
    """update → eval/avg_pass@1 and update → perf/t_total_s (wall_s without it) of the evaluation records."""
    acc: dict[float, float] = {}
    seconds: dict[float, float] = {}
    for record in records:
        if EVAL_AVG in record:
            acc[float(record["step"])] = float(record[EVAL_AVG])
            seconds[float(record["step"])] = float(record.get(EVAL_X, record.get("wall_s", 0.0)))
    return acc, seconds


def accuracy_bands(group: SeedGroup) -> tuple[Band, Band]:
    """(accuracy vs updates, accuracy vs wall clock): the second puts each evaluation at the seeds' mean time."""
    points = [_eval_points(run.records) for run in group.runs]
    by_update = seed_band([acc for acc, _ in points])
    times = seed_band([seconds for _, seconds in points])
    at_time = dict(zip(times.x, times.mean))
    by_time = Band(x=[at_time[x] for x in by_update.x], mean=by_update.mean, std=by_update.std, n=by_update.n)
    return by_update, by_time


def _plot_bands(
    groups: list[SeedGroup], panels: list[tuple[str, list[Band], str]], out_path: Path, *, xlabels: list[str]
) -> Path:
    """One subplot per (title, one band per group, ylabel) panel: mean lines with ±1 std bands."""
    fig, axes = plt.subplots(1, len(panels), figsize=(SUBPLOT_SIZE[0] * len(panels), SUBPLOT_SIZE[1]), squeeze=False)
    for ax, (title, bands, ylabel), xlabel in zip(axes[0], panels, xlabels):
        for index, (group, band) in enumerate(zip(groups, bands)):
            if not band.x:
                continue
            marker = "o" if len(band.x) < SMOOTH_MIN_POINTS // 4 else ""
            label = f"{group.label} (n={band.n})"
            (line,) = ax.plot(band.x, band.mean, marker=marker, markersize=3, label=label, **group_style(index))
            low = [m - s for m, s in zip(band.mean, band.std)]
            high = [m + s for m, s in zip(band.mean, band.std)]
            ax.fill_between(band.x, low, high, color=line.get_color(), alpha=BAND_ALPHA, linewidth=0)
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.tight_layout()
    try:
        with durable.atomic_path(out_path, fsync=False) as tmp:  # a report is regenerated, never resumed from
            fig.savefig(tmp, dpi=FIGURE_DPI, format="png")
    finally:
        plt.close(fig)
    return out_path


def group_style(index: int) -> dict[str, str]:
    """The colour and line style of the ``index``-th group: the 10 default colours, then the same colours dashed,
    dotted and dash-dotted, so a sweep of up to 40 variants draws no two alike."""
    return {"color": f"C{index % 10}", "linestyle": LINE_STYLES[index // 10 % len(LINE_STYLES)]}


def _scaled(band: Band, factor: float) -> Band:
    return Band(x=band.x, mean=[v * factor for v in band.mean], std=[v * factor for v in band.std], n=band.n)


def plot_sweep(groups: list[SeedGroup], out_dir: Path, notes: list[str]) -> list[Path]:
    """Band plots: accuracy vs wall clock and vs updates, E[ρ | A<0], veto % and clip % vs updates."""
    runs = [run for group in groups for run in group.runs]
    written = []
    if _present(runs, EVAL_AVG):
        bands = [accuracy_bands(group) for group in groups]
        panels = [
            (f"{EVAL_AVG} vs wall clock", [by_time for _, by_time in bands], "pass@1"),
            (f"{EVAL_AVG} vs updates", [by_update for by_update, _ in bands], "pass@1"),
        ]
        path = out_dir / "sweep_accuracy.png"
        written.append(_plot_bands(groups, panels, path, xlabels=["wall-clock seconds", "optimizer update"]))
    else:
        notes.append(f"skipped sweep_accuracy.png: no run logged '{EVAL_AVG}'")
    if _present(runs, RATIO_NEG):
        panels = [(f"E[ρ | A<0] ({RATIO_NEG})", [_update_band(g, RATIO_NEG) for g in groups], "mean ratio ρ")]
        written.append(_plot_bands(groups, panels, out_dir / "sweep_ratio_neg_adv.png", xlabels=["optimizer update"]))
    else:
        notes.append(f"skipped sweep_ratio_neg_adv.png: no run logged '{RATIO_NEG}'")
    fractions = [key for key in UPDATE_FRACTIONS if _present(runs, key)]
    notes += [
        f"skipped '{key}' in sweep_veto_clip.png: no run logged it" for key in UPDATE_FRACTIONS if key not in fractions
    ]
    if fractions:
        panels = [(key, [_scaled(_update_band(g, key), 100.0) for g in groups], "% of tokens") for key in fractions]
        path = out_dir / "sweep_veto_clip.png"
        written.append(_plot_bands(groups, panels, path, xlabels=["optimizer update"] * len(panels)))
    return written


def _update_band(group: SeedGroup, key: str) -> Band:
    return seed_band([_update_points(run.records, key) for run in group.runs])


FIGURE_FORMATS = {
    "final_acc": ("final acc", ".3f", 1.0),
    "best_acc": ("best acc", ".3f", 1.0),
    "acc_gain": ("acc gain", "+.3f", 1.0),
    "t_rollout_s": ("T_rollout s", ".1f", 1.0),
    "t_total_s": ("T_total s", ".1f", 1.0),
    "veto_rate": ("veto %", ".3f", 100.0),
    "clip_low": ("clip low %", ".3f", 100.0),
    "clip_high": ("clip high %", ".3f", 100.0),
    "masked_rate": ("masked %", ".3f", 100.0),
}
"""Markdown column title, number format and scale (fractions as percent) of each run figure."""


def figure_stats(group: SeedGroup) -> dict[str, MeanStd]:
    """Run figure → mean ± std over the group's seeds."""
    figures = [run_figures(run.records) for run in group.runs]
    return {key: mean_std([f[key] for f in figures]) for key in RUN_FIGURES}


def summary_csv(groups: list[SeedGroup]) -> str:
    """variant, n, then <figure>_mean, <figure>_std for every RUN_FIGURES key (full float precision)."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["variant", "n", *(f"{key}_{stat}" for key in RUN_FIGURES for stat in ("mean", "std"))])
    for group in groups:
        stats = figure_stats(group)
        writer.writerow(
            [group.label, len(group.runs), *(v for k in RUN_FIGURES for v in (stats[k].mean, stats[k].std))]
        )
    return buffer.getvalue()


def runs_csv(groups: list[SeedGroup]) -> str:
    """One row per run: variant, seed label, updates and every RUN_FIGURES value."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["variant", "run", "updates", *RUN_FIGURES])
    for group in groups:
        for run in group.runs:
            figures = run_figures(run.records)
            updates = max((int(r["step"]) for r in run.records), default=0)
            writer.writerow([group.label, run.label, updates, *(figures[key] for key in RUN_FIGURES)])
    return buffer.getvalue()


def _mean_std_cell(stat: MeanStd, spec: str, scale: float) -> str:
    if stat.n == 0:
        return "-"
    if stat.n == 1:
        return format(stat.mean * scale, spec)
    return f"{format(stat.mean * scale, spec)} ± {format(stat.std * scale, spec.lstrip('+'))}"


def summary_markdown_table(groups: list[SeedGroup]) -> list[str]:
    """Markdown rows: one per variant, mean ± std over seeds of every run figure, and n."""
    titles = [FIGURE_FORMATS[key][0] for key in RUN_FIGURES]
    rows = ["| variant | n | " + " | ".join(titles) + " |", "|---|---|" + "---|" * len(titles)]
    for group in groups:
        stats = figure_stats(group)
        cells = [_mean_std_cell(stats[key], FIGURE_FORMATS[key][1], FIGURE_FORMATS[key][2]) for key in RUN_FIGURES]
        rows.append(f"| {group.label} | {len(group.runs)} | " + " | ".join(cells) + " |")
    return rows


def per_run_markdown_table(groups: list[SeedGroup]) -> list[str]:
    """Markdown rows: every run's figures (the numbers the means are taken over)."""
    titles = [FIGURE_FORMATS[key][0] for key in RUN_FIGURES]
    rows = ["| variant | run | " + " | ".join(titles) + " |", "|---|---|" + "---|" * len(titles)]
    for group in groups:
        for run in group.runs:
            figures = run_figures(run.records)
            cells = [_fmt(figures[key] * FIGURE_FORMATS[key][2], FIGURE_FORMATS[key][1]) for key in RUN_FIGURES]
            rows.append(f"| {group.label} | {run.label} | " + " | ".join(cells) + " |")
    return rows


def write_sweep_report(
    groups: list[SeedGroup],
    out_dir: str | Path,
    *,
    title: str = "Sweep",
    header: Sequence[str] = (),
    notes: Sequence[str] = (),
) -> list[Path]:
    """Write the band plots, summary.csv, runs.csv and summary.md (last) into ``out_dir``; return their paths.

    ``header`` lines go under the title (what was run, on which machine); ``notes`` (e.g. failed runs)
    are listed with the plots' own notes.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    groups = [group for group in groups if group.runs]
    all_notes = list(notes)
    plots = plot_sweep(groups, out, all_notes) if groups else []
    tables = [out / "summary.csv", out / "runs.csv"]
    # Atomic, so a reader never sees half a file; no fsync: a report is regenerated from the runs.
    for path, text in zip(tables, (summary_csv(groups), runs_csv(groups)), strict=True):
        durable.atomic_write_text(path, text, fsync=False)
    lines = [f"# {title}", "", *header, "", "## Mean ± std over seeds", "", *summary_markdown_table(groups), ""]
    lines += [f"- {key}: {text}" for key, text in RUN_FIGURES.items()]
    lines += ["- std: sample standard deviation over seeds (n − 1); one seed shows its value alone", ""]
    lines += ["## Plots (mean ± 1 std over seeds)", "", *[f"![{p.stem}]({p.name})" for p in plots], ""]
    lines += ["## Per run", "", *per_run_markdown_table(groups), ""]
    lines += ["## Notes", "", *([f"- {n}" for n in all_notes] or ["- none"])]
    summary = out / "summary.md"
    durable.atomic_write_text(summary, "\n".join(lines) + "\n", fsync=False)
    return [*plots, *tables, summary]


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
