"""Suggestions: the smallest config change that makes every role of a plan fit, shown with its own plan.

When a role does not fit, single-key changes are tried smallest first and the first whose own plan
fails fewer roles is kept; up to ``MAX_CHANGES`` chain. A fitting plan still gets a suggestion when its
async trainer idles (more ``async.rollout_ranks``) or an SGLang engine is starved of KV cache (a larger
static pool). Re-planning goes through a loader the caller gives (the CLI's, which validates each
changed config as ``mugrpo train`` would); a change it refuses is skipped.

    suggestion = suggest(cfg, plan, replan, experts=shape.experts)
    suggestion.change    # 'parallel.tensor_parallel 2 → 4; rollout.tensor_parallel 1 → 2'
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from megatron_mugrpo.errors import ConfigError
from megatron_mugrpo.plan.planner import GIB, Plan
from megatron_mugrpo.plan.timing import AsyncBalance

IDLE_WORTH_FIXING = 0.1
"""An async trainer idle for more than this share of its time gets a suggestion."""
STARVED_SEQUENCES = 32
"""An SGLang engine whose KV pool holds fewer concurrent sequences decodes far below its bandwidth roofline
(each step reads all weights for few tokens): the plan suggests a larger static pool when one fits."""
MAX_STATIC_FRACTION = 0.9
"""The largest rollout.sglang.mem_fraction_static suggested for a starved engine (SGLang's own runtime
needs the rest, ``memory.SGLANG_RUNTIME_BYTES``)."""
TIME_WORTH_IT = 0.9
"""A change suggested for speed must bring T_total below this fraction of the plan's."""


@dataclass(frozen=True, kw_only=True)
class Suggestion:
    change: str
    """``key a → b``."""
    effect: str
    plan: Plan


