"""A plan as a readable table, and as JSON for scripts."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from megatron_mugrpo.plan.planner import GIB, Plan
from megatron_mugrpo.plan.suggest import Suggestion


def _gib(n: float) -> str:
    """Bytes in GiB, or MiB / KiB for the tiny CPU models (right-aligned for the table)."""
    for unit, size in (("GiB", GIB), ("MiB", 2**20)):
        if abs(n) >= size / 10:
            return f"{n / size:8.2f} {unit}"
    return f"{n / 2**10:8.2f} KiB"


def _count(n: float) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(int(n))


def _hours(s: float) -> str:
    return f"{s / 3600:.2f} h" if s >= 3600 else f"{s:.1f} s"


def render(plan: Plan) -> str:
    """The plan as a readable table."""
    t, e, hw = plan.trainer, plan.engine, plan.hardware
    lines = [
        f"plan: {plan.model}  {_count(plan.params)} parameters ({_count(plan.active_params)} active), "
        f"mode {plan.mode}, {hw.gpus} × {hw.gpu.name} ({hw.gpu.memory_gb:.0f} GB, {hw.gpus_per_node} per node)",
        *(f"note: {n}" for n in plan.notes),
        "",
        f"trainer  {t.ranks} GPUs: TP {t.tp} × PP {t.pp} × DP {t.dp}"
        + (f", EP {t.ep} × ETP {t.etp} (expert DP {t.edp})" if t.ep > 1 or t.etp != t.tp else "")
        + f", distributed optimizer {'on' if t.distributed_optimizer else 'off'}; "
        f"per GPU (pipeline stage {t.peak_stage}):",
        f"  parameters          {_count(t.params_per_rank):>8}",
        f"  weights             {_gib(t.weights)}",
        f"  gradients (fp32)    {_gib(t.grads)}",
        f"  optimizer state     {_gib(t.optimizer)}",
        f"  activations         {_gib(t.activations)}   ({t.micro_batch_tokens} tokens per micro-batch × "
        f"{t.in_flight} in flight)",
        f"  logits              {_gib(t.logits)}",
    ]
    if t.routing_replay:
        lines.append(f"  routing replay      {_gib(t.routing_replay)}")
    lines += [
        f"  peak                {_gib(t.peak)}   of {_gib(t.usable).strip()} usable: "
        + ("fits" if t.fits else "DOES NOT FIT")
        + f", headroom {(t.usable - t.peak) / GIB:.1f} GiB",
        "",
        f"rollout  {e.engine}, {e.engines} engine(s) of {e.tp} GPU(s)"
        + (", colocated with the trainer" if plan.mode != "async" else ", on their own GPUs")
        + "; per GPU:",
    ]
    if e.resident:
        lines.append(f"  trainer resident    {_gib(e.resident)}   (weights, gradients, optimizer state)")
    lines += [
        f"  weights             {_gib(e.bytes.weights)}",
        f"  KV cache            {_gib(max(e.bytes.kv_cache, 0))}   → {e.bytes.max_sequences} concurrent sequences of "
        f"{e.context} tokens ({_gib(e.bytes.kv_per_sequence).strip()} each)",
    ]
    if e.bytes.staging:
        lines.append(
            f"  publication staging {_gib(e.bytes.staging)}   (outside the pool: {e.bytes.outside_pool / GIB:.1f} GiB)"
        )
    if e.route_store_bytes:
        lines.append(f"  routes in D_k       {_gib(e.route_store_bytes)}   per stage, on disk (at full length)")
    lines += [f"  peak                {_gib(e.peak)}   " + ("fits" if e.fits else f"DOES NOT FIT: {e.problem}"), ""]
    return "\n".join(lines + _time_lines(plan))


def _time_lines(plan: Plan) -> list[str]:
    tm = plan.time
    if tm is None:
        return [f"time     not planned ({plan.hardware.gpu.name}: no FLOPs or bandwidth figures)"]
    lines = [
        f"time     {tm.stages} stages × μ = {tm.updates_per_stage} updates (mfu {plan.assumptions.mfu}, mean response "
        f"{plan.assumptions.response_fill:.0%} of max_new_tokens)",
        f"  rollout per stage   {_hours(tm.rollout_s)}   ({tm.rollout_tokens / 1e6:.1f}M tokens, "
        f"{tm.tokens_per_s_per_engine:,.0f} tokens/s per engine at {tm.concurrency} sequences"
        + (", measured" if plan.assumptions.rollout_tokens_per_s else ", roofline")
        + ")",
        f"  one update          {tm.update_s:.2f} s   ({tm.update_tflop:,.0f} TFLOP)",
        f"  optimize per stage  {_hours(tm.optimize_s)}",
        f"  stage boundary      {_hours(tm.boundary_s)}   ("
        + ("weight sync" if tm.balance is None else "publications")
        + ")",
    ]
    if tm.balance is not None:
        b = tm.balance
        lines.append(
            f"  async               trainer idle {b.idle_fraction:.2f}, mean lag {b.mean_lag:.1f} updates "
            f"(rollout {b.produce_groups_per_s:.2f} groups/s vs trainer {b.consume_groups_per_s:.2f})"
        )
    lines.append(f"  T_total             {_hours(tm.total_s)}")
    return lines


def plan_json(plan: Plan, suggestion: Suggestion | None = None) -> dict[str, Any]:
    """The plan for scripts: parameter count, each role's peak bytes and ``fits``, times."""
    out = {
        "model": plan.model,
        "params": plan.params,
        "active_params": plan.active_params,
        "mode": plan.mode,
        "gpu": {
            "name": plan.hardware.gpu.name,
            "count": plan.hardware.gpus,
            "memory_bytes": plan.hardware.gpu.memory_bytes,
        },
        "assumptions": asdict(plan.assumptions),
        "fits": plan.fits,
        "problems": plan.problems,
        "roles": {
            "trainer": {**asdict(plan.trainer), "peak_bytes": plan.trainer.peak, "fits": plan.trainer.fits},
            "rollout": {
                "engine": plan.engine.engine,
                "engines": plan.engine.engines,
                "tp": plan.engine.tp,
                "resident": plan.engine.resident,
                "route_store_bytes": plan.engine.route_store_bytes,
                **asdict(plan.engine.bytes),
                "peak_bytes": plan.engine.peak,
                "fits": plan.engine.fits,
            },
        },
        "time": None if plan.time is None else {k: v for k, v in asdict(plan.time).items() if k != "balance"},
        "notes": plan.notes,
    }
    if plan.time is not None and plan.time.balance is not None:
        out["time"]["async"] = asdict(plan.time.balance)
    if suggestion is not None:
        out["suggestion"] = {
            "change": suggestion.change,
            "effect": suggestion.effect,
            "plan": plan_json(suggestion.plan),
        }
    return out
