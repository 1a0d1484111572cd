"""Weights in memory (``async.publish: memory``): the trainer broadcasts its policy to the rollout workers
over a process group made for publication, in buckets, while the workers keep generating.

Who joins: the trainer's writer rank (rank 0 of the group, the broadcasts' root) and every rollout
worker (rank 1 + w). The group is its own: a TCP store the trainer hosts, named in
``RUN_DIR/async/publish_group.json`` with a launch prefix fresh for each launch, and process groups
built on it directly (``ProcessGroupGloo`` / ``ProcessGroupNCCL``), so neither the trainer's
torch.distributed world nor Megatron's groups see it, and the workers still never call
``init_process_group``. Control messages go over gloo (CPU); the weights' bytes over gloo on CPU,
over NCCL when the trainer has CUDA.

Who may talk to the store (threat model). A ``TCPStore`` has no authentication: whoever reaches its
port may read or write any key whose name it knows. Two things keep others out:

* **Where it listens.** The trainer binds the store's socket itself, to the one address the workers use
  (``listen_address``: the local end of the route to torchrun's ``MASTER_ADDR``; loopback on one node),
  and hands the bound socket to the store (``master_listen_fd``). Nothing listens on the other
  interfaces, and the port is the kernel's choice at bind time, so there is no window in which another
  program can take it (the old pick-a-free-port-then-bind had one).
* **A per-launch secret.** The trainer draws 128 random bits (``secrets``) and writes them to
  ``RUN_DIR/async/publish_secret`` (mode 0600, written before the group file names the store). Every
  key the group reads or writes (hand-shake, announcements, receipts, and the process groups'
  rendezvous, through which peers learn each other's addresses) lives under a prefix derived from the
  secret (``GroupSecret.keys``), so a client without the run directory can neither forge a receipt or
  an announcement nor slip its own address into a process group. Before a worker uses a store it checks
  the trainer's proof, an HMAC of the launch's address under the secret stored under the public launch
  prefix: a store without it (an earlier launch's port, another program) is never told a secret key.

Out of scope: an attacker who can read the run directory (the same user, or root), and one on the
network path: the store, gloo and NCCL send everything, weights included, unencrypted. On a shared
network, run the workers and the trainer on a private one (or set async.publish=disk).

Hand-shake through the store (polled with ``check``, which never blocks, so that a worker waiting
hours for the next publication never trips a collective's timeout)::

    trainer (Feed.open)      store up, proof set, publish_secret then publish_group.json written
    worker (receiver thread) connects, checks the proof, sets joined/<rank>, waits for 'open'
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

Where a worker holds what it receives (``staging_place``): a worker holds up to two publications
besides its engine's weights (the one staged, the one arriving), two full copies of the model. An
SGLang engine has taken ``rollout.sglang.mem_fraction_static`` of the GPU for weights and KV cache, and
those copies would come on top of it (at 7B in bf16, 30 GB), so an SGLang worker with a GPU holds them in
pinned host memory: over NCCL each bucket lands in one GPU buffer (``async.bucket_mib``, the only GPU
memory staging takes outside SGLang's fraction) and is copied to the host at once. A transformers engine
has no such fraction and keeps them on its device, ready to copy.

A publication that does not finish within ``async.publish_timeout_s`` raises ``PublishTimeoutError``
naming the worker(s) that fell behind, read from their progress keys. The trainer never blocks on the
wire without a bound: it polls its broadcasts' completion (``wait_until``), checking the workers'
heartbeats and the deadline between looks. Over NCCL a blocking wait would be ``cuda.synchronize``, which a
worker that died during the last bucket leaves hanging until NCCL's watchdog kills the trainer with a
message that names nobody.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import ipaddress
import json
import logging
import os
import secrets
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
from megatron_mugrpo.durable import atomic_write_bytes, read_json

BUCKET, END = 1, 2
"""Message kinds (the first field of every header)."""
PUBLISH, CLOSE = "publish", "close"
"""What an announce/<n> key says."""
GROUP_FILE = "publish_group.json"
SECRET_FILE = "publish_secret"
"""The launch's secret (hex), mode 0600, next to the group file."""
SECRET_BYTES = 16
"""128 bits: no client that cannot read the run directory guesses the keys."""
PROOF = "proof"
"""Set by the trainer under the public launch prefix: ``GroupSecret.proof`` of its address. A worker that
reaches a store without the right one (an earlier launch's port, reused, or someone else's store)
goes on looking, and never sends it a key under the secret prefix."""
LISTEN_BACKLOG = 128
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


