"""Exporting the trainer's policy as Hugging Face tensors: the engine sync, the async publications and
the final model all go through ``export_policy``.

``conversion.export_hf`` is collective over the model-parallel ranks (tensors are gathered across
TP / PP), so every rank must iterate it to the end; only some ranks use what it yields (engine hosts
load it, rank 0 writes it). ``export_policy`` hands the stream to ``use`` where ``consume`` holds and
drains it everywhere else, so no caller can forget the draining side.

    export_policy(run.policy, run.hf_config, run.groups, consume=run.is_writer, use=write)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import torch

if TYPE_CHECKING:
    from megatron_mugrpo.loop.setup import Run
    from megatron_mugrpo.training.parallel import ParallelGroups
    from megatron_mugrpo.training.setup import Policy

T = TypeVar("T")
NamedTensors = Iterator[tuple[str, torch.Tensor]]
FINAL_HF_DIR = "hf_final"


def export_policy(
    policy: Policy,
    hf_config: dict[str, Any],
    groups: ParallelGroups,
    *,
    consume: bool,
    use: Callable[[NamedTensors], T],
) -> T | None:
    """Export ``policy`` (collective); ``use(stream)`` where ``consume``, else drain it. Returns what ``use`` did."""
    from megatron_mugrpo.conversion import export_hf

    tensors = export_hf(policy.unwrapped(), hf_config, groups)
    if consume:
        return use(tensors)
    for _ in tensors:  # take part in the export's collectives
        pass
    return None


def export_final(run: Run) -> None:
    """Write the trained policy as a Hugging Face directory, ``RUN_DIR/hf_final`` (replacing an older one)."""
    import shutil

    from megatron_mugrpo.conversion import save_hf_dir

    target = run.run_dir / FINAL_HF_DIR

    def write(tensors: NamedTensors) -> None:
        shutil.rmtree(target, ignore_errors=True)
        save_hf_dir(((name, tensor.cpu()) for name, tensor in tensors), target, run.hf_config, run.hf_dir)

    export_policy(run.policy, run.hf_config, run.groups, consume=run.is_writer, use=write)
    run.hosts.barrier()
