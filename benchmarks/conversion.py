"""Conversion throughput against a plain safetensors read + write of the same bytes.

Builds a random Qwen2-architecture HF checkpoint (default ~270 MB float32), then times, in one
process (TP = PP = 1, gloo):

- raw:             safetensors load_file of every tensor + save_file of them to another directory;
- hf_to_megatron:  build the Megatron model, load_hf_into_model, dist_checkpointing save (the
                   same work ``mugrpo convert hf-to-megatron`` does on each rank, minus start-up);
- megatron_to_hf:  load the step directory, export_hf, save_hf_dir.

All three read inputs that were just written (page cache warm) and write to the same disk; each
is timed ``--repeats`` times and the fastest run counts. Process
start-up and one-off costs (Megatron imports, dist_checkpointing's writer pool) are excluded by a
warm-up on a tiny model. The last line holds the headline figures.

    python benchmarks/conversion.py [--hidden 768 --layers 6 --vocab 16384]
"""

from __future__ import annotations

import argparse
import os
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

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402


def _build_hf_dir(out: Path, *, hidden: int, layers: int, vocab: int, seed: int) -> int:
    """Random-weight Qwen2 HF directory at ``out``; returns its tensor bytes."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from megatron_mugrpo.training.model import tiny_hf_config

    config = tiny_hf_config(
        "qwen2",
        hidden_size=hidden,
        num_hidden_layers=layers,
        vocab_size=vocab,
        intermediate_size=hidden * 8 // 3,
        num_attention_heads=hidden // 64,
        num_key_value_heads=max(1, hidden // 256),
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), dtype=torch.float32)
    model.save_pretrained(str(out), safe_serialization=True)
    return sum(p.numel() * p.element_size() for p in model.state_dict().values())


def _best_time(fn: Callable[[int], None], repeats: int) -> float:
    """Fastest of ``repeats`` timed calls ``fn(i)`` (the machine is shared: the minimum is the signal)."""
    times = []
    for i in range(repeats):
        start = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - start)
    return min(times)


def _raw_copy(src: Path, dst: Path) -> None:
    dst.mkdir()
    for file in sorted(src.glob("*.safetensors")):
        save_file(load_file(str(file)), str(dst / file.name))


def _hf_to_megatron(hf_dir: Path, root: Path) -> None:
    from conversion.hf_io import HfCheckpoint
    from conversion.live import load_hf_into_model
    from conversion.megatron_io import build_model_chunks, save_converted

    ckpt = HfCheckpoint(hf_dir)
    chunks = build_model_chunks(ckpt.config, torch.float32)
    load_hf_into_model(chunks, ckpt)
    save_converted(root, chunks, ckpt.config)


def _megatron_to_hf(root: Path, out: Path) -> None:
    from conversion.hf_io import save_hf_dir
    from conversion.live import export_hf
    from conversion.megatron_io import build_model_chunks, load_model, read_metadata, resolve_step_dir

    step = resolve_step_dir(root)
    hf_config = read_metadata(step)["hf_config"]
    chunks = build_model_chunks(hf_config, torch.float32)
    load_model(step, chunks)
    save_hf_dir(export_hf(chunks, hf_config), out, hf_config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per measurement; the best counts")
    parser.add_argument("--workdir", default=None, help="scratch directory (default: a temporary one)")
    args = parser.parse_args()

    from megatron_mugrpo.training import parallel

    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    parallel.initialize_parallel(1, 1, seed=0)
    work = Path(tempfile.mkdtemp(prefix="mugrpo-bench-", dir=args.workdir))
    try:
        warm = work / "warm"
        _build_hf_dir(warm / "hf", hidden=64, layers=2, vocab=256, seed=0)
        _hf_to_megatron(warm / "hf", warm / "mg")
        _megatron_to_hf(warm / "mg", warm / "hf_back")

        nbytes = _build_hf_dir(work / "hf", hidden=args.hidden, layers=args.layers, vocab=args.vocab, seed=0)
        gb = nbytes / 1e9
        reps = args.repeats
        raw_s = _best_time(lambda i: _raw_copy(work / "hf", work / f"raw{i}"), reps)
        to_mg_s = _best_time(lambda i: _hf_to_megatron(work / "hf", work / f"mg{i}"), reps)
        to_hf_s = _best_time(lambda i: _megatron_to_hf(work / "mg0", work / f"hf_back{i}"), reps)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        parallel.destroy_parallel(destroy_process_group=True)

    raw, to_mg, to_hf = gb / raw_s, gb / to_mg_s, gb / to_hf_s
    print(f"model bytes: {gb:.3f} GB (float32, hidden={args.hidden}, layers={args.layers}, vocab={args.vocab})")
    print(f"raw safetensors read+write: {raw_s:.2f} s  {raw:.3f} GB/s")
    print(f"hf -> megatron (dist ckpt):  {to_mg_s:.2f} s  {to_mg:.3f} GB/s")
    print(f"megatron -> hf (export):     {to_hf_s:.2f} s  {to_hf:.3f} GB/s")
    print(
        f"throughput_ratio={to_mg / raw:.3f} export_ratio={to_hf / raw:.3f} hf_to_megatron_gbps={to_mg:.3f} "
        f"megatron_to_hf_gbps={to_hf:.3f} raw_gbps={raw:.3f}"
    )


if __name__ == "__main__":
    main()
