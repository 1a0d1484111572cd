"""Checkpoints you can trust: one directory per step, written under a temporary name, ``latest`` last.

Layout (``CKPT_ROOT``)::

    step_00000042/
        metadata.json     format tag, hf_config, tp, pp, world size, dtype, padded vocab, trainer
                          state, LR-scheduler state, versions, resolved run config (or null)
        model/            megatron dist_checkpointing of the model's sharded_state_dict
        optimizer/        (optional) dist_checkpointing of the optimizer's sharded_state_dict
        rng/rank_00000.pt (optional) per-rank RNG states: python, numpy, torch CPU, CUDA, Megatron tracker
    latest                text: the newest complete step directory's name, written last

A step directory is written as ``step_XXXXXXXX.tmp`` and renamed once every rank has finished and
``metadata.json`` is in place, so a crash leaves either the old set of checkpoints or the new one,
never a directory that looks complete. The last ``keep_last`` (≥ 2) complete checkpoints are kept.

Resharding on load: dist_checkpointing reassembles tensors for any TP / PP layout. One case needs
help: Megatron pads the vocabulary to a multiple of 128 × TP, so the embedding / output weights (and
their optimizer moments) have a different global shape at another TP. Those are loaded whole and
this rank's rows are cut out of them (the padding rows, absent from Hugging Face and never scored,
are zero-filled). That path exists for the model and the regular optimizer; the distributed
optimizer's flattened shards cannot take it and get a clear error instead.

RNG states are restored only when the world size and TP/PP match the saved ones (then a resumed run
is bitwise identical to an uninterrupted one on CPU); otherwise they are left as seeded.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.optimizer import DistributedOptimizer, MegatronOptimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron_mugrpo.errors import InputError
from megatron_mugrpo.state import TrainerState

logger = logging.getLogger(__name__)

FORMAT = "megatron_mugrpo.checkpoint.v1"
STEP_FORMAT = "step_{:08d}"
TMP_SUFFIX = ".tmp"
LATEST = "latest"
MIN_KEEP_LAST = 2
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}
"""How the distributed optimizer lays out its state: resharding on load across TP, PP and DP."""
VOCAB_KEYS = ("word_embeddings.weight", "output_layer.weight")
"""Checkpoint keys (suffixes) of the vocabulary-parallel tensors whose padding depends on TP."""


class CheckpointError(InputError, RuntimeError):
    """A checkpoint is missing, truncated or incompatible; the message names the path and the fix."""


@dataclass(kw_only=True)
class LoadedCheckpoint:
    """What load_checkpoint restored."""

    step_dir: Path
    metadata: dict[str, Any]
    trainer_state: TrainerState
    loaded_optimizer: bool
    restored_rng: bool


# ------------------------------------------------------------------------------------- paths


def step_dir_name(step: int) -> str:
    return STEP_FORMAT.format(step)


def _is_complete(step_dir: Path) -> bool:
    try:
        meta = json.loads((step_dir / "metadata.json").read_text())
    except (OSError, ValueError):
        return False
    if meta.get("format") != FORMAT or not (step_dir / "model" / "metadata.json").is_file():
        return False
    return not meta.get("has_optimizer") or (step_dir / "optimizer" / "metadata.json").is_file()


def _complete_steps(root: Path) -> list[Path]:
    """Complete step directories under ``root``, oldest first."""
    if not root.is_dir():
        return []
    dirs = [p for p in root.glob("step_*") if p.is_dir() and not p.name.endswith(TMP_SUFFIX)]
    return sorted((p for p in dirs if _is_complete(p)), key=lambda p: p.name)


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest complete step directory under ``root`` (None when there is none).

    Follows the ``latest`` pointer; if it is missing or names a broken directory (a crash, a
    half-deleted copy), falls back to the newest complete step directory with a warning.
    """
    root = Path(root)
    pointer = root / LATEST
    if pointer.is_file():
        named = root / pointer.read_text().strip()
        if _is_complete(named):
            return named
        logger.warning("%s names %s, which is not a complete checkpoint; using the newest complete one", pointer, named)
    complete = _complete_steps(root)
    return complete[-1] if complete else None


