"""Weights in memory (``async.publish: memory``): the trainer broadcasts its policy to the rollout workers
over a process group made for publication, in buckets, while the workers keep generating.

Who joins: the trainer's writer rank (rank 0 of the group, the broadcasts' root) and every rollout
worker (rank 1 + w). The group is its own: a TCP store the trainer hosts at a free port, named in
``RUN_DIR/async/publish_group.json`` with a key prefix fresh for each launch, and process groups
built on it directly (``ProcessGroupGloo`` / ``ProcessGroupNCCL``), so neither the trainer's
torch.distributed world nor Megatron's groups see it, and the workers still never call
``init_process_group``. Control messages go over gloo (CPU); the weights' bytes over gloo on CPU,
over NCCL when the trainer has CUDA.

Hand-shake through the store (polled with ``check``, which never blocks, so that a worker waiting
hours for the next publication never trips a collective's timeout)::

    trainer (Feed.open)      store up, publish_group.json written
    worker (receiver thread) connects, sets joined/<rank>, waits for 'open'
    trainer (1st publication) sets 'open'; both build the process groups (the trainer waits at most
                             async.publish_timeout_s, then names the workers that never joined)
    per publication n        trainer sets announce/<n> (publish | close), then broadcasts:

    BUCKET header (kind, metadata bytes, data bytes, version) → metadata (JSON: name, dtype, shape,
           byte offset of each tensor) → data: the tensors' bytes back to back, one flat uint8 buffer
    ... one BUCKET per async.bucket_mib of weights ...
    END    header → metadata (publication name, version, digest)

and each worker sets received/<rank>/<n> once it holds the whole publication (progress/<rank> after
every bucket). The trainer returns when every worker has it: it is blocked only while it sends.

The flat layout is SGLang's ``flattened_bucket`` (``FlattenedTensorBucket``: each tensor's bytes at a
byte offset that is a multiple of its item size, no padding), so a bucket is what SGLang's
``update_weights_from_distributed(load_format="flattened_bucket")`` receives.

Each tensor is copied once, into one of the sender's two bucket buffers (allocated once, reused
for every bucket: one is on the wire while the next bucket is packed into the other); the trainer
never holds more than two buckets of the exported model. A tensor larger than a bucket travels alone
(the buffer grows to fit it). A worker receives into buffers it reuses from the publication before
(fresh memory, faulted in as the bytes arrive, halves the receive rate on CPU).

A publication that does not finish within ``async.publish_timeout_s`` raises ``PublishTimeoutError``
naming the worker(s) that fell behind, read from their progress keys.
"""

from __future__ import annotations

import datetime
import json
import socket
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_mugrpo.asynchronous.files import write_json
from megatron_mugrpo.asynchronous.liveness import RankFailedError
from megatron_mugrpo.durable import read_json

BUCKET, END = 1, 2
"""Message kinds (the first field of every header)."""
PUBLISH, CLOSE = "publish", "close"
"""What an announce/<n> key says."""
GROUP_FILE = "publish_group.json"
HOSTED = "hosted"
"""Set by the trainer in its store under the launch's prefix: a worker that reaches a store without it
(an earlier launch's port, reused) goes on looking."""
POLL_S = 0.02
"""Seconds between two looks at the store (a new publication, the workers' progress)."""
ANNOUNCE_POLL_S = 0.005
"""Seconds between a worker's looks for the next publication (one store round trip each)."""
CONNECT_S = 10.0
"""Seconds a worker tries to reach the store a group file names before reading the file again (an
earlier launch's file names a store that no longer listens)."""
CLOSE_WAIT_S = 10.0
"""Seconds the trainer waits at the end of a run for the workers to see ``close`` (a dead one never will)."""

DTYPES = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.uint8)
}
"""Dtypes a publication carries, by the name SGLang's ``dtypes`` take ('bfloat16')."""


class PublishTimeoutError(RankFailedError):
    """A publication did not complete in time: the message names the rank(s) that fell behind."""


# ------------------------------------------------------------------------------------------------ buckets


@dataclass(frozen=True)
class TensorMeta:
    """Where one tensor lies in its bucket's flat buffer."""

    name: str
    dtype: str
    """A key of ``DTYPES``."""
    shape: tuple[int, ...]
    offset: int
    """Byte offset in the bucket: a multiple of the dtype's item size."""

    @property
    def nbytes(self) -> int:
        return DTYPES[self.dtype].itemsize * _numel(self.shape)


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


