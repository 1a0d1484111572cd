"""Async weight publication: disk (a directory per publication) against memory (buckets broadcast over the
publication group), side by side in one run, at the CPU demo's model size and at about 1 GB.

One trainer (this process) and ``--workers`` rollout workers (spawned processes, one torch thread
each) meet exactly as in ``mode: async``: the run directory's publications and acks, and for memory
the group of ``asynchronous.transport``. Each publication is timed three ways:

- blocked:  what the trainer waits before it can train again. Disk: the directory written and synced,
            then the ``latest`` pointer (``publish.publish_policy``'s steps: safetensors written under a
            temporary name, fsync, rename, pointer). Memory: ``Sender.send``, until every worker
            holds the whole publication in its staging area;
- serve:    from the start of the publication until every worker has acknowledged that it serves it
            (disk: the worker saw the pointer, read the directory and copied it into its weights;
            memory: its staging thread received it, its main loop applied it);
- memory:   what publication adds. Trainer: disk none resident (the page cache holds what was
            written), memory one bucket buffer. Worker: disk the state dict it read, memory the staged
            publication; each as MiB and as a fraction of the model.

The worker's "engine" is a dict of preallocated tensors that each publication is copied into (for the
1 GB case no transformers model is built; the copy is what ``load_weights`` does for each tensor).
The exported tensors come from a state dict in memory: the export over TP / PP is the same for both
ways and not timed. Figures are medians of ``--repeats`` publications. The last line is the ~1 GB
case: ``blocked_ratio=<disk blocked / memory blocked> serve_ratio=<disk / memory time to serve>``
(target: blocked_ratio >= 3).

    .venv/bin/python benchmarks/weight_publication.py [--workers 1] [--repeats 3] [--bucket-mib 256] [--gb 1.0]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

_HERE, _ROOT = Path(__file__).resolve().parent, Path(__file__).resolve().parent.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402

from megatron_mugrpo.asynchronous.files import write_json  # noqa: E402
from megatron_mugrpo.asynchronous.publish import POINTER, Publication, Staging, latest_publication  # noqa: E402
from megatron_mugrpo.asynchronous.transport import Sender, host_group  # noqa: E402
from megatron_mugrpo.durable import read_json  # noqa: E402

POLL_S = 0.002
TIMEOUT_S = 600.0
STOP = "stop"


def demo_state_dict() -> dict[str, torch.Tensor]:
    """The CPU demo's policy (configs/demo_cpu.yaml's model.tiny) as Hugging Face tensors."""
    from megatron_mugrpo.char_tokenizer import build_char_tokenizer
    from megatron_mugrpo.config import load_config
    from megatron_mugrpo.warmstart import build_tiny_model

    cfg = load_config(_ROOT / "configs" / "demo_cpu.yaml", [])
    model = build_tiny_model(cfg.model.tiny, build_char_tokenizer(), seed=0)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}  # tied weights as two tensors


def synthetic_state_dict(gib: float) -> dict[str, torch.Tensor]:
    """About ``gib`` GiB shaped like a transformer's layers: bf16 matrices [2048, 2048] and their norms in fp32."""
    tensors, layer = {}, 0
    while sum(t.numel() * t.element_size() for t in tensors.values()) < gib * 2**30:
        for proj in ("q", "k", "v", "o"):
            tensors[f"model.layers.{layer}.self_attn.{proj}_proj.weight"] = torch.randn(2048, 2048).to(torch.bfloat16)
        tensors[f"model.layers.{layer}.input_layernorm.weight"] = torch.ones(2048)
        layer += 1
    return tensors


# ------------------------------------------------------------------------------------------------ worker


def worker_main(root: str, rank: int, bucket_timeout_s: float) -> None:
    """A rollout worker that does nothing but pick up publications (disk and memory) and acknowledge them."""
    torch.set_num_threads(1)
    from safetensors.torch import load_file

    root_path = Path(root)
    staging = Staging(root_path, rank=rank, timeout_s=bucket_timeout_s, gpu=None, engine="transformers").start()
    held: dict[str, torch.Tensor] = {}
    current: Publication | None = None
    peak = {"disk": 0, "memory": 0}

    def apply(named, name: str, version: int, way: str, nbytes: int) -> None:
        for key, tensor in named:
            if key not in held or held[key].shape != tensor.shape or held[key].dtype != tensor.dtype:
                held[key] = torch.empty_like(tensor)
            held[key].copy_(tensor)
        peak[way] = max(peak[way], nbytes)
        ack = {"name": name, "version": version, "at": time.time(), "transient": peak}
        write_json(root_path / "acks" / f"worker_{rank - 1:03d}.json", ack)

    while not (root_path / STOP).exists():
        latest = latest_publication(root_path)
        if latest is not None and latest != current:
            state = load_file(str(root_path / latest.name / "model.safetensors"))
            apply(
                state.items(),
                latest.name,
                latest.version,
                "disk",
                sum(t.numel() * t.element_size() for t in state.values()),
            )
            current, state = latest, None
        received = staging.take()
        if received is not None:
            apply(received.tensors, received.name, received.version, "memory", received.nbytes)
            staging.applied(received)
        time.sleep(POLL_S)
    staging.stop()


