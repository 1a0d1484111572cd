"""A run's own plan, written when it starts, and the bytes it measured, for `mugrpo report`'s plan
against actual.

``mugrpo train`` writes ``RUN_DIR/plan.json`` on rank 0 before it builds any model (``write_run_plan``):
the plan of this launch on the device it actually has (``local_hardware``): a GPU of the table matched
by its name, with the memory the driver reports; a GPU not in the table with its memory and no time
plan; a CPU with the host's memory shared by the processes on it, and no time plan either (no FLOPs
or bandwidth figures: the memory bytes are still exact). It holds ``plan.output.plan_json``'s fields,
plus ``rank0``: the weights, gradients and optimizer state of rank 0 (pipeline stage 0, DP rank 0),
the rank whose allocations ``memory.json`` records. Every start of ``train`` rewrites it, a resume too:
a requeued job may land on other GPUs, resume may change keys (``resume.py``), and the bytes the report
compares it with are this process's. A plan that cannot be made is recorded as ``{"error": ...}``
with a warning and the run goes on (the launch validates the run itself). ``generate``, ``optimize``
and ``eval`` replay one phase of a run and write neither file.

When training ends rank 0 writes ``RUN_DIR/memory.json`` (``write_measured``): the bytes its weights,
gradients and optimizer state take, counted by storage as ``tests/plan/test_plan_exact.py`` counts them
(Adam's moments exist only after the first update), and its peak: on a GPU the caching allocator's
``max_memory_allocated`` (the trainer's tensors: comparable with the plan's trainer peak); on a CPU the
process's peak resident set, which also holds Python, the libraries, the data and the transformers
engine, so it bounds the plan's trainer peak from above rather than matching it.

    write_run_plan(cfg, run_dir, world_size=2, processes_per_node=2, verb="train")
    ...
    write_measured(run_dir, policy, updates=state.global_update)
"""

from __future__ import annotations

import logging
import os
import re
import resource
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from megatron_mugrpo import durable
from megatron_mugrpo.errors import InputError
from megatron_mugrpo.plan.actual import MEASURED_FILE, PLAN_FILE
from megatron_mugrpo.plan.gpus import GPUS, GpuSpec, gpu_spec
from megatron_mugrpo.plan.inputs import hf_fields, model_name
from megatron_mugrpo.plan.memory import static_bytes
from megatron_mugrpo.plan.models import ModelShape
from megatron_mugrpo.plan.output import plan_json
from megatron_mugrpo.plan.planner import DTYPE_BYTES, Hardware, check_layout, make_plan, trainer_layout

log = logging.getLogger(__name__)

DEVICE_NAMES = (
    (r"h100.*pcie", "h100-pcie"),
    (r"gh200|h200", "h200"),
    (r"h100", "h100"),
    (r"a100", "a100"),
    (r"b200", "b200"),
    (r"l40s", "l40s"),
    (r"mi300x", "mi300x"),
)
"""Device name (``torch.cuda.get_device_name``, lower case) → GPU table entry; the first match wins."""
A100_40GB_BELOW = 60e9
"""An A100 reporting less memory than this is the 40 GB part (its own table entry: other bandwidth)."""


def gpu_for_device(name: str, memory_bytes: int) -> GpuSpec:
    """The table's spec for a device the driver names ``name``, with the memory it reports; a device not
    in the table keeps its memory and gets no FLOPs or bandwidth (no time is planned for it)."""
    lowered = name.lower()
    for pattern, entry in DEVICE_NAMES:
        if re.search(pattern, lowered):
            if entry == "a100" and memory_bytes < A100_40GB_BELOW:
                entry = "a100-40gb"
            spec = gpu_spec(entry, memory_bytes / 2**30)
            return GpuSpec(**{**asdict(spec), "source": f"{name} (driver); {spec.source}"})
    return GpuSpec(
        name=name,
        memory_gb=memory_bytes / 1e9,
        bf16_tflops=0,
        fp8_tflops=0,
        hbm_tb_per_s=0,
        source=f"{name}: memory as the driver reports it; not in the GPU table ({', '.join(sorted(GPUS))})",
    )


def cpu_device(processes_per_node: int) -> GpuSpec:
    """The host's memory, shared evenly by the processes of the launch on it; no FLOPs or bandwidth."""
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return GpuSpec(
        name="cpu",
        memory_gb=ram / processes_per_node / 1e9,
        bf16_tflops=0,
        fp8_tflops=0,
        hbm_tb_per_s=0,
        source=f"host memory {ram / 2**30:.1f} GiB (os.sysconf) / {processes_per_node} process(es) on this host",
        context_bytes=0,
    )