Bucket = list[tuple[TensorMeta, torch.Tensor]]


def bucket_nbytes(metas: list[TensorMeta]) -> int:
    return metas[-1].offset + metas[-1].nbytes if metas else 0


def plan_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], limit_bytes: int) -> Iterator[Bucket]:
    """Group a tensor stream into buckets of at most ``limit_bytes``, in stream order, lazily (one
    bucket of tensors alive at a time).

    A bucket closes when the next tensor would overflow it, or would start at a byte offset that is
    not a multiple of its item size (SGLang's flat layout has no padding). A tensor larger than
    ``limit_bytes`` travels alone. Worked example, limit 16 bytes: fp32[2] (8 B), bf16[3] (6 B, at 8),
    fp32[1] (at 14: misaligned), fp32[8] (32 B: alone) → [fp32[2], bf16[3]], [fp32[1]], [fp32[8]].
    """
    if limit_bytes < 1:
        raise ValueError(f"bucket limit {limit_bytes} must be >= 1 byte")
    bucket: Bucket = []
    offset = 0
    for name, tensor in named_tensors:
        dtype = str(tensor.dtype).removeprefix("torch.")
        if dtype not in DTYPES:
            raise TypeError(f"cannot publish {name!r}: dtype {tensor.dtype} is not one of {sorted(DTYPES)}")
        size = tensor.numel() * tensor.element_size()
        if bucket and (offset + size > limit_bytes or offset % tensor.element_size()):
            yield bucket
            bucket, offset = [], 0
        bucket.append((TensorMeta(name, dtype, tuple(tensor.shape), offset), tensor))
        offset += size
    if bucket:
        yield bucket


def pack(bucket: Bucket, buffer: torch.Tensor) -> torch.Tensor:
    """Copy the bucket's tensors into the front of ``buffer`` (flat uint8); returns that view."""
    flat = buffer[: bucket_nbytes([meta for meta, _ in bucket])]
    for meta, tensor in bucket:
        source = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        flat[meta.offset : meta.offset + meta.nbytes].copy_(source, non_blocking=True)
    return flat


def unpack(metas: list[TensorMeta], flat: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The tensors of a received bucket: views into ``flat`` (no copy)."""
    return [(m.name, flat[m.offset : m.offset + m.nbytes].view(DTYPES[m.dtype]).reshape(m.shape)) for m in metas]


# ------------------------------------------------------------------------------------------------ the group


@dataclass(frozen=True, kw_only=True)
class GroupAddress:
    """What ``publish_group.json`` holds: where to join this launch's publication group."""

    host: str
    port: int
    world_size: int
    """1 (the trainer) + the rollout workers."""
    prefix: str
    """Store key prefix of this launch."""
    data_backend: str
    """'gloo' or 'nccl': what carries the weights' bytes."""


def worker_name(rank: int) -> str:
    return f"rollout worker {rank - 1} (publication rank {rank})"


class PublicationGroup:
    """One member's end of the publication group (see the module docstring)."""

    def __init__(self, address: GroupAddress, rank: int, *, timeout_s: float, connect_s: float | None = None):
        self.address, self.rank, self.timeout_s = address, rank, timeout_s
        connect = datetime.timedelta(seconds=connect_s if connect_s is not None else timeout_s)
        self.store = dist.TCPStore(
            address.host, address.port, address.world_size, rank == 0, timeout=connect, wait_for_workers=False
        )
        self.store.set_timeout(datetime.timedelta(seconds=timeout_s))
        self.keys = dist.PrefixStore(address.prefix, self.store)
        self.control: dist.ProcessGroup | None = None
        self.data: dist.ProcessGroup | None = None

    @property
    def workers(self) -> range:
        return range(1, self.address.world_size)

    def has(self, key: str) -> bool:
        return self.keys.check([key])

    def open(self, device: torch.device) -> None:
        """Build the process groups (collective over the group: blocks until every member calls it)."""
        timeout = datetime.timedelta(seconds=self.timeout_s)
        size = self.address.world_size
        try:
            self.control = dist.ProcessGroupGloo(dist.PrefixStore("control", self.keys), self.rank, size, timeout)
            if self.address.data_backend == "nccl":  # GPU: the weights' bytes over NVLink / InfiniBand
                options = dist.ProcessGroupNCCL.Options()
                options._timeout = timeout
                self.data = dist.ProcessGroupNCCL(dist.PrefixStore("data", self.keys), self.rank, size, options)
            else:
                self.data = self.control
        except RuntimeError as exc:
            if self.rank != 0:
                raise
            late = [r for r in self.workers if not self.has(f"joined/{r}")] or list(self.workers)
            raise PublishTimeoutError(
                f"{', '.join(worker_name(r) for r in late)} never joined the publication group within "
                f"async.publish_timeout_s={self.timeout_s:g} ({self.address.host}:{self.address.port}: "
                f"{_first_line(exc)}). Check that the worker runs and reaches the trainer's host, or set "
                "async.publish=disk"
            ) from exc
        self.device = device

    def broadcast(self, tensor: torch.Tensor, *, data: bool = False) -> None:
        group = self.data if data else self.control
        group.broadcast([tensor], dist.BroadcastOptions()).wait()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200] if text else ''}"