log = logging.getLogger(__name__)


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
    """Public store key prefix of this launch (the proof lives under it; every other key under
    ``GroupSecret.keys``)."""
    data_backend: str
    """'gloo' or 'nccl': what carries the weights' bytes."""


def worker_name(rank: int) -> str:
    return f"rollout worker {rank - 1} (publication rank {rank})"


@dataclass(frozen=True)
class GroupSecret:
    """The launch's secret (hex) and what is derived from it for one address."""

    token: str

    @classmethod
    def fresh(cls) -> GroupSecret:
        return cls(secrets.token_hex(SECRET_BYTES))

    def _mac(self, what: str) -> str:
        return hmac.new(bytes.fromhex(self.token), what.encode(), hashlib.sha256).hexdigest()

    def keys(self, address: GroupAddress) -> str:
        """The store prefix of every key but the proof: unguessable without the secret."""
        return f"{address.prefix}/{self._mac(f'keys:{address.prefix}')[:32]}"

    def proof(self, address: GroupAddress) -> str:
        """What the trainer stores under ``address.prefix/PROOF``: binds the secret to this launch's address."""
        return self._mac(f"proof:{address.prefix}:{address.host}:{address.port}")

    def verifies(self, address: GroupAddress, proof: bytes) -> bool:
        return hmac.compare_digest(self.proof(address).encode(), proof)


def write_secret(path: Path, secret: GroupSecret) -> None:
    """``path`` holds the secret, readable by its owner only: created 0600 (never the umask's mode, even
    for a moment) and replaced atomically (``durable``)."""
    atomic_write_bytes(path, secret.token.encode(), mode=0o600)


def read_secret(path: Path) -> GroupSecret | None:
    """The secret in ``path`` (None when there is none yet)."""
    try:
        token = path.read_text().strip()
    except FileNotFoundError:
        return None
    return GroupSecret(token) if len(token) == 2 * SECRET_BYTES else None


def listen_address(environ: dict[str, str] | os._Environ = os.environ) -> str:
    """The IPv4 address the workers reach the trainer at, which the store listens on alone.

    torchrun gives every rank ``MASTER_ADDR``, the host all of them reach: loopback there (one node)
    means loopback here; otherwise the local end of the route to it (no packet is sent: connecting a
    UDP socket only asks the kernel which interface it would use). Without ``MASTER_ADDR`` (one process,
    the tests) the store is local: 127.0.0.1.
    """
    master = environ.get("MASTER_ADDR", "").strip()
    if not master:
        return "127.0.0.1"
    try:
        resolved = socket.getaddrinfo(master, None, socket.AF_INET, socket.SOCK_DGRAM)[0][4][0]
        if ipaddress.ip_address(resolved).is_loopback:
            return "127.0.0.1"
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((resolved, 9))
            return probe.getsockname()[0]
    except OSError as exc:
        raise RuntimeError(
            f"cannot find the local address that reaches MASTER_ADDR={master!r} ({exc}), where the publication "
            "store would listen for the rollout workers: set MASTER_ADDR to an address of the trainer's node, or "
            "set async.publish=disk"
        ) from exc


def _listener(host: str) -> socket.socket:
    """A TCP socket bound to ``host`` at a port the kernel picks, listening: the store's, from the start."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((host, 0))
        sock.listen(LISTEN_BACKLOG)
    except OSError:
        sock.close()
        raise
    return sock


class PublicationGroup:
    """One member's end of the publication group (see the module docstring)."""

    def __init__(
        self,
        address: GroupAddress,
        rank: int,
        *,
        secret: GroupSecret,
        timeout_s: float,
        connect_s: float | None = None,
        listener: socket.socket | None = None,
    ):
        """``listener``: the trainer's bound, listening socket, which the store takes over (and closes)."""
        self.address, self.rank, self.timeout_s, self.secret = address, rank, timeout_s, secret
        connect = datetime.timedelta(seconds=connect_s if connect_s is not None else timeout_s)
        listen = {} if listener is None else {"master_listen_fd": listener.detach()}
        self.store = dist.TCPStore(
            address.host, address.port, address.world_size, rank == 0, timeout=connect, wait_for_workers=False, **listen
        )
        self.store.set_timeout(datetime.timedelta(seconds=timeout_s))
        self.public = dist.PrefixStore(address.prefix, self.store)
        """The launch's public keys: only the proof."""
        self.keys = dist.PrefixStore(secret.keys(address), self.store)
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