def read_metadata(step_dir: str | Path) -> dict[str, Any]:
    """The step directory's metadata.json, validated; CheckpointError if missing or truncated."""
    step_dir = Path(step_dir)
    path = step_dir / "metadata.json"
    if not step_dir.is_dir():
        raise CheckpointError(
            f"checkpoint directory {step_dir} does not exist; pass a step_XXXXXXXX directory or use "
            "latest_checkpoint(root) to find the newest complete one"
        )
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(
            f"{path} is missing or unreadable ({exc}): {step_dir} is incomplete (interrupted save?); "
            f"delete it and resume from an older checkpoint (latest_checkpoint({step_dir.parent}))"
        ) from exc
    if meta.get("format") != FORMAT:
        raise CheckpointError(
            f"{path}: format {meta.get('format')!r} is not {FORMAT!r}; this is not a megatron_mugrpo checkpoint"
        )
    if not _is_complete(step_dir):
        raise CheckpointError(
            f"{step_dir} is truncated: model/ or optimizer/ lacks its metadata.json; delete it and resume "
            f"from an older checkpoint (latest_checkpoint({step_dir.parent}))"
        )
    return meta


# -------------------------------------------------------------------------------------- save


def _bare(chunk: torch.nn.Module) -> torch.nn.Module:
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def _model_sharded_state_dict(model_chunks: list[torch.nn.Module]) -> dict[str, Any]:
    if len(model_chunks) != 1:
        raise ValueError(f"checkpointing supports one model chunk per rank, got {len(model_chunks)} (no virtual PP)")
    return _bare(model_chunks[0]).sharded_state_dict(prefix="")


def _versions() -> dict[str, str]:
    import megatron.core

    import megatron_mugrpo

    return {
        "torch": torch.__version__,
        "megatron_core": getattr(megatron.core, "__version__", "unknown"),
        "megatron_mugrpo": megatron_mugrpo.__version__,
    }


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _restore_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _padded_vocab(model_chunks: list[torch.nn.Module]) -> int | None:
    model = _bare(model_chunks[0])
    for module_name in ("embedding", "output_layer"):
        module = getattr(model, module_name, None)
        if module is None:
            continue
        weight = module.word_embeddings.weight if module_name == "embedding" else module.weight
        if weight is not None:
            return int(weight.shape[0]) * parallel_state.get_tensor_model_parallel_world_size()
    return None


def _param_dtype(model_chunks: list[torch.nn.Module]) -> str:
    return str(next(_bare(model_chunks[0]).parameters()).dtype).removeprefix("torch.")


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


_WRITER_MANAGER: Any = None
PR_SET_PDEATHSIG = 1
"""prctl option: the kernel sends a signal to this process when its parent dies (Linux)."""


def _die_with_parent() -> None:
    """Initializer of the results-queue server: SIGKILL it when the training process dies."""
    import contextlib
    import ctypes
    import signal

    # Not Linux (no prctl): the server outlives a killed trainer, as it does in plain Megatron.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _writer_queue_dies_with_this_process() -> None:
    """Give Megatron's checkpoint writer a results queue whose server process dies with us.

    megatron-core's torch_dist writer lazily starts a ``multiprocessing.Manager`` server for its
    results queue. When the trainer is SIGKILLed that server is orphaned and lives on, holding the
    trainer's stdout/stderr open (a launcher reading them never sees EOF). We start the same kind of
    server ourselves with a parent-death signal and hand its queue to Megatron's module slot.
    """
    global _WRITER_MANAGER
    try:
        from megatron.core.dist_checkpointing.strategies import filesystem_async
    except ImportError:
        return
    if _WRITER_MANAGER is not None or getattr(filesystem_async, "_results_queue", "absent") is not None:
        return  # already installed, or this megatron-core version manages the queue differently
    import multiprocessing as mp
    from multiprocessing.managers import SyncManager

    manager = SyncManager(ctx=mp.get_context("spawn"))
    manager.start(initializer=_die_with_parent)
    _WRITER_MANAGER = manager  # the server lives as long as this reference
    filesystem_async._results_queue = manager.Queue()


