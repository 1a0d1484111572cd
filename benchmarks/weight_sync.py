"""Per-stage weight sync: the in-memory path against writing the same bytes to disk.

At the start of every stage the trainer pushes its weights to the rollout engine
(``loop.engines.sync_engine``): ``conversion.export_hf`` streams HF-named tensors out of the live
Megatron model into the engine's ``load_weights``. This script times that path against
``safetensors.save_file`` of the same tensors (the cheapest way to hand weights over through
disk), in one process (TP = PP = 1, gloo, the transformers engine on this device):

- sync:           ``engine.load_weights(export_hf(...))`` into an engine that holds a model;
- sync (rebuild): the same after ``engine.release()``, as at every stage of the staged loop (the
                  engine rebuilds its model from the config before copying);
- raw write:      ``save_file`` of the exported tensors.

Peak extra memory during the sync is the high-water mark of resident memory (CPU; reset through
/proc/self/clear_refs) or of CUDA allocations, above what was resident before, as a fraction of the
model's bytes. The last line holds the headline figures; the target is sync_ratio >= 1.

    python benchmarks/weight_sync.py [--hidden 768 --layers 6 --vocab 16384] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import shutil
import sys
import tempfile
from pathlib import Path

_HERE, _ROOT = Path(__file__).resolve().parent, Path(__file__).resolve().parent.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_ROOT))
sys.path.append(str(_HERE))  # last, for the benchmarks' shared set-up (``common``) only

import torch  # noqa: E402
from common import best_time  # noqa: E402
from safetensors.torch import save_file  # noqa: E402


def _conversion_benchmark():
    """benchmarks/conversion.py as a module (its name clashes with the ``conversion`` package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("conversion_benchmark", _HERE / "conversion.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _raw_write_time(tensors: dict[str, torch.Tensor], path: Path, repeats: int) -> float:
    contiguous = {name: tensor.contiguous() for name, tensor in tensors.items()}
    return best_time(lambda: save_file(contiguous, str(path)), repeats)[0]


def _copied_bytes(exported: dict[str, torch.Tensor], chunks: list[torch.nn.Module]) -> int:
    """Bytes of exported tensors that are copies (not views of a parameter): what export allocates."""
    storages = {p.untyped_storage().data_ptr() for chunk in chunks for p in chunk.parameters()}
    return sum(
        t.numel() * t.element_size() for t in exported.values() if t.untyped_storage().data_ptr() not in storages
    )


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


class PeakMemory:
    """Peak memory above the starting point while the block runs: CUDA allocations, else resident memory."""

    def __enter__(self) -> PeakMemory:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self._start = torch.cuda.memory_allocated()
        else:
            with open("/proc/self/clear_refs", "w") as refs:  # resets VmHWM to the current RSS (Linux)
                refs.write("5")
            self._start = _status_kib("VmRSS") * 1024
        return self

    def __exit__(self, *exc: object) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            self.extra = torch.cuda.max_memory_allocated() - self._start
        else:
            self.extra = _status_kib("VmHWM") * 1024 - self._start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per measurement; the best counts")
    parser.add_argument("--workdir", default=None, help="scratch directory (default: a temporary one)")
    parser.add_argument("--profile", action="store_true", help="also print a cProfile of one sync")
    args = parser.parse_args()

    from megatron_mugrpo.conversion.hf_io import HfCheckpoint
    from megatron_mugrpo.conversion.live import export_hf, load_hf_into_model
    from megatron_mugrpo.conversion.megatron_io import build_model_chunks

    from megatron_mugrpo.rollout.transformers_engine import TransformersEngine
    from megatron_mugrpo.training import parallel

    build_hf_dir = _conversion_benchmark()._build_hf_dir

    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    groups = parallel.initialize_parallel(1, 1, seed=0)
    dtype = getattr(torch, args.dtype)
    work = Path(tempfile.mkdtemp(prefix="mugrpo-sync-", dir=args.workdir))
    try:
        hf = work / "hf"
        build_hf_dir(hf, hidden=args.hidden, layers=args.layers, vocab=args.vocab, seed=0)
        ckpt = HfCheckpoint(hf)
        chunks = build_model_chunks(ckpt.config, dtype, groups)
        load_hf_into_model(chunks, ckpt, groups)
        engine = TransformersEngine(hf, dtype=args.dtype)
        model_bytes = sum(p.numel() * p.element_size() for p in chunks[0].parameters())
        exported = dict(export_hf(chunks, ckpt.config, groups))
        sync_bytes = sum(t.numel() * t.element_size() for t in exported.values())
        gb = sync_bytes / 1e9

        def sync() -> None:
            engine.load_weights(export_hf(chunks, ckpt.config, groups))

        def sync_after_release() -> None:
            engine.release()
            sync()

        sync()  # warm-up
        sync_s = best_time(sync, args.repeats)[0]
        rebuild_s = best_time(sync_after_release, args.repeats)[0]
        raw_s = _raw_write_time(exported, work / "raw.safetensors", args.repeats)
        copied = _copied_bytes(exported, chunks)
        exported.clear()
        with PeakMemory() as peak:
            sync()
        for name, param in engine.model.state_dict().items():  # the engine holds exactly the trainer's weights
            if name in ckpt.names():
                assert torch.equal(param, ckpt.tensor(name).to(param.dtype)), name
        if args.profile:
            profile = cProfile.Profile()
            profile.enable()
            sync()
            profile.disable()
            print("\n---- profile: one sync (cumulative, top 25) ----")
            pstats.Stats(profile).sort_stats("cumulative").print_stats(25)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        parallel.destroy_parallel(destroy_process_group=True)

    sync_gbps, raw_gbps = gb / sync_s, gb / raw_s
    print(f"model: {model_bytes / 1e9:.3f} GB ({args.dtype}), synced tensors {gb:.3f} GB")
    print(f"raw safetensors write:     {raw_s:6.3f} s  {raw_gbps:.3f} GB/s")
    print(f"in-memory sync:            {sync_s:6.3f} s  {sync_gbps:.3f} GB/s")
    print(f"sync after engine release: {rebuild_s:6.3f} s  {gb / rebuild_s:.3f} GB/s (engine rebuilds its model first)")
    print(f"peak extra memory during sync: {peak.extra / 1e6:.1f} MB = {peak.extra / model_bytes:.3f} of the model")
    print(f"export copies {copied / 1e6:.1f} MB = {copied / model_bytes:.3f} of the model (q/k/v un-interleaving)")
    print(
        f"sync_ratio={sync_gbps / raw_gbps:.3f} sync_rebuild_ratio={raw_s / rebuild_s:.3f} "
        f"peak_extra_memory_fraction={peak.extra / model_bytes:.3f} export_copy_fraction={copied / model_bytes:.3f} "
        f"sync_gbps={sync_gbps:.3f} "
        f"raw_write_gbps={raw_gbps:.3f}"
    )


if __name__ == "__main__":
    main()
