"""Megatron step directories for the converter, through the trainer's own checkpoint code.

The layout is ``training.checkpoint``'s (interface 7); the converter adds only a ``tokenizer/``
folder next to the step directories it writes::

    CKPT_ROOT/
      step_00000000/      metadata.json (format tag, hf_config, tp, pp, dtype, ...) + model/
      latest              "step_00000000", written last
      tokenizer/          tokenizer files copied from the source HF directory

dist_checkpointing stores global tensors with shard offsets, so a step directory written at one
TP × PP × EP loads at any other (``training.checkpoint`` re-pads the vocabulary rows).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from megatron_mugrpo.conversion.errors import ConversionError

from megatron_mugrpo.training import checkpoint as trainer_checkpoint
from megatron_mugrpo.training.model import build_gpt_model
from megatron_mugrpo.training.moe import is_moe
from megatron_mugrpo.training.parallel import ParallelGroups

TOKENIZER_SUBDIR = "tokenizer"
CONVERTED_STEP = 0
"""Step number of the directory ``hf-to-megatron`` writes (the untrained policy)."""
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_from_name(name: str) -> torch.dtype:
    """torch dtype for 'float32' / 'bfloat16' / 'float16' (also accepts a 'torch.' prefix)."""
    key = str(name).removeprefix("torch.")
    if key not in DTYPES:
        raise ConversionError(f"dtype {name!r} is not one of {tuple(DTYPES)}")
    return DTYPES[key]


def resolve_step_dir(path: str | Path) -> Path:
    """A step directory from either a step directory or a checkpoint root (newest complete step)."""
    path = Path(path)
    if (path / "metadata.json").is_file():
        return path
    if not path.is_dir():
        raise ConversionError(f"checkpoint {path} does not exist")
    step = trainer_checkpoint.latest_checkpoint(path)
    if step is None:
        raise ConversionError(
            f"{path} is neither a step directory (no metadata.json) nor a checkpoint root with a complete step"
        )
    return step


def read_metadata(step_dir: str | Path) -> dict[str, Any]:
    """metadata.json of a complete step directory; ConversionError naming the problem otherwise."""
    try:
        return trainer_checkpoint.read_metadata(step_dir)
    except trainer_checkpoint.CheckpointError as err:
        raise ConversionError(str(err)) from err


def build_model_chunks(hf_config: dict[str, Any], dtype: torch.dtype, groups: ParallelGroups) -> list[torch.nn.Module]:
    """This rank's pipeline stage of the model (one chunk, eval mode), without random initialisation.

    Weights are about to be overwritten by a checkpoint or HF tensors, so Megatron's init is skipped.
    A MoE model holds only this EP rank's E / ``groups.ep`` experts of each sparse layer, each split
    over ``groups.etp`` ranks; at TP > 1 it is sequence-parallel, as megatron-core requires of MoE
    models (a forward then needs a sequence length divisible by TP).
    """
    model = build_gpt_model(
        hf_config,
        groups,
        dtype=dtype,
        config_overrides={"perform_initialization": False, "sequence_parallel": is_moe(hf_config) and groups.tp > 1},
    )
    if torch.cuda.is_available():
        model.cuda()
    model.eval()
    return [model]


CONVERTED_FSYNC = False
"""A converted checkpoint is not fsynced (like ``save_pretrained``): it can be regenerated, and its
checksum manifest exposes any file a power loss truncated."""


def save_converted(
    root: str | Path, model_chunks: list[torch.nn.Module], hf_config: dict[str, Any], groups: ParallelGroups
) -> Path:
    """Collective: write ``root/step_00000000`` (model only) and ``root/latest``; returns the step dir."""
    return trainer_checkpoint.save_checkpoint(
        root, CONVERTED_STEP, model_chunks, groups=groups, hf_config=hf_config, save_rng=False, fsync=CONVERTED_FSYNC
    )


def load_model(step_dir: str | Path, model_chunks: list[torch.nn.Module], groups: ParallelGroups) -> None:
    """Collective: verify and load the model of ``step_dir`` at the current TP × PP × EP (resharding on load)."""
    try:
        trainer_checkpoint.load_checkpoint(step_dir, model_chunks, groups=groups, load_rng=False)
    except trainer_checkpoint.CheckpointError as err:
        raise ConversionError(str(err)) from err
