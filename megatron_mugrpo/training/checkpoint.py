"""Checkpoints you can trust: one directory per step, checksummed, written under a temporary name, ``latest`` last.

Layout (``CKPT_ROOT``)::

    step_00000042/
        metadata.json     format tag, hf_config, tp, pp, world size, dtype, padded vocab, trainer
                          state, LR-scheduler state, versions, resolved run config (or null)
        model/            megatron dist_checkpointing (torch_dist) of the model's sharded_state_dict
        optimizer/        (optional) dist_checkpointing of the optimizer's sharded_state_dict
        rng/rank_00000.pt (optional) per-rank RNG states: python, numpy, torch CPU, CUDA, Megatron tracker
        manifest.json     checksum (xxHash3-128) and size of every other file of the directory, written last
    latest                text: the newest complete step directory's name, written after the rename

A step directory is written as ``step_XXXXXXXX.tmp`` and renamed once every rank has finished and
``metadata.json`` and ``manifest.json`` are in place, so a crash leaves either the old set of
checkpoints or the new one, never a directory that looks complete. The last ``keep_last`` (≥ 2)
complete checkpoints are kept, plus any step passed in ``keep``.

Integrity: the writer threads hash every file as they write it; ``load_checkpoint`` checks every file
against the manifest before it touches the model (each rank hashes a share of the files), and names
the damaged file (bit flip, truncation, missing). A directory without a manifest fails verification
unless the caller passes ``trust_unverified=True``. ``load_latest_intact`` is what resuming uses: it
falls back, with a warning, to the newest checkpoint that passes, and raises ``CheckpointError``
when none does.

Speed: the bytes move through ``training.checkpoint_writer`` and ``checkpoint_reader`` (writer
threads with checksums and one fsync per file; reads straight into the parameters).
``CheckpointSaver(async_save=True)`` copies the state to host buffers and returns; threads write
while training continues, and the directory is published (renamed, ``latest`` updated) at the first
``poll()`` / ``wait()`` after every rank has finished.

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

import io
import json
import logging
import random
import shutil
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from megatron.core import dist_checkpointing, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
from megatron.core.optimizer import DistributedOptimizer, MegatronOptimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from torch.distributed.checkpoint.api import CheckpointException

from megatron_mugrpo import durable
from megatron_mugrpo.errors import InputError
from megatron_mugrpo.state import TrainerState
from megatron_mugrpo.training.checkpoint_async import ThreadAsyncCallsQueue
from megatron_mugrpo.training.checkpoint_digests import CHECKSUM, DEFAULT_THREADS, FileDigest, bytes_digest, hash_files
from megatron_mugrpo.training.checkpoint_reader import DirectLoadStrategy
from megatron_mugrpo.training.checkpoint_writer import ThreadedSaveStrategy
from megatron_mugrpo.training.model import unwrap_model
from megatron_mugrpo.training.parallel import ParallelGroups

logger = logging.getLogger(__name__)

FORMAT = "megatron_mugrpo.checkpoint.v1"
MANIFEST = "manifest.json"
MANIFEST_FORMAT = "megatron_mugrpo.checkpoint.manifest.v1"
STEP_FORMAT = "step_{:08d}"
TMP_SUFFIX = durable.TMP_SUFFIX
LATEST = "latest"
MIN_KEEP_LAST = 2
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}
"""How the distributed optimizer lays out its state: resharding on load across TP, PP and DP."""
VOCAB_KEYS = ("word_embeddings.weight", "output_layer.weight")
"""Checkpoint keys (suffixes) of the vocabulary-parallel tensors whose padding depends on TP."""


class CheckpointError(InputError, RuntimeError):
    """A checkpoint is missing, damaged or incompatible; the message names the path and the fix."""


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
    """Cheap structural check (no hashing): metadata, the dist_checkpointing metadata and the manifest exist."""
    try:
        meta = json.loads((step_dir / "metadata.json").read_text())
    except (OSError, ValueError):
        return False
    if meta.get("format") != FORMAT or not (step_dir / "model" / "metadata.json").is_file():
        return False
    if meta.get("manifest") and not (step_dir / MANIFEST).is_file():
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
    half-deleted copy), falls back to the newest complete step directory with a warning. Checks
    structure only; ``load_latest_intact`` also verifies the checksums.
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
            f"{step_dir} is truncated: model/, optimizer/ or {MANIFEST} is missing; delete it and resume "
            f"from an older checkpoint (latest_checkpoint({step_dir.parent}))"
        )
    return meta


# ---------------------------------------------------------------------------- collectives


def _agreed(problem: str | None, groups: ParallelGroups) -> str | None:
    """Every rank's view of a per-rank failure: the first rank's message, or None when all succeeded.

    Per-rank steps (reading an RNG file, a writer thread) fail on one rank only; ranks must still
    take the same branch afterwards, or the next collective would hang.
    """
    return next((p for p in groups.all_gather(problem) if p), None)


# -------------------------------------------------------------------------------------- save


def _model_sharded_state_dict(model_chunks: list[torch.nn.Module]) -> dict[str, Any]:
    if len(model_chunks) != 1:
        raise ValueError(f"checkpointing supports one model chunk per rank, got {len(model_chunks)} (no virtual PP)")
    return unwrap_model(model_chunks[0]).sharded_state_dict(prefix="")


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


def _padded_vocab(model_chunks: list[torch.nn.Module], groups: ParallelGroups) -> int | None:
    model = unwrap_model(model_chunks[0])
    for module_name in ("embedding", "output_layer"):
        module = getattr(model, module_name, None)
        if module is None:
            continue
        weight = module.word_embeddings.weight if module_name == "embedding" else module.weight
        if weight is not None:
            return int(weight.shape[0]) * groups.tp
    return None


def _param_dtype(model_chunks: list[torch.nn.Module]) -> str:
    return str(next(unwrap_model(model_chunks[0]).parameters()).dtype).removeprefix("torch.")


def _is_distributed(optimizer: MegatronOptimizer | None) -> bool:
    if optimizer is None:
        return False
    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    return any(isinstance(part, DistributedOptimizer) for part in parts)


def _metadata(
    model_chunks: list[torch.nn.Module],
    groups: ParallelGroups,
    hf_config: dict[str, Any],
    optimizer: MegatronOptimizer | None,
    scheduler: OptimizerParamScheduler | None,
    trainer_state: TrainerState | None,
    run_config: dict[str, Any] | None,
) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "hf_config": hf_config,
        "tp": groups.tp,
        "pp": groups.pp,
        "ep": groups.ep,
        "etp": groups.etp,
        "world_size": groups.world_size,
        "dtype": _param_dtype(model_chunks),
        "padded_vocab_size": _padded_vocab(model_chunks, groups),
        "has_optimizer": optimizer is not None,
        "distributed_optimizer": _is_distributed(optimizer),
        "optimizer_metadata": OPTIMIZER_METADATA,
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "trainer_state": (trainer_state or TrainerState()).to_dict(),
        "versions": _versions(),
        "run_config": run_config,
        "manifest": MANIFEST,
    }


class CheckpointSaver:
    """Writes step directories under ``root``, one at a time, synchronously or in the background.

    With ``async_save`` the state is copied to host buffers (kept between saves: host memory of one
    copy of this rank's model and optimizer state) and ``save`` returns; writer threads write and
    hash the files while training continues. The directory is published (manifest, rename,
    ``latest``, pruning) by the first ``poll()`` or ``wait()`` after every rank has finished: call
    ``poll()`` regularly (it costs one small all-reduce while a save is pending) and ``close()`` at
    the end. A crash before publication leaves the previous checkpoint as ``latest``.

    Every method is collective: all ranks call it, in the same order.

    Args:
        root: checkpoint root (step directories and ``latest``).
        groups: this rank's process groups (TP / PP sizes go into metadata.json).
        async_save: write in the background (see above); otherwise ``save`` returns once published.
        fsync: fsync every file once, and the directories, before publishing (durable on power loss).
        thread_count: writer threads, and files, per rank and state dict.
        keep_last: complete checkpoints kept (≥ 2, so a crash while writing leaves a good one).
    """

    def __init__(
        self,
        root: str | Path,
        *,
        groups: ParallelGroups,
        async_save: bool = False,
        fsync: bool = True,
        thread_count: int = DEFAULT_THREADS,
        keep_last: int = MIN_KEEP_LAST,
    ) -> None:
        if keep_last < MIN_KEEP_LAST:
            raise ValueError(
                f"keep_last={keep_last} must be >= {MIN_KEEP_LAST} so a crash while writing leaves a good one"
            )
        if thread_count < 1:
            raise ValueError(f"thread_count={thread_count} must be >= 1")
        self.root = Path(root)
        self.groups = groups
        self.async_save = async_save
        self.fsync = fsync
        self.keep_last = keep_last
        strategy = lambda: ThreadedSaveStrategy(  # noqa: E731 - two identical strategies
            groups=groups, thread_count=thread_count, fsync=fsync, snapshot=async_save
        )
        # One strategy per state dict: each keeps its own host buffers (async) between saves.
        self._model_strategy, self._optimizer_strategy = strategy(), strategy()
        self._queue = ThreadAsyncCallsQueue(groups)
        self._pending: dict[int, Path] = {}

    @property
    def pending(self) -> list[Path]:
        """Step directories written (or being written) but not yet published."""
        return list(self._pending.values())

    def save(
        self,
        step: int,
        model_chunks: list[torch.nn.Module],
        *,
        hf_config: dict[str, Any],
        optimizer: MegatronOptimizer | None = None,
        scheduler: OptimizerParamScheduler | None = None,
        trainer_state: TrainerState | None = None,
        run_config: dict[str, Any] | None = None,
        save_rng: bool = True,
        keep: Collection[int] = (),
        write_extra: Callable[[Path], None] | None = None,
    ) -> Path:
        """Start writing ``root/step_XXXXXXXX`` (finishing any earlier save first); returns its final path.

        Everything that describes the state (trainer state, scheduler, RNG) is captured now, so the
        caller may change it right after. ``keep``: steps pruning must spare (e.g. the best one).
        ``write_extra`` (rank 0, called now) adds other components' files (the replay buffer) to the
        step directory; the manifest checksums them and they are published with the model.
        """
        self.wait()
        final, tmp = self.root / step_dir_name(step), self.root / (step_dir_name(step) + TMP_SUFFIX)
        if self.groups.rank == 0:
            if tmp.exists():
                shutil.rmtree(tmp)  # leftover of an interrupted save of the same step
            for sub in ("model", "optimizer" if optimizer is not None else None, "rng" if save_rng else None):
                if sub:
                    (tmp / sub).mkdir(parents=True)
            if write_extra is not None:
                write_extra(tmp)
        self.groups.barrier()
        metadata = _metadata(model_chunks, self.groups, hf_config, optimizer, scheduler, trainer_state, run_config)
        parts = [(self._model_strategy, "model", _model_sharded_state_dict(model_chunks))]
        if optimizer is not None:
            opt_sd = optimizer.sharded_state_dict(
                _model_sharded_state_dict(model_chunks), is_loading=False, metadata=OPTIMIZER_METADATA
            )
            parts.append((self._optimizer_strategy, "optimizer", opt_sd))
        requests = [
            dist_checkpointing.save(sd, str(tmp / sub), sharded_strategy=strategy, async_sharded_save=True)
            for strategy, sub, sd in parts
        ]
        own = [self._save_rng(tmp)] if save_rng else []
        publish = _Publication(
            saver=self, tmp=tmp, final=final, metadata=metadata, parts=parts, own=own, keep=tuple(keep)
        )
        call = self._queue.schedule_async_request(_combined(requests, publish))
        self._pending[call] = final
        if not self.async_save:
            self.wait()
        return final

    def _save_rng(self, tmp: Path) -> FileDigest:
        buffer = io.BytesIO()
        torch.save(_rng_state(), buffer)
        relative = f"rng/rank_{self.groups.rank:05d}.pt"
        durable.atomic_write_bytes(tmp / relative, buffer.getvalue(), fsync=self.fsync)
        return bytes_digest(relative, buffer.getvalue())

    def poll(self) -> list[Path]:
        """Publish the saves every rank has finished writing; returns their step directories."""
        return [self._pending.pop(i) for i in self._queue.maybe_finalize_async_calls(blocking=False)]

    def wait(self) -> list[Path]:
        """Wait for every pending save and publish it; returns the published step directories."""
        return [self._pending.pop(i) for i in self._queue.maybe_finalize_async_calls(blocking=True)]

    def close(self) -> None:
        """Finish pending saves (publishing them); the saver can still be used afterwards."""
        self.wait()


def _combined(requests: list[AsyncRequest], publish: _Publication) -> AsyncRequest:
    """One request writing every state dict of a step; snapshots (async) are taken here, in the caller."""
    calls = []
    for request in requests:
        if request.preload_fn is not None:
            request.preload_fn()  # the snapshot (async saves): the strategy's writer keeps it
        if request.async_fn is not None:
            calls.append((request.async_fn, request.async_fn_args, request.async_fn_kwargs))

    def write_all() -> None:
        try:
            for fn, args, kwargs in calls:
                fn(*args, **kwargs)
        except BaseException as err:  # reported on every rank by publish.check_writes
            publish.write_error = f"{type(err).__name__}: {err}"

    finalize = [publish.check_writes, *(fn for request in requests for fn in request.finalize_fns), publish]
    return AsyncRequest(write_all, (), finalize)


@dataclass
class _Publication:
    """The last act of a save, run by every rank once all have written: manifest, rename, ``latest``."""

    saver: CheckpointSaver
    tmp: Path
    final: Path
    metadata: dict[str, Any]
    parts: list[tuple[ThreadedSaveStrategy, str, Any]]
    own: list[FileDigest]
    """Files this rank wrote outside the strategies (its RNG file)."""
    keep: tuple[int, ...]
    write_error: str | None = None

    def check_writes(self) -> None:
        groups = self.saver.groups
        problem = _agreed(self.write_error and f"rank {groups.rank}: {self.write_error}", groups)
        if problem:
            raise CheckpointError(f"writing checkpoint {self.tmp} failed ({problem}); {self.final} was not published")

    def __call__(self) -> None:
        digests = list(self.own)
        for strategy, sub, _ in self.parts:
            digests += [FileDigest(f"{sub}/{d.path}", d.checksum, d.nbytes) for d in strategy.digests()]
        gathered = [d for rank_digests in self.saver.groups.all_gather(digests) for d in rank_digests]
        if self.saver.groups.rank == 0:
            fsync = self.saver.fsync
            durable.atomic_write_json(self.tmp / "metadata.json", self.metadata, indent=2, default=str, fsync=fsync)
            write_manifest(self.tmp, gathered, fsync=fsync)
            _publish(self.saver.root, self.tmp, self.final, self.saver.keep_last, self.keep, fsync=fsync)
        self.saver.groups.barrier()


def write_manifest(step_dir: Path, known: list[FileDigest], *, fsync: bool) -> None:
    """Write ``step_dir/manifest.json``: checksum (``CHECKSUM``) and size of every file in it.

    ``known`` digests (computed by the writer threads) are trusted; the remaining files — small
    metadata files that megatron-core writes itself — are hashed here (and fsynced when asked).
    """
    files = {d.path: {"checksum": d.checksum, "bytes": d.nbytes} for d in known}
    others = sorted(p for p in step_dir.rglob("*") if p.is_file() and p.relative_to(step_dir).as_posix() not in files)
    for path, result in hash_files(others).items():
        if isinstance(result, OSError):
            raise CheckpointError(f"cannot read {path} to checksum it: {result}")
        files[path.relative_to(step_dir).as_posix()] = {"checksum": result[0], "bytes": result[1]}
        if fsync:
            durable.fsync_file(path)
    manifest = {"format": MANIFEST_FORMAT, "algorithm": CHECKSUM, "files": dict(sorted(files.items()))}
    durable.atomic_write_json(step_dir / MANIFEST, manifest, fsync=fsync)


def _publish(root: Path, tmp: Path, final: Path, keep_last: int, keep: Collection[int], *, fsync: bool) -> None:
    """Rank 0: rename tmp → final, point ``latest`` at it (atomic replace), prune old and stale ones.

    With ``fsync`` every file is already durable; the directories are fsynced before the rename and
    the rename before ``latest`` is written, so ``latest`` never names a step a power loss could undo."""
    if fsync:
        for directory in (tmp, *(p for p in tmp.iterdir() if p.is_dir())):
            durable.fsync_dir(directory)
    if final.exists():  # re-saving a step: the new copy replaces the old one
        shutil.rmtree(final)
    durable.replace(tmp, final, fsync=fsync)
    durable.atomic_write_text(root / LATEST, final.name + "\n", fsync=fsync)
    protected = {step_dir_name(step) for step in keep}
    for old in _complete_steps(root)[:-keep_last]:
        if old.name not in protected:
            shutil.rmtree(old, ignore_errors=True)
    for stale in root.glob(f"step_*{TMP_SUFFIX}"):  # saves killed before publication (one runs at a time)
        shutil.rmtree(stale, ignore_errors=True)


def save_checkpoint(
    root: str | Path,
    step: int,
    model_chunks: list[torch.nn.Module],
    *,
    groups: ParallelGroups,
    hf_config: dict[str, Any],
    optimizer: MegatronOptimizer | None = None,
    scheduler: OptimizerParamScheduler | None = None,
    trainer_state: TrainerState | None = None,
    run_config: dict[str, Any] | None = None,
    save_rng: bool = True,
    keep_last: int = MIN_KEEP_LAST,
    keep: Collection[int] = (),
    fsync: bool = True,
) -> Path:
    """Write ``root/step_XXXXXXXX`` synchronously (collective: every rank calls it) and return its path.

    ``model_chunks`` may be DDP-wrapped or bare GPTModels. Without ``optimizer`` the directory is
    model-only (what ``mugrpo convert hf-to-megatron`` writes). See ``CheckpointSaver`` for the
    background variant; nothing is left running when this returns.
    """
    saver = CheckpointSaver(root, groups=groups, fsync=fsync, keep_last=keep_last)
    return saver.save(
        step,
        model_chunks,
        hf_config=hf_config,
        optimizer=optimizer,
        scheduler=scheduler,
        trainer_state=trainer_state,
        run_config=run_config,
        save_rng=save_rng,
        keep=keep,
    )


# ------------------------------------------------------------------------------ integrity


def _read_manifest(step_dir: Path) -> tuple[str, dict[str, dict[str, Any]]]:
    """(checksum algorithm, {relative path: {"checksum", "bytes"}}) of a step directory's manifest.

    Pre-release manifests are read through ``durable.Checksum.split_record`` (its one home).
    """
    path = step_dir / MANIFEST
    try:
        manifest = json.loads(path.read_text())
        files, algorithm = manifest["files"], manifest.get("algorithm", durable.PRE_RELEASE_ALGORITHM)
        if manifest.get("format") != MANIFEST_FORMAT or not isinstance(files, dict):
            raise ValueError(f"format {manifest.get('format')!r}")
        if algorithm not in durable.CHECKSUMS:
            raise ValueError(f"checksum algorithm {algorithm!r} is not one of {sorted(durable.CHECKSUMS)}")
        split = {name: durable.Checksum.split_record(entry, algorithm) for name, entry in files.items()}
        files = {
            name: {"checksum": checksum.hexdigest, "bytes": rest["bytes"]} for name, (checksum, rest) in split.items()
        }
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"{path} is missing or unreadable ({exc}); {step_dir} cannot be verified") from exc
    return algorithm, files


def _unverifiable(step_dir: Path) -> str:
    return (
        f"{step_dir} has no checksum manifest ({step_dir / 'metadata.json'} names none: it was written before "
        "manifests existed, or by another tool), so its files cannot be verified. Pass trust_unverified=True "
        "to verify_checkpoint / load_checkpoint / load_latest_intact to load it as it is, then save it again "
        f"to give it a {MANIFEST}"
    )


def _file_problems(step_dir: Path, algorithm: str, entries: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """What is wrong with each listed file (missing, wrong size, wrong checksum); empty when all are intact."""
    problems, to_hash = [], []
    for relative, expected in entries:
        path = step_dir / relative
        try:
            size = path.stat().st_size
        except OSError:
            problems.append(f"{relative} is missing")
            continue
        if size != expected["bytes"]:
            kind = "truncated" if size < expected["bytes"] else "too long"
            problems.append(f"{relative} is {kind} ({size} of {expected['bytes']} bytes)")
        else:
            to_hash.append((relative, path, expected["checksum"]))
    results = hash_files([path for _, path, _ in to_hash], algorithm=algorithm)
    for relative, path, digest in to_hash:
        result = results[path]
        if isinstance(result, OSError):
            problems.append(f"{relative} is unreadable ({result})")
        elif result[0] != digest:
            problems.append(f"{relative} fails its {algorithm} check (corrupted)")
    return problems


def verify_checkpoint(
    step_dir: str | Path, *, groups: ParallelGroups | None = None, trust_unverified: bool = False
) -> None:
    """Check every file of ``step_dir`` against its manifest; CheckpointError naming the bad files.

    Collective when ``groups`` is given: rank r hashes files r, r + world, ... and the ranks share
    their findings, so all raise (or pass) together.

    A directory without a manifest (metadata.json names none: written before checksums existed, or
    by another tool) cannot be verified and raises CheckpointError naming it and the fix, unless
    ``trust_unverified=True``: then it passes with a logged warning, and damage surfaces (still as a
    CheckpointError) only while loading.
    """
    step_dir = Path(step_dir)
    meta = read_metadata(step_dir)
    if not meta.get("manifest"):
        if not trust_unverified:
            raise CheckpointError(_unverifiable(step_dir))
        logger.warning("%s was written without a checksum manifest; its files are not verified", step_dir)
        return
    algorithm, files = _read_manifest(step_dir)
    entries = sorted(files.items())
    groups = groups or ParallelGroups.local()
    mine = _file_problems(step_dir, algorithm, entries[groups.rank :: groups.world_size])
    problems = [p for rank_problems in groups.all_gather(mine) for p in rank_problems]
    if problems:
        raise CheckpointError(f"checkpoint {step_dir} is damaged: {'; '.join(problems)}")


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


def _reshape_vocab_tensors(sharded_sd: dict[str, Any], ckpt_dir: Path, rank: int) -> dict[tuple, ShardedTensor]:
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
        _set_path(sharded_sd, path, ShardedTensor.from_rank_offsets(value.key, whole, replica_id=rank))
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


def _load_tree(sharded_sd: dict[str, Any], ckpt_dir: Path, groups: ParallelGroups) -> dict[str, Any]:
    replaced = _reshape_vocab_tensors(sharded_sd, ckpt_dir, groups.rank)
    try:
        strategy = DirectLoadStrategy(groups=groups)
        loaded = dist_checkpointing.load(sharded_sd, str(ckpt_dir), sharded_strategy=strategy)
    except CheckpointError:
        raise
    # dist_checkpointing raises many types, and torch's CheckpointException derives from BaseException
    # (not Exception): catch both, name the directory and the fix.
    except (Exception, CheckpointException) as exc:
        raise CheckpointError(
            f"failed to load {ckpt_dir} ({type(exc).__name__}: {exc}); the directory may be damaged or "
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
    groups: ParallelGroups,
    load_rng: bool = True,
    verify: bool = True,
    trust_unverified: bool = False,
) -> LoadedCheckpoint:
    """Load a step directory into the (DDP-wrapped or bare) model chunks, resharding as needed.

    With ``verify`` (default) every file is checked against the manifest first, so a damaged
    checkpoint raises CheckpointError naming the file before anything is overwritten; a directory
    without a manifest raises too unless ``trust_unverified`` (see ``verify_checkpoint``). With
    ``optimizer``: its state is loaded when the checkpoint has one; for a model-only checkpoint (e.g.
    a converted Hugging Face model) the optimizer keeps fresh moments and re-reads its main
    parameters from the loaded weights. Collective: every rank calls it.
    """
    step_dir = Path(step_dir)
    meta = read_metadata(step_dir)
    if verify:
        verify_checkpoint(step_dir, groups=groups, trust_unverified=trust_unverified)
    model = unwrap_model(model_chunks[0])
    loaded = _load_tree(_model_sharded_state_dict(model_chunks), step_dir / "model", groups)
    model.load_state_dict(loaded, strict=True)
    loaded_optimizer = False
    if optimizer is not None:
        if meta["has_optimizer"]:
            opt_sd = optimizer.sharded_state_dict(
                _model_sharded_state_dict(model_chunks), is_loading=True, metadata=meta["optimizer_metadata"]
            )
            optimizer.load_state_dict(_load_tree(opt_sd, step_dir / "optimizer", groups))
            loaded_optimizer = True
        else:
            optimizer.reload_model_params()
    if scheduler is not None and meta.get("scheduler"):
        scheduler.load_state_dict(meta["scheduler"])
    restored_rng = load_rng and _maybe_restore_rng(step_dir, meta, groups)
    groups.barrier()
    return LoadedCheckpoint(
        step_dir=step_dir,
        metadata=meta,
        trainer_state=TrainerState.from_dict(meta["trainer_state"]),
        loaded_optimizer=loaded_optimizer,
        restored_rng=restored_rng,
    )


def _maybe_restore_rng(step_dir: Path, meta: dict[str, Any], groups: ParallelGroups) -> bool:
    """Restore this rank's RNG states when the layout matches; CheckpointError (on every rank) if unreadable."""
    # Checkpoints written before expert tensor parallelism lack "ep" / "etp": EP 1, expert TP = TP.
    saved = (meta["world_size"], meta["tp"], meta["pp"], meta.get("ep", 1), meta.get("etp", meta["tp"]))
    same_layout = saved == (groups.world_size, groups.tp, groups.pp, groups.ep, groups.etp)
    path = step_dir / "rng" / f"rank_{groups.rank:05d}.pt"
    if not same_layout or not path.is_file():
        return False
    state, problem = None, None
    try:
        state = torch.load(path, weights_only=False)
    except Exception as exc:  # a damaged pickle raises almost anything
        problem = f"{path} is unreadable ({type(exc).__name__}: {exc})"
    problem = _agreed(problem, groups)
    if problem:
        raise CheckpointError(f"checkpoint {step_dir} is damaged: {problem}")
    _restore_rng(state)
    return True


def load_latest_intact(
    root: str | Path,
    model_chunks: list[torch.nn.Module],
    optimizer: MegatronOptimizer | None = None,
    scheduler: OptimizerParamScheduler | None = None,
    *,
    groups: ParallelGroups,
    load_rng: bool = True,
    warn: Callable[[str], None] | None = None,
    trust_unverified: bool = False,
) -> LoadedCheckpoint | None:
    """Load the newest checkpoint under ``root`` that passes verification (None when there is none).

    Starts from the ``latest`` pointer and walks back through older complete step directories; each
    damaged one is reported through ``warn`` (default: a logged warning) with the bad file named.
    Raises CheckpointError listing every problem when checkpoints exist but none is intact. A
    directory without a checksum manifest counts as damaged unless ``trust_unverified``.
    """
    warn = warn or logger.warning
    root = Path(root)
    newest = latest_checkpoint(root)
    if newest is None:
        return None
    candidates = [newest, *reversed([p for p in _complete_steps(root) if p.name < newest.name])]
    failures = []
    for step_dir in candidates:
        try:
            loaded = load_checkpoint(
                step_dir,
                model_chunks,
                optimizer,
                scheduler,
                groups=groups,
                load_rng=load_rng,
                trust_unverified=trust_unverified,
            )
        except CheckpointError as err:
            failures.append(str(err))
            if groups.rank == 0:
                warn(f"{err}; falling back to an older checkpoint")
            continue
        if failures and groups.rank == 0:
            warn(f"resumed from {step_dir}: {len(failures)} newer checkpoint(s) are damaged")
        return loaded
    raise CheckpointError(
        f"no intact checkpoint under {root}: {' | '.join(failures)}. Restore the damaged files from a copy, "
        "or remove the checkpoints directory to restart from the base model"
    )
