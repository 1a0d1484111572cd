"""Conversion and checkpoint throughput against plain safetensors reads and writes of the same bytes.

Builds a random Qwen2-architecture HF checkpoint (default ~250 MB float32), then times, in one
process (TP = PP = 1, gloo), each side by side with its baseline:

- raw read+write:   safetensors ``load_file`` of every tensor + ``save_file`` to another directory;
- hf -> megatron:   build the Megatron model, ``load_hf_into_model``, save the step directory (what
                    ``mugrpo convert hf-to-megatron`` does on each rank, minus process start-up);
- megatron -> hf:   build the model, load (and verify) the step directory, ``export_hf``, ``save_hf_dir``;
- raw write:        ``save_file`` of a training checkpoint's tensors (model + Adam moments), then one
                    fsync: the same durability as the checkpoint it is the baseline of;
- save_checkpoint:  the same state through ``training.checkpoint`` (xxHash3 manifest, fsync per file
                    as training does); also both without fsync, and with ``async_save``: the time
                    training is blocked;
- load:             ``load_checkpoint`` of that step directory (checksums verified, then read
                    straight into the parameters) against reading the raw file's bytes into memory;
- hashing:          the manifest checksum of the checkpoint's files with the writer's thread count
                    (what the writer threads pay while writing, and what verification pays on load).

Every timed write goes to a new directory that is deleted right after it was timed, baseline and
converter alike. (On this VM, writing into page-cache pages that an earlier file freed runs at
~4 GB/s, into never-used memory at ~0.6 GB/s: outputs left in place would slow whichever path
happens to run later.) Inputs were just written (page cache warm). Each figure is the fastest of
``--repeats`` runs. Process start-up and one-off costs (imports) are excluded by a warm-up on a tiny
model. Ratios are throughput / baseline throughput (≥ 1: faster than the baseline). The last line
holds the headline figures; the conversion writes nothing with fsync (see
``conversion.megatron_io.CONVERTED_FSYNC``), like its baseline.

    python benchmarks/conversion.py [--hidden 768 --layers 6 --vocab 16384] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

# This file is named like the ``conversion`` package: drop its directory from the import path so
# ``import conversion`` finds the package (repository root), not this script.
_HERE, _ROOT = Path(__file__).resolve().parent, Path(__file__).resolve().parent.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_ROOT))
sys.path.append(str(_HERE))  # last, for the benchmarks' shared set-up (``common``) only

import torch  # noqa: E402
from common import best_time  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402


def _build_hf_dir(out: Path, *, hidden: int, layers: int, vocab: int, seed: int) -> int:
    """Random-weight Qwen2 HF directory at ``out``; returns its tensor bytes."""
    from megatron_mugrpo.training.tiny import tiny_model

    model = tiny_model(
        seed=seed,
        hidden_size=hidden,
        num_hidden_layers=layers,
        vocab_size=vocab,
        intermediate_size=hidden * 8 // 3,
        num_attention_heads=hidden // 64,
        num_key_value_heads=max(1, hidden // 256),
    )
    model.save_pretrained(str(out), safe_serialization=True)
    return sum(p.numel() * p.element_size() for p in model.state_dict().values())


def _raw_copy(src: Path, dst: Path) -> None:
    dst.mkdir()
    for file in sorted(src.glob("*.safetensors")):
        save_file(load_file(str(file)), str(dst / file.name))


def _raw_write(tensors: dict[str, torch.Tensor], out: Path, *, fsync: bool) -> None:
    """The baseline of a checkpoint save: ``save_file`` of the same tensors, fsynced when the save is."""
    out.mkdir()
    path = out / "ck.safetensors"
    save_file(tensors, str(path))
    if fsync:
        with open(path, "rb") as stream:
            os.fsync(stream.fileno())


def _hf_to_megatron(hf_dir: Path, root: Path, groups) -> None:
    from megatron_mugrpo.conversion.hf_io import HfCheckpoint
    from megatron_mugrpo.conversion.live import load_hf_into_model
    from megatron_mugrpo.conversion.megatron_io import build_model_chunks, save_converted

    ckpt = HfCheckpoint(hf_dir)
    chunks = build_model_chunks(ckpt.config, torch.float32, groups)
    load_hf_into_model(chunks, ckpt, groups)
    save_converted(root, chunks, ckpt.config, groups)


def _megatron_to_hf(root: Path, out: Path, groups) -> None:
    from megatron_mugrpo.conversion.hf_io import save_hf_dir
    from megatron_mugrpo.conversion.live import export_hf
    from megatron_mugrpo.conversion.megatron_io import build_model_chunks, load_model, read_metadata, resolve_step_dir

    step = resolve_step_dir(root)
    hf_config = read_metadata(step)["hf_config"]
    chunks = build_model_chunks(hf_config, torch.float32, groups)
    load_model(step, chunks, groups)
    save_hf_dir(export_hf(chunks, hf_config, groups), out, hf_config)


def _policy_with_adam_state(hf_dir: Path, groups):
    """A trainable policy (DDP + Adam) loaded from ``hf_dir`` whose optimizer state exists (one zero-grad step)."""
    from megatron_mugrpo.conversion import load_hf_policy

    from megatron_mugrpo.training.optimizer import OptimConfig

    policy = load_hf_policy(hf_dir, groups=groups, dtype=torch.float32, optim=OptimConfig(lr=1e-6))
    for chunk in policy.model_chunks:
        chunk.zero_grad_buffer()
    policy.optimizer.step()
    return policy


def _checkpoint_tensors(policy) -> dict[str, torch.Tensor]:
    """The tensors a training checkpoint holds (parameters + optimizer moments), for the raw baseline."""
    tensors = {f"model.{n}": p.detach() for n, p in policy.unwrapped()[0].named_parameters()}
    for index, state in enumerate(policy.optimizer.state_dict()["state"].values()):
        for key, value in state.items():
            if torch.is_tensor(value) and value.dim() > 0:
                tensors[f"optim.{index}.{key}"] = value.detach()
    return {k: v.contiguous() for k, v in tensors.items()}


def _save(policy, root: Path, step: int, groups, **kwargs) -> Path:
    from megatron_mugrpo.training.checkpoint import save_checkpoint

    return save_checkpoint(
        root,
        step,
        policy.model_chunks,
        groups=groups,
        hf_config=policy.hf_config,
        optimizer=policy.optimizer,
        scheduler=policy.scheduler,
        **kwargs,
    )


def _async_block(policy, root: Path, step: int, groups) -> tuple[float, float]:
    """(seconds ``save`` blocks the caller, seconds until the directory is published) with async_save."""
    from megatron_mugrpo.training.checkpoint import CheckpointSaver

    saver = CheckpointSaver(root, groups=groups, async_save=True)
    for warm in range(2):  # the host buffers are allocated once and reused by every later save
        saver.save(step + warm, policy.model_chunks, hf_config=policy.hf_config, optimizer=policy.optimizer)
        saver.wait()
    start = time.perf_counter()
    saver.save(step + 2, policy.model_chunks, hf_config=policy.hf_config, optimizer=policy.optimizer)
    blocked = time.perf_counter() - start
    saver.wait()
    return blocked, time.perf_counter() - start


def _load(step_dir: Path, hf_dir: Path, groups, *, verify: bool) -> None:
    from megatron_mugrpo.conversion.hf_io import load_hf_config

    from megatron_mugrpo.training.checkpoint import load_checkpoint
    from megatron_mugrpo.training.optimizer import OptimConfig
    from megatron_mugrpo.training.setup import build_policy

    policy = build_policy(load_hf_config(hf_dir), groups=groups, dtype=torch.float32, optim=OptimConfig(lr=1e-6))
    start = time.perf_counter()
    load_checkpoint(step_dir, policy.model_chunks, policy.optimizer, policy.scheduler, groups=groups, verify=verify)
    _load.seconds = time.perf_counter() - start  # type: ignore[attr-defined]


def _read_bytes(path: Path) -> bytearray:
    """The file's bytes in fresh memory: the disk (here: page cache) read speed, the load baseline.

    (safetensors' ``load_file`` maps the file and reads nothing until a tensor is touched.)
    """
    buffer = bytearray(path.stat().st_size)
    with open(path, "rb", buffering=0) as stream:
        view, done = memoryview(buffer), 0
        while done < len(buffer):
            done += stream.readinto(view[done:])
    return buffer


def _dir_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


def _profiled(label: str, fn: Callable[[], object]) -> None:
    profile = cProfile.Profile()
    profile.enable()
    fn()
    profile.disable()
    print(f"\n---- profile: {label} (cumulative, top 25) ----")
    pstats.Stats(profile).sort_stats("cumulative").print_stats(25)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per measurement; the best counts")
    parser.add_argument("--workdir", default=None, help="scratch directory (default: a temporary one)")
    parser.add_argument("--profile", action="store_true", help="also print a cProfile of each measured path")
    args = parser.parse_args()

    from megatron_mugrpo.training import checkpoint_digests, parallel

    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    groups = parallel.initialize_parallel(1, 1, seed=0)
    work = Path(tempfile.mkdtemp(prefix="mugrpo-bench-", dir=args.workdir))
    reps = args.repeats

    def timed(fn: Callable[[], object], written: str | None = None) -> float:
        """Best of ``reps`` calls; ``written``: the directory under ``work`` each call writes, removed after it."""
        cleanup = (lambda: shutil.rmtree(work / written, ignore_errors=True)) if written else None
        return best_time(fn, reps, cleanup=cleanup)[0]

    try:
        warm = work / "warm"
        _build_hf_dir(warm / "hf", hidden=64, layers=2, vocab=256, seed=0)
        _hf_to_megatron(warm / "hf", warm / "mg", groups)
        _megatron_to_hf(warm / "mg", warm / "hf_back", groups)

        hf = work / "hf"
        nbytes = _build_hf_dir(hf, hidden=args.hidden, layers=args.layers, vocab=args.vocab, seed=0)
        gb = nbytes / 1e9
        _hf_to_megatron(hf, work / "mg_src", groups)  # the input of megatron -> hf (untimed)
        raw_s = timed(lambda: _raw_copy(hf, work / "raw"), "raw")
        to_mg_s = timed(lambda: _hf_to_megatron(hf, work / "mg", groups), "mg")
        to_hf_s = timed(lambda: _megatron_to_hf(work / "mg_src", work / "hf_back", groups), "hf_back")

        policy = _policy_with_adam_state(hf, groups)
        tensors = _checkpoint_tensors(policy)
        ck_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        ck_gb = ck_bytes / 1e9
        raw_write_s = timed(lambda: _raw_write(tensors, work / "rawck", fsync=False), "rawck")
        raw_write_fsync_s = timed(lambda: _raw_write(tensors, work / "rawck", fsync=True), "rawck")
        _raw_write(tensors, work / "rawread", fsync=False)
        raw_read_s = timed(lambda: _read_bytes(work / "rawread" / "ck.safetensors"))
        tensors.clear()
        save_s = timed(lambda: _save(policy, work / "ck", 10, groups), "ck")
        save_nofsync_s = timed(lambda: _save(policy, work / "ck", 10, groups, fsync=False), "ck")
        blocked_s, async_total_s = _async_block(policy, work / "ck_async", 100, groups)
        step_dir = _save(policy, work / "ck_load", 10, groups)
        on_disk = _dir_bytes(step_dir)
        files = [p for p in step_dir.rglob("*") if p.is_file()]
        hash_s = timed(lambda: checkpoint_digests.hash_files(files))
        load_times, load_nv_times = [], []
        for _ in range(reps):
            _load(step_dir, hf, groups, verify=True)
            load_times.append(_load.seconds)  # type: ignore[attr-defined]
            _load(step_dir, hf, groups, verify=False)
            load_nv_times.append(_load.seconds)  # type: ignore[attr-defined]
        load_s, load_nv_s = min(load_times), min(load_nv_times)
        if args.profile:
            _profiled("hf -> megatron", lambda: _hf_to_megatron(hf, work / "prof_mg", groups))
            _profiled("megatron -> hf", lambda: _megatron_to_hf(work / "mg_src", work / "prof_hf", groups))
            _profiled("save_checkpoint", lambda: _save(policy, work / "prof_ck", 1, groups))
            _profiled("load_checkpoint", lambda: _load(step_dir, hf, groups, verify=True))
    finally:
        shutil.rmtree(work, ignore_errors=True)
        parallel.destroy_parallel(destroy_process_group=True)

    raw, to_mg, to_hf = gb / raw_s, gb / to_mg_s, gb / to_hf_s
    raw_write, save, load, raw_read = ck_gb / raw_write_fsync_s, ck_gb / save_s, ck_gb / load_s, ck_gb / raw_read_s
    print(f"model bytes: {gb:.3f} GB (float32, hidden={args.hidden}, layers={args.layers}, vocab={args.vocab})")
    print(f"raw safetensors read+write:    {raw_s:6.2f} s  {raw:.3f} GB/s")
    print(f"hf -> megatron:                {to_mg_s:6.2f} s  {to_mg:.3f} GB/s  ratio {to_mg / raw:.3f}")
    print(f"megatron -> hf:                {to_hf_s:6.2f} s  {to_hf:.3f} GB/s  ratio {to_hf / raw:.3f}")
    print(f"training checkpoint: {ck_gb:.3f} GB of tensors (model + Adam moments), {on_disk / 1e9:.3f} GB on disk")
    print(f"raw safetensors write + fsync: {raw_write_fsync_s:6.2f} s  {raw_write:.3f} GB/s")
    print(f"save_checkpoint (fsync):       {save_s:6.2f} s  {save:.3f} GB/s  ratio {save / raw_write:.3f}")
    print(f"raw safetensors write:         {raw_write_s:6.2f} s  {ck_gb / raw_write_s:.3f} GB/s (page cache only)")
    print(f"save_checkpoint (no fsync):    {save_nofsync_s:6.2f} s  ratio {raw_write_s / save_nofsync_s:.3f}")
    print(f"async save: blocks {blocked_s:.2f} s, published after {async_total_s:.2f} s")
    hash_gbps = on_disk / 1e9 / hash_s
    name = checkpoint_digests.CHECKSUM
    print(f"{name} of the files:         {hash_s:6.2f} s  {hash_gbps:.3f} GB/s ({hash_s / save_s:.0%} of save)")
    print(f"raw safetensors read:          {raw_read_s:6.2f} s  {raw_read:.3f} GB/s")
    print(f"load_checkpoint (verified):    {load_s:6.2f} s  {load:.3f} GB/s  ratio {load / raw_read:.3f}")
    print(f"load_checkpoint (no verify):   {load_nv_s:6.2f} s  ratio {ck_gb / load_nv_s / raw_read:.3f}")
    print(
        f"throughput_ratio_hf_to_megatron={to_mg / raw:.3f} throughput_ratio_megatron_to_hf={to_hf / raw:.3f} "
        f"checkpoint_ratio={save / raw_write:.3f} load_ratio={load / raw_read:.3f} "
        f"async_block_ratio={blocked_s / save_s:.3f} hash_gbps={hash_gbps:.3f}"
    )


if __name__ == "__main__":
    main()