def save_checkpoint(
    root: str | Path,
    step: int,
    model_chunks: list[torch.nn.Module],
    *,
    hf_config: dict[str, Any],
    optimizer: MegatronOptimizer | None = None,
    scheduler: OptimizerParamScheduler | None = None,
    trainer_state: TrainerState | None = None,
    run_config: dict[str, Any] | None = None,
    save_rng: bool = True,
    keep_last: int = MIN_KEEP_LAST,
    keep: Collection[int] = (),
    write_extra: Callable[[Path], None] | None = None,
) -> Path:
    """Write ``root/step_XXXXXXXX`` (collective: every rank calls it) and return its path.

    The newest ``keep_last`` complete checkpoints survive pruning, and so do the steps in ``keep``
    (e.g. the best one by evaluation). ``write_extra`` (rank 0) adds files of other components (the
    replay buffer) to the temporary step directory before it is completed and published, so they
    appear atomically with the model.

    ``model_chunks`` may be DDP-wrapped or bare GPTModels. Without ``optimizer`` the directory is
    model-only (what ``mugrpo convert hf-to-megatron`` writes). Synchronous: dist_checkpointing's
    async writer is not used, so nothing is left running when this returns.
    """
    if keep_last < MIN_KEEP_LAST:
        raise ValueError(f"keep_last={keep_last} must be >= {MIN_KEEP_LAST} so a crash while writing leaves a good one")
    root = Path(root)
    final, tmp = root / step_dir_name(step), root / (step_dir_name(step) + TMP_SUFFIX)
    if _is_rank0():
        if tmp.exists():
            shutil.rmtree(tmp)  # leftover of an interrupted save of the same step
        for sub in ("model", "optimizer" if optimizer is not None else None, "rng" if save_rng else None):
            if sub:
                (tmp / sub).mkdir(parents=True)
    _barrier()
    _writer_queue_dies_with_this_process()
    dist_checkpointing.save(_model_sharded_state_dict(model_chunks), str(tmp / "model"))
    if optimizer is not None:
        opt_sd = optimizer.sharded_state_dict(
            _model_sharded_state_dict(model_chunks), is_loading=False, metadata=OPTIMIZER_METADATA
        )
        dist_checkpointing.save(opt_sd, str(tmp / "optimizer"))
    if save_rng:
        rank = dist.get_rank() if dist.is_initialized() else 0
        torch.save(_rng_state(), tmp / "rng" / f"rank_{rank:05d}.pt")
    _barrier()
    if _is_rank0():
        if write_extra is not None:
            write_extra(tmp)
        metadata = _metadata(model_chunks, hf_config, optimizer, scheduler, trainer_state, run_config)
        (tmp / "metadata.json").write_text(json.dumps(metadata, indent=2, default=str))
        _publish(root, tmp, final, keep_last, keep)
    _barrier()
    return final


def _metadata(
    model_chunks: list[torch.nn.Module],
    hf_config: dict[str, Any],
    optimizer: MegatronOptimizer | None,
    scheduler: OptimizerParamScheduler | None,
    trainer_state: TrainerState | None,
    run_config: dict[str, Any] | None,
) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "hf_config": hf_config,
        "tp": parallel_state.get_tensor_model_parallel_world_size(),
        "pp": parallel_state.get_pipeline_model_parallel_world_size(),
        "world_size": dist.get_world_size() if dist.is_initialized() else 1,
        "dtype": _param_dtype(model_chunks),
        "padded_vocab_size": _padded_vocab(model_chunks),
        "has_optimizer": optimizer is not None,
        "distributed_optimizer": _is_distributed(optimizer),
        "optimizer_metadata": OPTIMIZER_METADATA,
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "trainer_state": (trainer_state or TrainerState()).to_dict(),
        "versions": _versions(),
        "run_config": run_config,
    }


def _is_distributed(optimizer: MegatronOptimizer | None) -> bool:
    if optimizer is None:
        return False
    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    return any(isinstance(part, DistributedOptimizer) for part in parts)


def _publish(root: Path, tmp: Path, final: Path, keep_last: int, keep: Collection[int] = ()) -> None:
    """Rank 0: rename tmp → final, point ``latest`` at it (atomic replace), prune old ones."""
    if final.exists():  # re-saving a step: the new copy replaces the old one
        shutil.rmtree(final)
    os.replace(tmp, final)
    pointer_tmp = root / (LATEST + TMP_SUFFIX)
    pointer_tmp.write_text(final.name + "\n")
    os.replace(pointer_tmp, root / LATEST)
    protected = {step_dir_name(step) for step in keep}
    for old in _complete_steps(root)[:-keep_last]:
        if old.name not in protected:
            shutil.rmtree(old, ignore_errors=True)


# -------------------------------------------------------------------------------------- load


def _walk(tree: Any, path: tuple = ()) -> Any:
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _walk(value, (*path, key))
    elif isinstance(tree, list):
        for index, value in enumerate(tree):
            yield from _walk(value, (*path, index))
    else:
        yield path, tree


def _set_path(tree: Any, path: tuple, value: Any) -> None:
    for key in path[:-1]:
        tree = tree[key]
    tree[path[-1]] = value