def host_group(root: Path, *, world_size: int, timeout_s: float, data_backend: str) -> PublicationGroup:
    """The trainer's side: start the store at a free port and name it in ``root/publish_group.json``.
    Nothing blocks here; the process groups are built at the first publication (``Sender``)."""
    with socket.socket() as sock:  # a free port, released just before the store binds it
        sock.bind(("", 0))
        port = sock.getsockname()[1]
    address = GroupAddress(
        host=socket.gethostname(),
        port=port,
        world_size=world_size,
        prefix=f"publish/{uuid.uuid4().hex[:12]}",
        data_backend=data_backend,
    )
    group = PublicationGroup(address, 0, timeout_s=timeout_s)
    group.keys.set(HOSTED, "1")
    write_json(root / GROUP_FILE, asdict(address))  # after the store listens: a reader always finds it
    return group


def join_group(root: Path, rank: int, *, timeout_s: float, alive: Callable[[], None]) -> PublicationGroup:
    """A worker's side: connect to the store ``root/publish_group.json`` names, and say so.

    Retries until it reaches this launch's store: the file may not exist yet, or be an earlier
    launch's (nobody listens at its port, or another program's store does: no ``HOSTED`` key).
    ``alive()`` is called between attempts and raises when the worker stops.
    """
    while True:
        alive()
        values = read_json(root / GROUP_FILE)
        if values is not None:
            try:
                group = PublicationGroup(GroupAddress(**values), rank, timeout_s=timeout_s, connect_s=CONNECT_S)
                ours = group.has(HOSTED)  # a port an earlier launch named may now be another program's store
            except (RuntimeError, OSError):  # dist's store errors are RuntimeErrors: nobody listens there
                ours = False
            if ours:
                group.keys.set(f"joined/{rank}", "1")
                return group
        time.sleep(POLL_S * 10)


# ------------------------------------------------------------------------------------------------ sending


@dataclass(frozen=True, kw_only=True)
class SendStats:
    """What one publication cost the trainer."""

    seconds: float
    """Blocked: from the first bucket to every worker holding the whole publication."""
    buckets: int
    nbytes: int
    """Weight bytes sent."""
    buffer_bytes: int
    """The sender's bucket buffer: all the memory publication adds on the trainer."""