def candidate_changes(cfg: Any, plan: Plan, shape_experts: int) -> list[tuple[str, Any, Any]]:
    """Single-key changes worth trying, smallest first: (key, current, proposed)."""
    par, ro, out = cfg.parallel, cfg.rollout, []
    if not plan.trainer.fits or (not plan.engine.fits and plan.mode != "async"):
        budget, longest = getattr(par, "micro_batch_tokens", None), ro.max_prompt_tokens + ro.max_new_tokens
        if budget is not None and budget // 2 >= longest:  # a budget holds at least the longest row
            out.append(("parallel.micro_batch_tokens", budget, budget // 2))
        elif budget is None and par.micro_batch_size > 1:
            out.append(("parallel.micro_batch_size", par.micro_batch_size, par.micro_batch_size // 2))
        if not par.use_distributed_optimizer:
            out.append(("parallel.use_distributed_optimizer", False, True))
        if shape_experts:
            out.append(("parallel.expert_parallel", par.expert_parallel, par.expert_parallel * 2))
        out.append(("parallel.tensor_parallel", par.tensor_parallel, par.tensor_parallel * 2))
        out.append(("parallel.pipeline_parallel", par.pipeline_parallel, par.pipeline_parallel * 2))
    if not plan.engine.fits and ro.engine == "sglang":
        f = ro.sglang.mem_fraction_static
        for step in (0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4):
            proposed = (
                round(f - step, 2) if plan.engine.bytes.staging > plan.engine.bytes.outside_pool else round(f + step, 2)
            )
            if 0.1 <= proposed <= 0.95:
                out.append(("rollout.sglang.mem_fraction_static", f, proposed))
        out.append(("rollout.tensor_parallel", ro.tensor_parallel, ro.tensor_parallel * 2))
    if _starved(plan):
        f = ro.sglang.mem_fraction_static
        for step in (0.05, 0.1, 0.15, 0.2):
            if round(f + step, 2) <= MAX_STATIC_FRACTION:
                out.append(("rollout.sglang.mem_fraction_static", f, round(f + step, 2)))
    balance = _balance(plan)
    if balance is not None and balance.idle_fraction > IDLE_WORTH_FIXING:
        for extra in range(1, 5):
            out.append(("async.rollout_ranks", cfg.async_.rollout_ranks, cfg.async_.rollout_ranks + extra))
    return out


def _balance(plan: Plan) -> AsyncBalance | None:
    """The async idle and lag of a plan that has a time plan (None: staged, or no roofline)."""
    return plan.time.balance if plan.time is not None else None


def _starved(plan: Plan) -> bool:
    e = plan.engine
    return e.fits and e.engine == "sglang" and not e.bytes.staging and e.bytes.max_sequences < STARVED_SEQUENCES


def _progress(before: Plan, after: Plan) -> bool:
    """Fewer roles fail; or none fails in either and the async trainer idles clearly less, or the run
    takes clearly less time."""
    if len(after.problems) != len(before.problems):
        return len(after.problems) < len(before.problems)
    if not after.fits:
        return False
    b, a = _balance(before), _balance(after)
    if b is not None and a is not None and a.idle_fraction < b.idle_fraction - 0.02:
        return True
    if before.time is None or after.time is None:
        return False
    return after.time.total_s < TIME_WORTH_IT * before.time.total_s


def _effect(before: Plan, after: Plan) -> str:
    parts = []
    if before.trainer.peak != after.trainer.peak:
        parts.append(f"trainer peak {before.trainer.peak / GIB:.0f} → {after.trainer.peak / GIB:.0f} GiB")
    if before.engine.bytes.max_sequences != after.engine.bytes.max_sequences:
        parts.append(f"engine sequences {before.engine.bytes.max_sequences} → {after.engine.bytes.max_sequences}")
    b, a = _balance(before), _balance(after)
    if b is not None and a is not None:
        parts.append(f"idle {b.idle_fraction:.2f} → {a.idle_fraction:.2f}")
    if before.time is not None and after.time is not None:
        parts.append(f"T_total {before.time.total_s / 3600:.1f} → {after.time.total_s / 3600:.1f} h")
    return ", ".join(parts)


MAX_CHANGES = 3
"""At most this many single-key changes are chained (one per role that does not fit, and the idle fraction)."""


def _done(plan: Plan) -> bool:
    balance = _balance(plan)
    idle = balance is not None and balance.idle_fraction > IDLE_WORTH_FIXING
    return plan.fits and not idle and not _starved(plan)


def suggest(cfg: Any, plan: Plan, replan: Callable[[list[str]], tuple[Any, Plan]], experts: int) -> Suggestion | None:
    """The smallest change that makes every role fit (or, when all fit, lowers the async idle fraction or
    gives a starved engine a larger KV pool).

    Each step tries ``candidate_changes`` in order and keeps the first whose own plan has fewer failing
    roles (or clearly less idle); steps chain, one key each, up to ``MAX_CHANGES``. ``replan(overrides)``
    plans the run with extra overrides and returns (config, plan); a change the config or the layout
    refuses (ConfigError) is skipped. None when nothing needs changing or no chain of changes helps.
    """
    if _done(plan):
        return None
    changes: dict[str, tuple[Any, Any]] = {}  # key → (value in the config, proposed); a key changed twice keeps one
    current_cfg, current = cfg, plan
    for _ in range(MAX_CHANGES):
        if _done(current):
            break
        for key, old, new in candidate_changes(current_cfg, current, experts):
            trial = {**changes, key: (changes.get(key, (old,))[0], new)}
            try:
                other_cfg, other = replan([_override(k, v) for k, (_, v) in trial.items()])
            except ConfigError:
                continue  # this change does not split the model or the GPUs
            if _progress(current, other):
                changes, current_cfg, current = trial, other_cfg, other
                break
        else:
            break
    if not changes or not (current.fits or _progress(plan, current)):
        return None
    described = "; ".join(f"{key} {old} → {new}" for key, (old, new) in changes.items())
    return Suggestion(change=described, effect=_effect(plan, current), plan=current)


def _override(key: str, value: Any) -> str:
    return f"{key}={str(value).lower() if isinstance(value, bool) else value}"
