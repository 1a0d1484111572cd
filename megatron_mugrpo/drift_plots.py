"""The μ-GRPO paper's drift diagnostics plotted the paper's way: against the update index *within* a stage.

In the paper (Figures 2-3, App. C) every stage starts again from π_θ = β, and what matters is how the
ratio statistics move as the μ updates of one stage go by. ``mugrpo report`` calls ``plot_drift``,
which writes one ``drift_<run>.png`` per run: a grid of panels (``DRIFT_PANELS``), one line per stage,
x = the update's index in its stage (1 = the stage's first update).

    paths = plot_drift([(label, records), ...], out_dir, notes)

The records are a run's ``metrics.jsonl`` lines; an update record is one with ``train/stage``
(``loop.staged.optimizer_update``) and ``step`` (updates done, 1-based). The index in a stage is
``step`` minus the stage's first logged step, plus one. A run without such records (an async run has
no stages; an eval-only log) gets no drift figure, silently: there is no stage to index by. A panel
whose metric no update logged (a loss without NAV has no ``train/nav_vetoed_frac``) says so in the
panel and in ``notes``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

from megatron_mugrpo.metric_names import (
    CLIP_HIGH,
    CLIP_LOW,
    KL_BEHAVIOUR_K3,
    NEG_ADV_LOW_RATIO_FRAC,
    POST_TRIGGER_SUFFIX_LEN,
    RATIO_NEG,
    RATIO_POS,
    TRAIN_STAGE,
    TRIGGER_COUNT,
    TRIGGER_POS_FRAC,
    VETO_FRAC,
)

matplotlib.use("Agg")  # files only: never needs a display

import matplotlib.pyplot as plt  # the backend above must be chosen before pyplot loads

STAGE_KEY = TRAIN_STAGE
DRIFT_PANELS = (
    (RATIO_NEG, "E[ρ | A<0]"),
    (RATIO_POS, "E[ρ | A>0]"),
    (CLIP_LOW, "low clip fraction"),
    (CLIP_HIGH, "high clip fraction"),
    (VETO_FRAC, "NAV veto fraction"),
    (TRIGGER_COUNT, "trigger tokens (A<0, ρ<τ_c)"),
    (TRIGGER_POS_FRAC, "first trigger κ / T"),
    (POST_TRIGGER_SUFFIX_LEN, "post-trigger suffix (tokens)"),
    (NEG_ADV_LOW_RATIO_FRAC, "A<0 tokens with ρ < τ_c"),
    (KL_BEHAVIOUR_K3, "KL(β ‖ π_θ), k3"),
)
"""(metric, panel title); the metrics are documented in algorithms/diagnostics.py and the loss modules."""
COLUMNS = 5
PANEL_SIZE = (3.6, 2.8)
FIGURE_DPI = 110


def stage_curves(records: Sequence[dict[str, Any]], key: str) -> dict[int, tuple[list[int], list[float]]]:
    """{stage: (index in the stage, value)} of ``key`` over the update records, in file order.

    A value that is not a finite number (NaN: no trigger in that update) is left out of the line.
    """
    first: dict[int, int] = {}
    curves: dict[int, tuple[list[int], list[float]]] = {}
    for record in records:
        if STAGE_KEY not in record or "step" not in record:
            continue
        stage, step = int(record[STAGE_KEY]), int(record["step"])
        first.setdefault(stage, step)
        value = record.get(key)
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            continue
        xs, ys = curves.setdefault(stage, ([], []))
        xs.append(step - first[stage] + 1)
        ys.append(float(value))
    return curves


def _file_name(label: str) -> str:
    return "drift_" + re.sub(r"[^A-Za-z0-9_.-]+", "_", label).strip("_") + ".png"


def plot_drift(runs: Sequence[tuple[str, Sequence[dict[str, Any]]]], out_dir: Path, notes: list[str]) -> list[Path]:
    """One ``drift_<label>.png`` per run that logged staged update records; returns the written paths."""
    written = []
    for label, records in runs:
        if not any(STAGE_KEY in r for r in records):
            continue  # no stage to index the updates by (module docstring)
        written.append(_plot_run(label, records, Path(out_dir) / _file_name(label), notes))
    return written


def _plot_run(label: str, records: Sequence[dict[str, Any]], path: Path, notes: list[str]) -> Path:
    rows = math.ceil(len(DRIFT_PANELS) / COLUMNS)
    fig, axes = plt.subplots(rows, COLUMNS, figsize=(PANEL_SIZE[0] * COLUMNS, PANEL_SIZE[1] * rows), squeeze=False)
    stages = sorted({int(r[STAGE_KEY]) for r in records if STAGE_KEY in r})
    colours = plt.get_cmap("viridis")([i / max(len(stages) - 1, 1) for i in range(len(stages))])
    for ax, (key, title) in zip(axes.flat, DRIFT_PANELS):
        curves = stage_curves(records, key)
        for stage, colour in zip(stages, colours):
            if stage in curves:
                ax.plot(*curves[stage], color=colour, linewidth=1.0, label=f"stage {stage}")
        if not curves:
            notes.append(f"{label}: no update logged '{key}' (drift panel left empty)")
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="grey")
        ax.set_title(title, fontsize="medium")
        ax.set_xlabel("update in stage")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(DRIFT_PANELS) :]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="upper right", fontsize="small")
    fig.suptitle(f"{label}: drift diagnostics per update within a stage")
    fig.tight_layout(rect=(0, 0, 0.93, 0.95))
    fig.savefig(path, dpi=FIGURE_DPI)
    plt.close(fig)
    return path
