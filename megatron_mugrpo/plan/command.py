"""`mugrpo plan`: the command's arguments and what it prints (the arithmetic is in ``planner``).

    mugrpo plan --config configs/paper/qwen2.5_math_7b__mu_grpo.yaml --gpus 8 --gpu h100
    mugrpo plan --config configs/paper/qwen3_30b_a3b__mu_grpo.yaml --gpus 8 --gpu h200 --json

Exit status 0 when every role fits, 1 when one does not (the output names it and, when a single config
key fixes it, that change with its own plan), 2 for a config or argument error.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from megatron_mugrpo.plan.gpus import GPUS, gpu_spec
from megatron_mugrpo.plan.inputs import hf_fields, model_name, planning_overrides
from megatron_mugrpo.plan.models import ModelShape
from megatron_mugrpo.plan.output import plan_json, render
from megatron_mugrpo.plan.planner import Assumptions, Hardware, Plan, make_plan
from megatron_mugrpo.plan.suggest import suggest

EXIT_DOES_NOT_FIT = 1
Loader = Callable[[Path | None, list[str]], Any]
"""``config.load_config``: (YAML path, overrides) → RunConfig (the composition root hands it in)."""


def add_plan_parser(verbs: argparse._SubParsersAction) -> None:
    plan = verbs.add_parser(
        "plan",
        help="memory per GPU and role, time and async staleness of a run before it starts",
        description="Plan a run: per GPU, the trainer's weights, gradients, optimizer state, activations and "
        "logits, the rollout engine's weights and KV cache (and the concurrent sequences it holds), and the "
        "run's time from FLOPs and HBM bandwidth; suggests the smallest config change that makes a role fit. "
        "Placeholder model directories of known models (configs/paper/) are planned with their published "
        "config.json. Exit status 1 when a role does not fit. See docs/plan.md.",
    )
    plan.add_argument("--config", type=Path, required=True, help="run YAML (e.g. configs/paper/...)")
    plan.add_argument("overrides", nargs="*", help="dotted overrides, as for train (parallel.tensor_parallel=4)")
    plan.add_argument("--gpus", type=int, default=8, help="GPUs of the launch, all nodes (default 8)")
    plan.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8)")
    plan.add_argument("--gpu", default="h100", help=f"GPU model: {', '.join(sorted(GPUS))} (default h100)")
    plan.add_argument("--gpu-memory-gib", type=float, help="override the GPU's memory capacity (GiB)")
    plan.add_argument("--mfu", type=float, default=Assumptions.mfu, help="optimizer-phase MFU (default 0.35)")
    plan.add_argument(
        "--response-fill",
        type=float,
        default=Assumptions.response_fill,
        help="mean response length / rollout.max_new_tokens (default 0.5)",
    )
    plan.add_argument("--rollout-tokens-per-s", type=float, help="measured decode tokens/s of one engine")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")


def run_plan(args: argparse.Namespace, load: Loader) -> int:
    hardware = Hardware(gpu=gpu_spec(args.gpu, args.gpu_memory_gib), gpus=args.gpus, gpus_per_node=args.gpus_per_node)
    assumptions = Assumptions(
        mfu=args.mfu, response_fill=args.response_fill, rollout_tokens_per_s=args.rollout_tokens_per_s
    )
    with planning_overrides(args.config, list(args.overrides)) as (overrides, notes):

        def plan_with(extra: list[str]) -> tuple[Any, Plan]:
            cfg = load(args.config, [*overrides, *extra])
            hf = hf_fields(cfg.model.hf_dir, cfg.model.tiny)
            plan = make_plan(cfg, hf, hardware, assumptions, model=model_name(cfg))
            plan.notes.extend(notes)
            return cfg, plan

        cfg, plan = plan_with([])
        experts = ModelShape.from_hf(hf_fields(cfg.model.hf_dir, cfg.model.tiny)).experts
        suggestion = suggest(cfg, plan, plan_with, experts)
    if args.json:
        print(json.dumps(plan_json(plan, suggestion), indent=2))
        return 0 if plan.fits else EXIT_DOES_NOT_FIT
    print(render(plan))
    for problem in plan.problems:
        print(f"\ndoes not fit: {problem}")
    if suggestion is not None:
        print(f"\nsuggestion: {suggestion.change}: {suggestion.effect}\n")
        print(render(suggestion.plan))
    elif not plan.fits:
        print(
            "\nno chain of up to three changes of the parallel layout, micro-batch or engine memory fraction makes "
            "it fit; plan more GPUs"
        )
    return 0 if plan.fits else EXIT_DOES_NOT_FIT