class Sender:
    """The trainer's end: ``send`` one publication; ``close`` at the end of the run."""

    def __init__(self, group: PublicationGroup, *, bucket_bytes: int, device: torch.device):
        self.group, self.bucket_bytes, self.device = group, bucket_bytes, device
        self.serial = 0
        self._buffers: list[torch.Tensor | None] = [None, None]
        """Two bucket buffers: one on the wire while the next bucket is packed into the other."""

    def _announce(self, what: str) -> None:
        self.group.keys.set(f"announce/{self.serial}", what)
        if self.group.control is None:  # the first publication: the workers build the groups with us
            self.group.keys.set("open", "1")
            self.group.open(self.device)

    def send(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        *,
        name: str,
        version: int,
        digest: Callable[[], str] = lambda: "",
        watch: Callable[[], None] = lambda: None,
    ) -> SendStats:
        """Broadcast one publication; returns when every worker holds all of it. ``digest()`` is called
        after the last tensor went (a hash computed while streaming); ``watch()`` while waiting for the
        workers' receipts (the trainer checks their heartbeats: it raises for a dead one)."""
        started = time.monotonic()
        deadline = started + self.group.timeout_s
        self._announce(PUBLISH)
        buckets = nbytes = 0
        in_flight: list[Any] = [None] * len(self._buffers)
        try:
            for bucket in plan_buckets(named_tensors, self.bucket_bytes):
                slot = buckets % len(self._buffers)  # bucket b+1 is packed while bucket b is on the wire
                if in_flight[slot] is not None:
                    in_flight[slot].wait()  # its buffer is free again
                size = bucket_nbytes([meta for meta, _ in bucket])
                metas = [[m.name, m.dtype, list(m.shape), m.offset] for m, _ in bucket]
                self._message(BUCKET, version, metas)
                flat = pack(bucket, self._buffer_of(slot, size))
                in_flight[slot] = self.group.data.broadcast([flat], dist.BroadcastOptions())
                buckets, nbytes = buckets + 1, nbytes + size
                self._check_deadline(deadline, f"after bucket {buckets}")
            for work in in_flight:
                if work is not None:
                    work.wait()
            if self.device.type == "cuda":  # the blocked time includes the transfer itself
                torch.cuda.synchronize(self.device)
            self._message(END, version, {"name": name, "version": version, "digest": digest()})
            self._wait_received(deadline, watch)
        except RankFailedError:  # ours, or a dead worker named by ``watch``
            raise
        except RuntimeError as exc:  # a collective timed out or a peer vanished: name who is behind
            raise PublishTimeoutError(self._behind(f"publication {name} failed at bucket {buckets + 1}", exc)) from exc
        finally:
            self.serial += 1
        held = sum(b.numel() for b in self._buffers if b is not None)
        return SendStats(seconds=time.monotonic() - started, buckets=buckets, nbytes=nbytes, buffer_bytes=held)

    def _buffer_of(self, slot: int, size: int) -> torch.Tensor:
        """Bucket buffer ``slot``, grown to the largest bucket so far (a small model never takes a whole
        bucket_mib), allocated once and reused by every publication."""
        buffer = self._buffers[slot]
        if buffer is None or buffer.numel() < size:
            self._buffers[slot] = None  # the old one goes first
            self._buffers[slot] = buffer = torch.empty(size, dtype=torch.uint8, device=self.device)
        return buffer

    def _message(self, kind: int, version: int, meta: object) -> None:
        encoded = torch.frombuffer(bytearray(json.dumps(meta).encode()), dtype=torch.uint8)
        header = torch.tensor([kind, encoded.numel(), 0, version], dtype=torch.int64)
        self.group.broadcast(header)
        self.group.broadcast(encoded)

    def _check_deadline(self, deadline: float, where: str) -> None:
        if time.monotonic() > deadline:
            raise PublishTimeoutError(self._behind(f"publication {self.serial} is still running {where}", None))

    def _wait_received(self, deadline: float, watch: Callable[[], None]) -> None:
        """Poll the receipts (``check`` never blocks; a blocking wait's timeouts would each log a c10d warning)."""
        keys = [f"received/{r}/{self.serial}" for r in self.group.workers]
        while not self.group.keys.check(keys):
            watch()  # a worker that died meanwhile is named by its heartbeat, long before the timeout
            self._check_deadline(deadline, "waiting for the workers to confirm")
            time.sleep(ANNOUNCE_POLL_S)

    def _behind(self, what: str, exc: BaseException | None) -> str:
        late = [r for r in self.group.workers if not self.group.has(f"received/{r}/{self.serial}")]
        progress = {}
        for r in late:
            key = f"progress/{r}"
            progress[r] = self.group.keys.get(key).decode() if self.group.has(key) else "nothing"
        named = "; ".join(f"{worker_name(r)} received {progress[r]}" for r in late) or "no worker is behind"
        cause = f" ({_first_line(exc)})" if exc is not None else ""
        return (
            f"{what}: not complete within async.publish_timeout_s={self.group.timeout_s:g}: {named}{cause}. "
            "That worker hangs or cannot keep up; see its log (or raise async.publish_timeout_s, "
            "or set async.publish=disk)"
        )

    def close(self) -> None:
        """Tell the workers there is nothing more; wait briefly for them to see it."""
        self.group.keys.set(f"announce/{self.serial}", CLOSE)
        deadline = time.monotonic() + CLOSE_WAIT_S
        while time.monotonic() < deadline and not all(self.group.has(f"closed/{r}") for r in self.group.workers):
            time.sleep(POLL_S)


