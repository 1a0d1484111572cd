"""Weight publication in async mode: the trainer publishes its policy every ``async.sync_every`` updates;
rollout workers pick it up between generation batches. Two ways (``async.publish``):

- **memory** (default): the trainer's writer rank broadcasts the exported tensors in buckets to every
  worker over the publication group (``transport``); each worker receives them into a staging area
  in a background thread while it keeps generating (``Staging``), and applies the newest complete
  publication at its next safe point (``Worker.refresh``: between batches). The trainer is blocked
  only while it sends. The first publication of every launch still goes to disk (below): a worker
  builds its engine, tokenizer and prompts from that directory, and a resumed launch starts there.
- **disk**: a Hugging Face directory per publication that each worker reads (``update_weights_from_disk``
  with SGLang, a reload with transformers): for workers that share no network with the trainer, and
  the reference of ``benchmarks/weight_publication.py``. For a 7B model in bf16 that is 15 GB written
  and read per sync.

Disk layout (``RUN_DIR/async/weights``)::

    v00000012-3f2a9c1e/    the policy after 12 updates: safetensors, config.json, tokenizer files.
                           Written under a temporary name and renamed whole (``conversion.save_hf_dir``)
    latest                 JSON {name, version, digest}, replaced atomically after the directory exists
    publications.jsonl     one line per publication, both ways (name, version, digest): what the
                           workers' reports are checked against (async.verify_weights)

Every publication gets a fresh name (the suffix is random), so a resumed trainer that publishes
version 12 again never rewrites files a worker may be reading; the newest ``KEEP_PUBLICATIONS``
directories are kept. Each worker acknowledges what it applied in ``RUN_DIR/async/acks/worker_NNN.json``
(name, version, digest, wall-clock time).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from megatron_mugrpo.asynchronous.files import write_json
from megatron_mugrpo.asynchronous.transport import (
    PublicationGroup,
    Received,
    Receiver,
    Sender,
    SendStats,
    join_group,
    staging_place,
)
from megatron_mugrpo.durable import read_json

if TYPE_CHECKING:
    from megatron_mugrpo.conversion.live import NamedTensors
    from megatron_mugrpo.training.parallel import ParallelGroups
    from megatron_mugrpo.training.setup import Policy

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


class Digest:
    """``weights_digest`` computed while the tensors stream by (``add`` each, then ``hexdigest``):
    nothing is kept but one hash per tensor."""

    def __init__(self) -> None:
        self.per_tensor: dict[str, str] = {}

    def add(self, name: str, tensor: torch.Tensor) -> None:
        values = tensor.detach().to("cpu", torch.float32).contiguous()
        digest = hashlib.sha256(f"{name}:{tuple(values.shape)}:".encode())
        digest.update(values.numpy().tobytes())
        self.per_tensor[name] = digest.hexdigest()

    def watch(self, stream: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in stream:
            self.add(name, tensor)
            yield name, tensor

    def hexdigest(self) -> str:
        per = self.per_tensor
        return hashlib.sha256("".join(f"{n}={per[n]}\n" for n in sorted(per)).encode()).hexdigest()


def weights_digest(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """sha256 over every tensor's name, shape and float32 values, in name order.

    Equal digests mean equal weights (compared in float32, so a bf16 engine and a bf16 export agree).
    """
    digest = Digest()
    for name, tensor in named_tensors:
        digest.add(name, tensor)
    return digest.hexdigest()


class TrainerOrigin(Protocol):
    """Where the trainer's policy came from (``loop.run.Origin``): its architecture and tokenizer files."""

    hf_config: dict[str, Any]
    hf_dir: Path


class Trainer(Protocol):
    """What a publication reads of the trainer's run (``loop.run.Run`` has it); a protocol, so this
    component never imports the loops above it."""

    policy: Policy
    groups: ParallelGroups
    is_writer: bool

    @property
    def origin(self) -> TrainerOrigin: ...


def publish_policy(run: Trainer, root: Path, *, version: int, digest: bool) -> Publication | None:
    """Export the trainer's policy into a new publication (collective over the trainer ranks).

    Every trainer rank takes part in the export (tensors are gathered across TP / PP); rank 0 writes
    the directory, then the pointer, then the log line, and prunes old publications. Returns the
    publication on rank 0, None elsewhere.
    """
    from megatron_mugrpo.conversion import export_policy, save_hf_dir

    name = f"v{version:08d}-{uuid.uuid4().hex[:8]}"

    def write(tensors: NamedTensors) -> Publication:
        stream: Iterator[tuple[str, torch.Tensor]] = ((n, t.cpu()) for n, t in tensors)
        hashed = Digest()
        if digest:
            stream = hashed.watch(stream)
        save_hf_dir(
            stream, root / name, run.origin.hf_config, run.origin.hf_dir, fsync=True
        )  # durable before the pointer names it
        return Publication(name=name, version=version, digest=hashed.hexdigest() if digest else "")

    publication = export_policy(run.policy, run.origin.hf_config, run.groups, consume=run.is_writer, use=write)
    if publication is None:
        return None
    write_json(root / POINTER, dataclasses.asdict(publication))
    log_publication(root, publication)
    _prune(root, keep=KEEP_PUBLICATIONS)
    return publication