def _get_path(tree: Any, path: tuple) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def _reshape_vocab_tensors(sharded_sd: dict[str, Any], ckpt_dir: Path) -> dict[tuple, ShardedTensor]:
    """Swap vocab-parallel ShardedTensors whose padded size differs from the saved one for whole-tensor loads.

    Returns {path in the state dict: the original ShardedTensor} for ``_cut_vocab_rows``.
    """
    saved = None
    replaced: dict[tuple, ShardedTensor] = {}
    for path, value in list(_walk(sharded_sd)):
        if not isinstance(value, ShardedTensor) or not value.key.endswith(VOCAB_KEYS):
            continue
        if saved is None:
            saved = dist_checkpointing.load_tensors_metadata(str(ckpt_dir))
        if value.key not in saved or tuple(saved[value.key].global_shape) == tuple(value.global_shape):
            continue
        saved_shape = tuple(saved[value.key].global_shape)
        if value.flattened_range is not None or saved_shape[1:] != tuple(value.global_shape[1:]):
            raise CheckpointError(
                f"{ckpt_dir}: {value.key} was saved with shape {saved_shape} but this model has "
                f"{tuple(value.global_shape)}; the vocabulary padding changed with TP and this state "
                "(distributed-optimizer shards) cannot be resharded — load it at the saved TP, or load "
                "the model only (optimizer=None)"
            )
        whole = torch.empty(saved_shape, dtype=value.data.dtype, device=value.data.device)
        # Every rank reads the whole tensor; exactly one of them counts as the main replica.
        replica = dist.get_rank() if dist.is_initialized() else 0
        _set_path(sharded_sd, path, ShardedTensor.from_rank_offsets(value.key, whole, replica_id=replica))
        replaced[path] = value
    return replaced


def _cut_vocab_rows(loaded: dict[str, Any], replaced: dict[tuple, ShardedTensor]) -> None:
    """Replace each whole loaded vocab tensor by this rank's rows (padding rows zero-filled)."""
    for path, original in replaced.items():
        whole = _get_path(loaded, path)
        local = torch.zeros_like(original.data)
        start = original.global_offset[0]
        rows = max(0, min(local.shape[0], whole.shape[0] - start))
        local[:rows] = whole[start : start + rows]
        _set_path(loaded, path, local)


def _load_tree(sharded_sd: dict[str, Any], ckpt_dir: Path) -> dict[str, Any]:
    replaced = _reshape_vocab_tensors(sharded_sd, ckpt_dir)
    try:
        loaded = dist_checkpointing.load(sharded_sd, str(ckpt_dir))
    except CheckpointError:
        raise
    except Exception as exc:  # dist_checkpointing raises many types; name the directory and the fix
        raise CheckpointError(
            f"failed to load {ckpt_dir} ({type(exc).__name__}: {exc}); the directory may be truncated or "
            "the model architecture differs from the saved one (compare metadata.json's hf_config)"
        ) from exc
    _cut_vocab_rows(loaded, replaced)
    return loaded


def load_checkpoint(
    step_dir: str | Path,
    model_chunks: list[torch.nn.Module],
    optimizer: MegatronOptimizer | None = None,
    scheduler: OptimizerParamScheduler | None = None,
    *,
    load_rng: bool = True,
) -> LoadedCheckpoint:
    """Load a step directory into the (DDP-wrapped or bare) model chunks, resharding as needed.

    With ``optimizer``: its state is loaded when the checkpoint has one; for a model-only checkpoint
    (e.g. a converted Hugging Face model) the optimizer keeps fresh moments and re-reads its main
    parameters from the loaded weights. Collective: every rank calls it.
    """
    step_dir = Path(step_dir)
    meta = read_metadata(step_dir)
    model = _bare(model_chunks[0])
    loaded = _load_tree(_model_sharded_state_dict(model_chunks), step_dir / "model")
    model.load_state_dict(loaded, strict=True)
    loaded_optimizer = False
    if optimizer is not None:
        if meta["has_optimizer"]:
            opt_sd = optimizer.sharded_state_dict(
                _model_sharded_state_dict(model_chunks), is_loading=True, metadata=meta["optimizer_metadata"]
            )
            optimizer.load_state_dict(_load_tree(opt_sd, step_dir / "optimizer"))
            loaded_optimizer = True
        else:
            optimizer.reload_model_params()
    if scheduler is not None and meta.get("scheduler"):
        scheduler.load_state_dict(meta["scheduler"])
    restored_rng = load_rng and _maybe_restore_rng(step_dir, meta)
    _barrier()
    return LoadedCheckpoint(
        step_dir=step_dir,
        metadata=meta,
        trainer_state=TrainerState.from_dict(meta["trainer_state"]),
        loaded_optimizer=loaded_optimizer,
        restored_rng=restored_rng,
    )


def _maybe_restore_rng(step_dir: Path, meta: dict[str, Any]) -> bool:
    world = dist.get_world_size() if dist.is_initialized() else 1
    same_layout = (meta["world_size"], meta["tp"], meta["pp"]) == (
        world,
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_pipeline_model_parallel_world_size(),
    )
    rank = dist.get_rank() if dist.is_initialized() else 0
    path = step_dir / "rng" / f"rank_{rank:05d}.pt"
    if not same_layout or not path.is_file():
        return False
    _restore_rng(torch.load(path, weights_only=False))
    return True