# ------------------------------------------------------------------------------------------------ receiving


@dataclass(frozen=True, kw_only=True)
class Received:
    """A whole publication, staged in the worker's memory."""

    name: str
    version: int
    digest: str
    tensors: list[tuple[str, torch.Tensor]]
    """Views into the received buckets (on the worker's device)."""
    buffers: list[torch.Tensor]
    """The received buckets (``Receiver.recycle`` reuses them once the publication is applied)."""
    seconds: float
    """From its first bucket to its last."""

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.tensors)


class Receiver:
    """A worker's end: ``next()`` waits for the trainer's next message and returns the publication it
    carries (None: the run's publications are over)."""

    def __init__(self, group: PublicationGroup, *, device: torch.device, alive: Callable[[], None]):
        self.group, self.device, self.alive = group, device, alive
        self.serial = 0
        self._spare: list[torch.Tensor] = []
        """Bucket buffers of a publication that was applied or replaced, reused by the next one: fresh
        memory is faulted in page by page as the bytes arrive, which halves the receive rate on CPU."""

    def recycle(self, received: Received) -> None:
        """``received`` is applied (or will never be): its buffers may take the next publication. Only
        one publication's buffers are kept."""
        self._spare = list(received.buffers)

    def _buffer(self, nbytes: int) -> torch.Tensor:
        spare = self._spare  # the main thread may replace the list meanwhile (``recycle``)
        for i, buffer in enumerate(spare):
            if buffer.numel() == nbytes:  # bucket sizes repeat: every publication exports the same tensors
                return spare.pop(i)
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def next(self) -> Received | None:
        key = f"announce/{self.serial}"
        while not self._arrived(key):  # a long training interval never times a collective out
            self.alive()
        if self.group.keys.get(key).decode() == CLOSE:
            self.group.keys.set(f"closed/{self.group.rank}", "1")
            return None
        if self.group.control is None:
            while not self.group.has("open"):
                self.alive()
                time.sleep(POLL_S)
            self.group.open(self.device)
        received = self._receive()
        self.group.keys.set(f"received/{self.group.rank}/{self.serial}", "1")
        self.serial += 1
        return received

    def _arrived(self, key: str) -> bool:
        """Whether ``key`` is set, after a short sleep when it is not (``check`` never blocks: a blocking
        wait that times out every second would fill the log with c10d's warnings)."""
        if self.group.has(key):
            return True
        time.sleep(ANNOUNCE_POLL_S)
        return False

    def _receive(self) -> Received:
        tensors: list[tuple[str, torch.Tensor]] = []
        buffers: list[torch.Tensor] = []
        started, buckets = time.monotonic(), 0
        while True:
            kind, version, meta = self._message()
            if kind == END:
                return Received(
                    name=meta["name"],
                    version=int(meta["version"]),
                    digest=meta["digest"],
                    tensors=tensors,
                    buffers=buffers,
                    seconds=time.monotonic() - started,
                )
            metas = [TensorMeta(n, d, tuple(s), o) for n, d, s, o in meta]
            flat = self._buffer(bucket_nbytes(metas))  # the staging area
            self.group.broadcast(flat, data=True)
            if flat.is_cuda:  # NCCL's wait only orders streams: the bytes must be there before we say so,
                torch.cuda.synchronize(flat.device)  # and before another process (SGLang) reads them by IPC
            buffers.append(flat)
            tensors += unpack(metas, flat)
            buckets += 1
            self.group.keys.set(f"progress/{self.group.rank}", f"{buckets} bucket(s) of version {version}")

    def _message(self) -> tuple[int, int, object]:
        header = torch.zeros(4, dtype=torch.int64)
        self.group.broadcast(header)
        kind, length, _, version = (int(x) for x in header)
        encoded = torch.empty(length, dtype=torch.uint8)
        self.group.broadcast(encoded)
        return kind, version, json.loads(bytes(encoded.numpy()).decode())
