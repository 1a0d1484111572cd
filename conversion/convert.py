"""Whole-checkpoint conversion: HF directory -> Megatron step directory, and back.

hf -> megatron runs on TP × PP × EP ranks (spawned unless already under torchrun): each rank builds its
shard of the model, fills it from the safetensors files (reading only its stage's tensors) and
saves it with dist_checkpointing, the format the trainer loads. Because dist_checkpointing stores
global tensors with shard offsets, the result loads at any other TP × PP × EP too; converting at the
training TP × PP keeps each rank's memory at 1 / (TP × PP) of the model, and EP (MoE models) keeps
only E / EP experts of each layer on a rank.

megatron -> hf loads a step directory at the requested TP × PP × EP (default 1 × 1 × 1, one process)
and streams ``export_hf`` into ``save_hf_dir`` on global rank 0; EP > 1 exports only at TP = 1.

Outputs are written under a temporary name and renamed when complete.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from megatron_mugrpo.conversion.errors import ConversionError
from megatron_mugrpo.conversion.hf_io import (
    TOKENIZER_FILES,
    HfCheckpoint,
    atomic_output_dir,
    check_output_dir,
    save_hf_dir,
)
from megatron_mugrpo.conversion.launch import run_on_ranks
from megatron_mugrpo.conversion.live import export_hf, load_hf_into_model
from megatron_mugrpo.conversion.megatron_io import (
    TOKENIZER_SUBDIR,
    build_model_chunks,
    dtype_from_name,
    load_model,
    read_metadata,
    resolve_step_dir,
    save_converted,
)

from megatron_mugrpo.training.model import ModelConfigError, check_divisibility, check_supported
from megatron_mugrpo.training.moe import MoeConfigError, check_moe, is_moe
from megatron_mugrpo.training.parallel import ParallelGroups


def default_dtype(hf_config: dict) -> str:
    """The dtype a HF checkpoint declares (``torch_dtype`` / ``dtype``), float32 when it declares none."""
    return str(hf_config.get("torch_dtype") or hf_config.get("dtype") or "float32")


def check_convertible(hf_config: dict, tp: int, pp: int, ep: int = 1) -> None:
    """ConversionError when the architecture is unsupported or TP / PP / EP cannot split this model (a
    MoE model's experts and shared expert included), naming the config.json key; checked before any
    rank is spawned, so a bad size costs no imports and writes nothing."""
    try:
        check_supported(hf_config)
        check_divisibility(hf_config, tp, pp)
        if is_moe(hf_config):
            check_moe(hf_config, tensor_parallel=tp, expert_parallel=ep)
    except (ModelConfigError, MoeConfigError) as err:  # named by the trainer's config keys: say the CLI's
        message = str(err).replace("parallel.expert_parallel", "--ep").replace("parallel.tensor_parallel", "--tp")
        raise ConversionError(message) from err
    if ep > 1 and not is_moe(hf_config):
        raise ConversionError(
            f"--ep {ep}: expert parallelism splits a mixture-of-experts model's experts, but "
            f"model_type={hf_config.get('model_type')!r} is dense (no experts); use --ep 1"
        )


def hf_to_megatron_on_rank(groups: ParallelGroups, hf_dir: str, root: str, dtype_name: str) -> None:
    """Rank body of hf -> megatron: build this rank's shard, fill it from HF, save ``root/step_00000000``."""
    ckpt = HfCheckpoint(hf_dir)
    chunks = build_model_chunks(ckpt.config, dtype_from_name(dtype_name), groups)
    load_hf_into_model(chunks, ckpt, groups)
    save_converted(root, chunks, ckpt.config, groups)


def hf_to_megatron(
    hf_dir: str | Path, out: str | Path, *, tp: int = 1, pp: int = 1, ep: int = 1, dtype: str | None = None
) -> Path:
    """Convert a HF directory into a Megatron checkpoint root ``out`` (step_00000000 + latest + tokenizer).

    Validates everything it can before spawning ranks (architecture, TP/PP/EP divisibility, missing or
    extra tensors, shapes, output path). ``ep`` > 1 (MoE models) spreads each layer's experts over EP
    ranks. Returns the step directory.
    """
    ckpt = HfCheckpoint(hf_dir)
    check_convertible(ckpt.config, tp, pp, ep)
    ckpt.validate()
    dtype = dtype or default_dtype(ckpt.config)
    dtype_from_name(dtype)
    with atomic_output_dir(out) as tmp:
        run_on_ranks(hf_to_megatron_on_rank, tp=tp, pp=pp, ep=ep, args=(str(ckpt.path), str(tmp), dtype))
        _copy_tokenizer(ckpt.path, tmp / TOKENIZER_SUBDIR)
    return resolve_step_dir(out)


def _copy_tokenizer(src: Path, dst: Path) -> None:
    files = [src / name for name in TOKENIZER_FILES if (src / name).is_file()]
    if files:
        dst.mkdir()
        for file in files:
            shutil.copy2(file, dst / file.name)


def tokenizer_dir_for(step_dir: Path, metadata: dict | None = None) -> Path | None:
    """Where the tokenizer files of a checkpoint are, if anywhere.

    Next to a converted checkpoint (root/tokenizer); for a training run's checkpoint
    (RUN_DIR/checkpoints/step_N) the model the run started from: ``model.hf_dir`` of the run config in
    the metadata, else the demo's RUN_DIR/base_model.
    """
    run_config = (metadata or {}).get("run_config") or {}
    hf_dir = (run_config.get("model") or {}).get("hf_dir")
    candidates = [step_dir / TOKENIZER_SUBDIR, step_dir.parent / TOKENIZER_SUBDIR]
    candidates += [Path(hf_dir)] if hf_dir else []
    candidates.append(step_dir.parent.parent / "base_model")
    for candidate in candidates:
        if any((candidate / name).is_file() for name in TOKENIZER_FILES):
            return candidate
    return None


def megatron_to_hf_on_rank(
    groups: ParallelGroups, step_dir: str, out_dir: str, dtype_name: str, tokenizer_dir: str | None
) -> None:
    """Rank body of megatron -> hf: load the step dir, stream the export; global rank 0 writes.

    Device tensors reach the file through one reused pinned host buffer (``save_hf_dir``).
    """
    hf_config = read_metadata(step_dir)["hf_config"]
    chunks = build_model_chunks(hf_config, dtype_from_name(dtype_name), groups)
    load_model(step_dir, chunks, groups)
    tensors = export_hf(chunks, hf_config, groups)
    if groups.rank == 0:
        save_hf_dir(tensors, out_dir, hf_config, tokenizer_dir)
    else:
        for _ in tensors:  # take part in the export's collectives
            pass


def megatron_to_hf(
    ckpt: str | Path,
    out: str | Path,
    *,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    tokenizer_dir: str | Path | None = None,
) -> Path:
    """Convert a step directory (or checkpoint root) into a HF directory at ``out``.

    Tensors keep the checkpoint's dtype; tokenizer files come from ``tokenizer_dir``, else from where
    ``tokenizer_dir_for`` finds them (next to the checkpoint, or the run's base model). ``ep`` > 1
    loads each layer's experts spread over EP ranks (with TP, each expert split over its TP ranks).
    """
    step_dir = resolve_step_dir(ckpt)
    metadata = read_metadata(step_dir)
    check_convertible(metadata["hf_config"], tp, pp, ep)
    tokenizer = Path(tokenizer_dir) if tokenizer_dir else tokenizer_dir_for(step_dir, metadata)
    out = check_output_dir(out)  # refused before any rank starts
    # Rank 0's save_hf_dir builds the directory aside and renames it into place: whole or absent.
    run_on_ranks(
        megatron_to_hf_on_rank,
        tp=tp,
        pp=pp,
        ep=ep,
        args=(str(step_dir), str(out), metadata["dtype"], str(tokenizer) if tokenizer else None),
    )
    return out