def local_hardware(world_size: int, processes_per_node: int) -> Hardware:
    """The hardware this process runs on: its first CUDA device when it has one, else the CPU."""
    import torch  # the plan command itself never needs it

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        spec = gpu_for_device(torch.cuda.get_device_name(0), props.total_memory)
    else:
        spec = cpu_device(processes_per_node)
    return Hardware(gpu=spec, gpus=world_size, gpus_per_node=min(processes_per_node, world_size))


def run_plan_payload(cfg: Any, hardware: Hardware, *, verb: str) -> dict[str, Any]:
    """plan.json's content: the plan as ``mugrpo plan --json`` prints it, the stages (so a plan without a
    time section still gives μ), rank 0's static bytes, and who wrote it. Raises InputError (ConfigError)
    when the run cannot be planned."""
    hf = hf_fields(cfg.model.hf_dir, cfg.model.tiny)
    plan = make_plan(cfg, hf, hardware, model=model_name(cfg))
    shape = ModelShape.from_hf(hf)
    layout = trainer_layout(cfg, check_layout(cfg, shape, hardware), hardware)
    rank0 = static_bytes(shape, layout, dtype_bytes=DTYPE_BYTES[cfg.model.dtype], pp_rank=0)
    return {
        "written_by": verb,
        "device_source": hardware.gpu.source,
        **plan_json(plan),
        "stages": {"num_stages": cfg.stages.num_stages, "updates_per_stage": cfg.stages.updates_per_stage},
        "rank0": {**asdict(rank0), "total": rank0.total},
    }


def write_run_plan(cfg: Any, run_dir: Path, *, world_size: int, processes_per_node: int, verb: str) -> None:
    """Write ``RUN_DIR/plan.json`` (atomically); a run that cannot be planned records the reason instead."""
    try:
        payload = run_plan_payload(cfg, local_hardware(world_size, processes_per_node), verb=verb)
    except InputError as exc:
        log.warning("no plan for this run (%s); %s records the reason", exc, PLAN_FILE)
        payload = {"written_by": verb, "error": str(exc)}
    durable.atomic_write_json(run_dir / PLAN_FILE, payload)


def _storages(tensors: Any) -> dict[int, int]:
    """data_ptr → bytes of the storages under ``tensors`` (each storage once)."""
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}


def allocated_static_bytes(policy: Any) -> dict[str, int]:
    """Bytes of a ``training.setup.Policy``'s weights, fp32 main gradients and optimizer state on this
    rank, by storage: a parameter that is a view into DDP's buffer counts once, as the buffer; the
    optimizer's fp32 main copies count unless they are the weights themselves (an fp32 model)."""
    params = [p for chunk in policy.model_chunks for p in chunk.parameters()]
    weights = _storages(params)
    grads = _storages(p.main_grad for p in params)
    state = []
    inner = getattr(policy.optimizer, "chained_optimizers", [policy.optimizer]) if policy.optimizer else []
    for opt in inner:
        for group in opt.optimizer.param_groups:
            state += group["params"]  # main fp32 copies (views into the weights for an fp32 model)
        state += [v for s in opt.optimizer.state.values() for k, v in s.items() if k != "step"]
    optimizer = {ptr: n for ptr, n in _storages(state).items() if ptr not in weights}
    return {
        "weights": sum(weights.values()),
        "grads": sum(grads.values()),
        "optimizer": sum(optimizer.values()),
        "params": sum(p.numel() for p in params),
    }


def peak_memory() -> dict[str, Any]:
    """This process's peak: the CUDA caching allocator's when it has a GPU, else its peak resident set."""
    import torch

    if torch.cuda.is_available():
        return {"kind": "cuda_max_memory_allocated", "bytes": int(torch.cuda.max_memory_allocated())}
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    scale = 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB on Linux
    return {"kind": "cpu_peak_rss", "bytes": int(rss * scale)}


def write_measured(run_dir: Path, policy: Any, *, updates: int) -> None:
    """Write ``RUN_DIR/memory.json``: rank 0's allocated static bytes and peak after ``updates`` updates."""
    payload = {"rank": 0, "updates": updates, **allocated_static_bytes(policy), "peak": peak_memory()}
    durable.atomic_write_json(run_dir / MEASURED_FILE, payload)