def send_policy(
    run: Trainer, sender: Sender, root: Path, *, version: int, digest: bool, watch: Callable[[], None] = lambda: None
) -> tuple[Publication, SendStats] | None:
    """Broadcast the trainer's policy to the workers (collective over the trainer ranks: all export, the
    writer sends); the log gets its line. Returns (publication, what it cost) on the writer, else None."""
    from megatron_mugrpo.conversion import export_policy

    name = f"v{version:08d}-m{uuid.uuid4().hex[:7]}"

    def send(tensors: NamedTensors) -> tuple[Publication, SendStats]:
        hashed = Digest()
        stream = hashed.watch(tensors) if digest else tensors
        stats = sender.send(
            stream, name=name, version=version, digest=hashed.hexdigest if digest else lambda: "", watch=watch
        )
        return Publication(name=name, version=version, digest=hashed.hexdigest() if digest else ""), stats

    sent = export_policy(run.policy, run.origin.hf_config, run.groups, consume=run.is_writer, use=send)
    if sent is not None:
        log_publication(root, sent[0])
    return sent


def log_publication(root: Path, publication: Publication) -> None:
    with open(root / LOG, "a") as log:
        log.write(json.dumps(dataclasses.asdict(publication)) + "\n")


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


def engine_digest(engine: Any, names: Iterable[str]) -> str:
    """``weights_digest`` of the tensors a transformers engine holds, over the published ``names``."""
    held = engine.weights()
    return weights_digest((name, held[name]) for name in names)


class Staging:
    """A worker's receiving end of memory publication: a background thread joins the publication group
    and receives every publication into memory while the main loop generates; ``take()`` hands the
    newest complete one to the main loop at its safe point.

    A publication received while an older one still waits replaces it (the older is never applied):
    besides the engine's weights a worker holds at most the staged publication and the one arriving,
    where ``transport.staging_place`` says for its engine (an SGLang worker: pinned host memory, outside
    the GPU memory SGLang reserved).
    The thread's failure is raised by the next ``take()``.
    """

    def __init__(self, root: Path, *, rank: int, timeout_s: float, gpu: torch.device | None, engine: str):
        """``gpu``: the worker's GPU (None: CPU only); ``engine``: its rollout engine (rollout.engine)."""
        self.root, self.rank, self.timeout_s, self.gpu, self.engine = root, rank, timeout_s, gpu, engine
        self._ready: Received | None = None
        self._error: BaseException | None = None
        self._lock, self._stop = threading.Lock(), threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"staging:{rank}", daemon=True)
        self.group: PublicationGroup | None = None
        self._receiver: Receiver | None = None
        self.received = 0
        """Publications received so far (applied or replaced)."""

    def start(self) -> Staging:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _alive(self) -> None:
        if self._stop.is_set():
            raise _StoppedError

    def _run(self) -> None:
        try:
            self.group = join_group(self.root, self.rank, timeout_s=self.timeout_s, alive=self._alive)
            place = staging_place(self.engine, data_backend=self.group.address.data_backend, gpu=self.gpu)
            self._receiver = Receiver(
                self.group, device=place.wire, hold=place.hold, pinned=place.pinned, alive=self._alive
            )
            while (received := self._receiver.next()) is not None:
                with self._lock:
                    replaced, self._ready, self.received = self._ready, received, self.received + 1
                if replaced is not None:  # never applied: its buffers take the next publication
                    self._receiver.recycle(replaced)
        except _StoppedError:
            pass
        except BaseException as exc:  # handed to the main loop, which names the trainer if it is the cause
            self._error = exc

    def take(self) -> Received | None:
        """The newest publication received and not yet taken, or None. Raises the thread's failure.
        Hand it back with ``applied`` once the engine holds it."""
        if self._error is not None:
            raise RuntimeError(
                f"receiving weight publications failed: {type(self._error).__name__}: {self._error}"
            ) from self._error
        with self._lock:
            ready, self._ready = self._ready, None
        return ready

    def applied(self, received: Received) -> None:
        """The engine copied ``received``: its staging buffers may receive a later publication."""
        with self._lock:
            if self._receiver is not None:
                self._receiver.recycle(received)


class _StoppedError(Exception):
    """The worker stops: the staging thread leaves its wait."""
