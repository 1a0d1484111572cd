"""A run's plan against what it measured: the rows of `mugrpo report`'s "Plan against actual" table.

Reads the run's ``plan.json`` and ``memory.json`` (``plan.run_plan``) and its metrics records:

- **memory, rank 0**: weights, gradients, optimizer state as planned for rank 0 and as allocated
  (exact on any device: both count the same buffers); the trainer peak as planned (the rank that
  peaks highest) against the process's measured peak (CUDA allocator, or CPU peak RSS, which holds
  more than the trainer's tensors: an upper bound, said in the row's note);
- **time**: rollout per stage = the last ``perf/t_rollout_s`` / stages generated (staged mode only: in
  async mode that timer is the trainer's wait); optimizer per stage = ``perf/t_optimize_s`` / updates
  × μ; one update = ``perf/t_optimize_s`` / updates; T_total = the last ``perf/t_total_s``;
- **async**: the trainer idle fraction (mean of ``perf/trainer_idle_ratio`` over updates) and the mean
  lag (mean of ``rollout/lag_mean``).

A figure a run did not log, or a plan without a time section (a CPU run), leaves that cell empty (None).

    rows = compare(plan, measured, records)
    rows[0].name, rows[0].plan, rows[0].actual     # 'weights (rank 0)', 329984, 329984
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_mugrpo import durable
from megatron_mugrpo.metric_names import LAG_MEAN, STAGE, T_OPTIMIZE, T_ROLLOUT, T_TOTAL, TRAINER_IDLE_RATIO

PLAN_FILE = "plan.json"
"""RUN_DIR/plan.json, written by ``plan.run_plan.write_run_plan`` (named here so the report reads it
without importing the planner, which imports Megatron)."""
MEASURED_FILE = "memory.json"
"""RUN_DIR/memory.json, written by ``plan.run_plan.write_measured``."""


@dataclass(frozen=True)
class Row:
    """One quantity: planned and actual value in ``unit`` ('bytes', 's' or '' for a fraction / count)."""

    name: str
    unit: str
    plan: float | None
    actual: float | None
    note: str = ""

    @property
    def ratio(self) -> float | None:
        """actual / plan (None when either is missing or the plan is 0)."""
        if self.plan is None or self.actual is None or self.plan == 0:
            return None
        return self.actual / self.plan


def read_run_files(run_dir: Path) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """(plan.json, memory.json) of a run directory; None for a file it does not have."""
    return durable.read_json(run_dir / PLAN_FILE), durable.read_json(run_dir / MEASURED_FILE)


def _last(records: list[dict[str, Any]], key: str) -> float | None:
    values = [float(r[key]) for r in records if key in r and math.isfinite(float(r[key]))]
    return values[-1] if values else None


def _mean(records: list[dict[str, Any]], key: str) -> float | None:
    values = [float(r[key]) for r in records if key in r and math.isfinite(float(r[key]))]
    return sum(values) / len(values) if values else None


def _updates(records: list[dict[str, Any]]) -> int:
    return max((int(r["step"]) for r in records if "step" in r), default=0)


def _stages(records: list[dict[str, Any]]) -> int:
    """Stages whose rollout the run logged (a stage logged twice, by a resume, counts once)."""
    return len({float(r[STAGE]) for r in records if STAGE in r})


def _div(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def memory_rows(plan: dict[str, Any], measured: dict[str, Any] | None) -> list[Row]:
    """Rank 0's weights, gradients and optimizer state, planned and allocated; the trainer peak."""
    rank0 = plan.get("rank0") or {}
    got = measured or {}
    updates = got.get("updates")
    state_note = "Adam's state exists after the first update" if updates == 0 else ""
    rows = [
        Row("weights (rank 0)", "bytes", rank0.get("weights"), got.get("weights")),
        Row("gradients (rank 0)", "bytes", rank0.get("grads"), got.get("grads")),
        Row("optimizer state (rank 0)", "bytes", rank0.get("optimizer"), got.get("optimizer"), state_note),
    ]
    peak = got.get("peak") or {}
    kind = peak.get("kind", "")
    note = {
        "cpu_peak_rss": "measured: the process's peak RSS (Python, libraries, data and engine too): an upper bound",
        "cuda_max_memory_allocated": "measured: torch.cuda.max_memory_allocated of rank 0",
    }.get(kind, "not measured" if not peak else kind)
    planned_peak = (plan.get("roles") or {}).get("trainer", {}).get("peak_bytes")
    rows.append(Row("trainer peak", "bytes", planned_peak, peak.get("bytes"), note))
    return rows


def time_rows(plan: dict[str, Any], records: list[dict[str, Any]]) -> list[Row]:
    """Phase times per stage, one update and T_total; async idle fraction and lag."""
    time = plan.get("time") or {}
    stages = plan.get("stages") or {}
    mu = stages.get("updates_per_stage") or time.get("updates_per_stage")
    updates, is_async = _updates(records), plan.get("mode") == "async"
    optimize = _last(records, T_OPTIMIZE)
    per_update = _div(optimize, updates)
    rollout_note = "async: perf/t_rollout_s is the trainer's wait, not generation" if is_async else ""
    rollout = None if is_async else _div(_last(records, T_ROLLOUT), _stages(records))
    planned_updates = (stages.get("num_stages") or 0) * (mu or 0)
    total_note = f"the run did {updates} of {planned_updates} updates" if 0 < updates < planned_updates else ""
    rows = [
        Row("rollout per stage", "s", time.get("rollout_s"), rollout, rollout_note),
        Row("optimizer per stage", "s", time.get("optimize_s"), per_update * mu if per_update and mu else None),
        Row("one update", "s", time.get("update_s"), per_update),
        Row("T_total", "s", time.get("total_s"), _last(records, T_TOTAL), total_note),
    ]
    if is_async:
        balance = time.get("async") or {}
        rows.append(Row("trainer idle fraction", "", balance.get("idle_fraction"), _mean(records, TRAINER_IDLE_RATIO)))
        rows.append(Row("mean lag (updates)", "", balance.get("mean_lag"), _mean(records, LAG_MEAN)))
    return rows


def compare(plan: dict[str, Any] | None, measured: dict[str, Any] | None, records: list[dict[str, Any]]) -> list[Row]:
    """Every row of the table (none without a plan, or for a plan that records an error)."""
    if not plan or "error" in plan:
        return []
    return memory_rows(plan, measured) + time_rows(plan, records)