def wait_until(
    done: Callable[[], bool],
    *,
    deadline: float,
    watch: Callable[[], None],
    expired: Callable[[], BaseException],
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    """Poll ``done()`` until true. Between looks ``watch()`` may raise (a worker's heartbeat stopped: its
    error names it), and past ``deadline`` (``clock()`` time) ``expired()`` is raised. ``done()`` is looked
    at once more after the deadline, so work that completed meanwhile is never reported as late."""
    while not done():
        watch()
        if clock() > deadline:
            if done():
                return
            raise expired()
        sleep(ANNOUNCE_POLL_S)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200] if text else ''}"


def host_group(
    root: Path, *, world_size: int, timeout_s: float, data_backend: str, host: str | None = None
) -> PublicationGroup:
    """The trainer's side: start the store on ``host`` (default ``listen_address()``) at a port the kernel
    picks, write a fresh secret, and name the store in ``root/publish_group.json``. Nothing blocks here;
    the process groups are built at the first publication (``Sender``)."""
    listener = _listener(host or listen_address())
    bound_host, port = listener.getsockname()[:2]
    address = GroupAddress(
        host=bound_host,
        port=port,
        world_size=world_size,
        prefix=f"publish/{uuid.uuid4().hex[:12]}",
        data_backend=data_backend,
    )
    secret = GroupSecret.fresh()
    group = PublicationGroup(address, 0, secret=secret, timeout_s=timeout_s, listener=listener)
    group.public.set(PROOF, secret.proof(address))
    write_secret(root / SECRET_FILE, secret)  # before the group file: a worker that reads the file finds it
    write_json(root / GROUP_FILE, asdict(address))  # after the store listens: a reader always finds it
    log.info("publication store listening on %s:%d (key prefix %s)", bound_host, port, address.prefix)
    return group


def join_group(root: Path, rank: int, *, timeout_s: float, alive: Callable[[], None]) -> PublicationGroup:
    """A worker's side: connect to the store ``root/publish_group.json`` names, and say so.

    Retries until it reaches this launch's store: the file may not exist yet, or be an earlier
    launch's (nobody listens at its port, or another program's store does), or the secret beside it
    may be another launch's: a store is used only once its proof checks out against the secret
    (``GroupSecret.verifies``), before any key under the secret prefix is sent to it.
    ``alive()`` is called between attempts and raises when the worker stops.
    """
    while True:
        alive()
        values, secret = read_json(root / GROUP_FILE), read_secret(root / SECRET_FILE)
        if values is not None and secret is not None:
            address = GroupAddress(**values)
            try:
                group = PublicationGroup(address, rank, secret=secret, timeout_s=timeout_s, connect_s=CONNECT_S)
                ours = group.public.check([PROOF]) and secret.verifies(address, group.public.get(PROOF))
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
                if in_flight[slot] is not None:  # its buffer is free again once bucket b-2 has gone
                    self._drain([in_flight[slot]], deadline, watch, f"sending bucket {buckets - 1}", last=False)
                size = bucket_nbytes([meta for meta, _ in bucket])
                metas = [[m.name, m.dtype, list(m.shape), m.offset] for m, _ in bucket]
                self._message(BUCKET, version, metas)
                flat = pack(bucket, self._buffer_of(slot, size))
                in_flight[slot] = self.group.data.broadcast([flat], dist.BroadcastOptions())
                buckets, nbytes = buckets + 1, nbytes + size
                self._check_deadline(deadline, f"after bucket {buckets}")
            self._drain([w for w in in_flight if w is not None], deadline, watch, f"sending bucket {buckets}")
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

    def _drain(
        self, works: list[Any], deadline: float, watch: Callable[[], None], where: str, *, last: bool = True
    ) -> None:
        """Return once ``works`` (broadcasts) completed: polled, so that a dead worker is named by ``watch``
        (its heartbeat) or by the deadline (``_behind``), never left to NCCL's watchdog. Then ``wait()``
        raises a failed broadcast's error (and orders the compute stream after NCCL's); after the
        ``last`` ones, on CUDA, the blocked time includes the transfer itself."""
        try:
            wait_until(
                lambda: all(work.is_completed() for work in works),
                deadline=deadline,
                watch=watch,
                expired=lambda: PublishTimeoutError(self._behind(f"publication {self.serial} is still {where}", None)),
            )
        except RankFailedError:
            self._abandon()
            raise
        for work in works:
            work.wait()
        if last and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # every broadcast is complete: returns at once

    def _abandon(self) -> None:
        """Abort the NCCL communicator of a broadcast that will never complete: its kernel would otherwise
        hold the GPU stream (and the process's exit) until NCCL's watchdog kills the trainer, before the
        error naming the worker is printed. Gloo's pending work ends with its own timeout."""
        if self.group.address.data_backend == "nccl" and self.group.data is not None:
            self.group.data.abort()

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