# ------------------------------------------------------------------------------------------------ trainer


def publish_disk(root: Path, state: dict[str, torch.Tensor], name: str, version: int) -> None:
    """``publish_policy``'s disk steps: write under a temporary name, fsync, rename, then the pointer."""
    from safetensors.torch import save_file

    tmp = root / f".{name}.tmp"
    tmp.mkdir()
    save_file(state, str(tmp / "model.safetensors"))
    with open(tmp / "model.safetensors", "rb") as handle:
        os.fsync(handle.fileno())
    tmp.rename(root / name)
    write_json(root / POINTER, {"name": name, "version": version, "digest": ""})
    for old in sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("v"))[:-2]:
        shutil.rmtree(old, ignore_errors=True)  # keep the newest two, as KEEP_PUBLICATIONS keeps a few


def wait_served(root: Path, workers: int, name: str) -> tuple[float, dict]:
    """When the last worker acknowledged ``name`` (wall clock), and its transient bytes."""
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        acks = [read_json(root / "acks" / f"worker_{w:03d}.json") for w in range(workers)]
        if all(a is not None and a["name"] == name for a in acks):
            return max(a["at"] for a in acks), acks[0]["transient"]
        time.sleep(POLL_S)
    raise TimeoutError(f"the workers never served {name}")


def measure(root: Path, sender: Sender, state: dict[str, torch.Tensor], args, label: str, version: int) -> dict:
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    rows = {}
    for way in ("disk", "memory"):
        blocked, serve = [], []
        transient = 0
        for repeat in range(args.repeats):
            version += 1
            name = f"v{version:08d}-{way}{repeat}"
            started = time.time()
            t0 = time.perf_counter()
            if way == "disk":
                publish_disk(root, state, name, version)
            else:
                stats = sender.send(iter(state.items()), name=name, version=version)
            blocked.append(time.perf_counter() - t0)
            served_at, peaks = wait_served(root, args.workers, name)
            serve.append(served_at - started)
            transient = peaks[way]
        trainer_extra = 0 if way == "disk" else stats.buffer_bytes
        rows[way] = {
            "blocked": statistics.median(blocked),
            "serve": statistics.median(serve),
            "trainer_mib": trainer_extra / 2**20,
            "worker_mib": transient / 2**20,
            "model_mib": nbytes / 2**20,
        }
    print(f"{label}: {nbytes / 2**20:.1f} MiB, {len(state)} tensors")
    print(f"  {'way':<8}{'blocked s':>11}{'serve s':>10}{'trainer +MiB':>14}{'worker +MiB':>13}{'worker +x':>11}")
    for way, r in rows.items():
        print(
            f"  {way:<8}{r['blocked']:>11.4f}{r['serve']:>10.4f}{r['trainer_mib']:>14.1f}{r['worker_mib']:>13.1f}"
            f"{r['worker_mib'] / r['model_mib']:>11.2f}"
        )
    ratios = (rows["disk"]["blocked"] / rows["memory"]["blocked"], rows["disk"]["serve"] / rows["memory"]["serve"])
    print(f"  blocked_ratio={ratios[0]:.2f} serve_ratio={ratios[1]:.2f}")
    return {"ratios": ratios, "version": version}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bucket-mib", type=float, default=256.0)
    parser.add_argument("--gb", type=float, default=1.0, help="size of the large synthetic state dict (GiB)")
    parser.add_argument("--dir", type=Path, default=None, help="where publications go (default: a temporary directory)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="weight_publication_", dir=args.dir))
    (root / "acks").mkdir()
    print(
        f"{args.workers} worker(s), buckets of {args.bucket_mib:g} MiB, {args.repeats} publications per figure, {root}"
    )
    sender = Sender(
        host_group(root, world_size=1 + args.workers, timeout_s=TIMEOUT_S, data_backend="gloo"),
        bucket_bytes=int(args.bucket_mib * 2**20),
        device=torch.device("cpu"),
    )
    context = multiprocessing.get_context("spawn")
    workers = [context.Process(target=worker_main, args=(str(root), 1 + w, TIMEOUT_S)) for w in range(args.workers)]
    for process in workers:
        process.start()
    try:
        demo = measure(root, sender, demo_state_dict(), args, "demo model (configs/demo_cpu.yaml)", 0)
        large = measure(
            root, sender, synthetic_state_dict(args.gb), args, f"synthetic ~{args.gb:g} GiB", demo["version"]
        )
        sender.close()
    finally:
        (root / STOP).touch()
        for process in workers:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
        shutil.rmtree(root, ignore_errors=True)
    blocked_ratio, serve_ratio = large["ratios"]
    print(f"blocked_ratio={blocked_ratio:.2f} serve_ratio={serve_ratio:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
