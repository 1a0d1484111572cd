"""Weight publication in async mode: the trainer exports its policy every ``async.sync_every`` updates as a
Hugging Face directory; rollout workers load it between generation batches.

Layout (``RUN_DIR/async/weights``)::

    v00000012-3f2a9c1e/    the policy after 12 updates: safetensors, config.json, tokenizer files.
                           Written under a temporary name and renamed whole (``conversion.save_hf_dir``)
    latest                 JSON {name, version, digest}, replaced atomically after the directory exists
    publications.jsonl     one line per publication (name, version, digest): what workers are checked against

Every publication gets a fresh directory (the suffix is random), so a resumed trainer that publishes
version 12 again never rewrites files a worker may be reading; the newest ``KEEP_PUBLICATIONS`` are
kept. A worker (``Subscription``) compares ``latest`` with what it loaded and, when it changed, loads
the directory into its engine with ``load_hf_dir``: SGLang's ``update_weights_from_disk``, a reload for
the transformers engine. Workers do that only between batches, never mid-sequence.

On GPUs the exported directory costs one write and one read of the weights per sync (15 GB for a 7B
model in bf16, a few seconds on local NVMe per 4 updates). SGLang's ``update_weights_from_distributed``
(NCCL broadcast from the trainer) would avoid the disk; it is not implemented here.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from megatron_mugrpo.asynchronous.files import read_json, write_json
from megatron_mugrpo.loop.export import NamedTensors, export_policy

if TYPE_CHECKING:
    from megatron_mugrpo.loop.setup import Run

POINTER = "latest"
LOG = "publications.jsonl"
KEEP_PUBLICATIONS = 4
"""Publications kept on disk: a worker may still be loading an older one when a newer one lands."""
LOAD_ATTEMPTS = 5
"""Times a worker tries to load the latest publication before giving up: a directory pruned under it
(OSError) or the engine's own refusal (SGLang's ``update_weights_from_disk`` failing is a RuntimeError)
are retried, each time with the publication ``latest`` names then."""
RETRY_S = 1.0
"""Seconds between two attempts (the n-th failure waits n × this: a busy file system gets time)."""


@dataclass(frozen=True, kw_only=True)
class Publication:
    """One published policy."""

    name: str
    """Directory name under the publication root."""
    version: int
    """Trainer updates made by the published policy (the behaviour policy version of what it generates)."""
    digest: str = ""
    """``weights_digest`` of the published tensors (async.verify_weights), else ''."""


def weights_digest(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """sha256 over every tensor's name, shape and float32 values, in name order.

    Equal digests mean equal weights (compared in float32, so a bf16 engine and a bf16 export agree).
    """
    per_tensor = {}
    for name, tensor in named_tensors:
        values = tensor.detach().to("cpu", torch.float32).contiguous()
        digest = hashlib.sha256(f"{name}:{tuple(values.shape)}:".encode())
        digest.update(values.numpy().tobytes())
        per_tensor[name] = digest.hexdigest()
    return hashlib.sha256("".join(f"{n}={per_tensor[n]}\n" for n in sorted(per_tensor)).encode()).hexdigest()


def publish_policy(run: Run, root: Path, *, version: int, digest: bool) -> Publication | None:
    """Export the trainer's policy into a new publication (collective over the trainer ranks).

    Every trainer rank takes part in the export (tensors are gathered across TP / PP); rank 0 writes
    the directory, then the pointer, then the log line, and prunes old publications. Returns the
    publication on rank 0, None elsewhere.
    """
    from megatron_mugrpo.conversion import save_hf_dir

    name = f"v{version:08d}-{uuid.uuid4().hex[:8]}"

    def write(tensors: NamedTensors) -> Publication:
        kept: list[tuple[str, torch.Tensor]] = []
        stream: Iterator[tuple[str, torch.Tensor]] = ((n, t.cpu()) for n, t in tensors)
        if digest:  # keep the tensors for the hash (only when verifying: it costs a copy of the weights)
            stream = _keeping(stream, kept)
        save_hf_dir(stream, root / name, run.hf_config, run.hf_dir, fsync=True)  # durable before the pointer names it
        return Publication(name=name, version=version, digest=weights_digest(kept) if digest else "")

    publication = export_policy(run.policy, run.hf_config, run.groups, consume=run.is_writer, use=write)
    if publication is None:
        return None
    record = dataclasses.asdict(publication)
    write_json(root / POINTER, record)
    with open(root / LOG, "a") as log:
        log.write(json.dumps(record) + "\n")
    _prune(root, keep=KEEP_PUBLICATIONS)
    return publication


def _keeping(stream: Iterator[tuple[str, torch.Tensor]], into: list) -> Iterator[tuple[str, torch.Tensor]]:
    for item in stream:
        into.append(item)
        yield item


def _prune(root: Path, *, keep: int) -> None:
    """Delete all but the ``keep`` newest publication directories (and any a crash left half-written)."""
    dirs = sorted((p for p in root.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime_ns)
    for old in dirs[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def latest_publication(root: Path) -> Publication | None:
    """What ``latest`` names (None before the first publication)."""
    values = read_json(root / POINTER)
    return Publication(**values) if values is not None else None


def publication_digests(root: Path) -> dict[str, str]:
    """Publication name → digest, from the log (a torn last line, from a killed trainer, is skipped)."""
    digests = {}
    if (root / LOG).is_file():
        for line in (root / LOG).read_text().splitlines():
            try:
                values = json.loads(line)
            except json.JSONDecodeError:
                continue
            digests[values["name"]] = values["digest"]
    return digests


class Subscription:
    """A worker's view of the publications: which one its engine holds, and loading the newest."""

    def __init__(self, root: Path, *, retry_s: float = RETRY_S):
        self.root, self.retry_s = root, retry_s
        self.current: Publication | None = None

    def path(self, publication: Publication) -> Path:
        return self.root / publication.name

    def refresh(self, load: Callable[[str], None]) -> float:
        """``load(directory)`` the newest publication unless it is the one loaded; returns the seconds spent.

        A failed load is retried (``LOAD_ATTEMPTS`` in all, ``retry_s`` apart and growing): the directory
        may have been pruned under it (OSError; a newer one is named by then), or the engine refused it
        (RuntimeError: SGLang's ``update_weights_from_disk``). The last failure is in the error raised.
        """
        started = time.perf_counter()
        failures: list[tuple[Publication, Exception]] = []
        while len(failures) < LOAD_ATTEMPTS:
            latest = latest_publication(self.root)
            if latest is None or latest == self.current:
                break
            try:
                load(str(self.path(latest)))
            except (OSError, RuntimeError) as exc:
                failures.append((latest, exc))
                if len(failures) < LOAD_ATTEMPTS:
                    time.sleep(self.retry_s * len(failures))
                continue
            self.current = latest
            break
        else:
            publication, error = failures[-1]
            raise RuntimeError(
                f"could not load the latest publication of {self.root} in {LOAD_ATTEMPTS} attempts; the last, "
                f"of {publication.name}, failed with {type(error).__name__}: {error}"
            ) from error
        return time.perf_counter() - started


def published_names(path: Path) -> list[str]:
    """Tensor names stored in a Hugging Face directory's safetensors files."""
    from safetensors import safe_open

    names: list[str] = []
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            names.extend(handle.keys())
    return names


def engine_digest(engine: Any, path: Path) -> str:
    """``weights_digest`` of the tensors a transformers engine holds, over the names published in ``path``."""
    held = engine.weights()
    return weights_digest((name, held[name]) for name in published_names(path))