@dataclass(frozen=True)
class StagingPlace:
    """Where a worker's publications arrive and where they are held (see the module docstring)."""

    wire: torch.device
    """Where a bucket lands: NCCL needs the GPU."""
    hold: torch.device
    """Where the received publications are held until the engine copies them."""
    pinned: bool
    """``hold`` is pinned host memory (fast copies to and from the GPU)."""


HOST_STAGING_ENGINES = ("sglang",)
"""Engines that reserve a fixed fraction of the GPU for themselves: their workers stage on the host."""


def staging_place(engine: str, *, data_backend: str, gpu: torch.device | None) -> StagingPlace:
    """Where a rollout worker with ``engine`` and GPU ``gpu`` (None: CPU only) receives and holds the
    publications sent over ``data_backend``. Worked example: SGLang on cuda:3 over NCCL lands each bucket on
    cuda:3 and holds it in pinned host memory; transformers on cuda:3 lands and holds on cuda:3; without a
    GPU, both on the CPU."""
    cpu = torch.device("cpu")
    if gpu is None:
        return StagingPlace(wire=cpu, hold=cpu, pinned=False)
    if engine in HOST_STAGING_ENGINES:
        return StagingPlace(wire=gpu if data_backend == "nccl" else cpu, hold=cpu, pinned=True)
    return StagingPlace(wire=gpu, hold=gpu, pinned=False)


class Receiver:
    """A worker's end: ``next()`` waits for the trainer's next message and returns the publication it
    carries (None: the run's publications are over)."""

    def __init__(
        self,
        group: PublicationGroup,
        *,
        device: torch.device,
        alive: Callable[[], None],
        hold: torch.device | None = None,
        pinned: bool = False,
    ):
        """``device``: where buckets land; ``hold`` (default ``device``): where publications are held, in
        pinned host memory when ``pinned`` (``staging_place``)."""
        self.group, self.device, self.alive = group, device, alive
        self.hold, self.pinned = hold or device, pinned
        self._wire: torch.Tensor | None = None
        """The one landing buffer when ``device`` is not ``hold`` (grown to the largest bucket)."""
        self.serial = 0
        self._spare: list[torch.Tensor] = []
        """Bucket buffers of a publication that was applied or replaced, reused by the next one: fresh
        memory is faulted in page by page as the bytes arrive, which halves the receive rate on CPU."""

    def recycle(self, received: Received) -> None:
        """``received`` is applied (or will never be): its buffers may take the next publication. Only
        one publication's buffers are kept."""
        self._spare = list(received.buffers)

    def _buffer(self, nbytes: int) -> torch.Tensor:
        """A buffer of ``nbytes`` where publications are held."""
        spare = self._spare  # the main thread may replace the list meanwhile (``recycle``)
        for i, buffer in enumerate(spare):
            if buffer.numel() == nbytes:  # bucket sizes repeat: every publication exports the same tensors
                return spare.pop(i)
        return torch.empty(nbytes, dtype=torch.uint8, device=self.hold, pin_memory=self.pinned)

    def _landing(self, nbytes: int) -> torch.Tensor:
        """Where a bucket of ``nbytes`` arrives: the held buffer itself, or the one landing buffer."""
        if self.device == self.hold:
            return self._buffer(nbytes)
        if self._wire is None or self._wire.numel() < nbytes:
            self._wire = None  # the old one goes first
            self._wire = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return self._wire[:nbytes]

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
            landed = self._landing(bucket_nbytes(metas))
            self.group.broadcast(landed, data=True)
            flat = landed if self.device == self.hold else self._buffer(landed.numel()).copy_(landed)
            if landed.is_cuda:  # NCCL's wait only orders streams: the bytes must be there before we say so,
                torch.cuda.synchronize(landed.device)  # and before another process (SGLang) reads them by IPC
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
