"""Storage engine of the step directories: megatron-core's ``torch_dist`` format, written and read at disk speed.

``training.checkpoint`` decides *what* goes into a step directory; this module decides *how the bytes
move*. The files stay exactly what megatron-core's default ``torch_dist`` strategy writes (a
``torch.distributed.checkpoint`` directory: ``__<rank>_<i>.distcp`` files, ``.metadata``,
``common.pt``, ``metadata.json``), so any megatron-core tool reads them and resharding on load works
unchanged. What changes is the machinery around them:

- **Writer threads instead of writer processes.** megatron-core forks one process per file and
  collects results through a ``multiprocessing.Manager`` server (a spawned process that outlives a
  SIGKILLed trainer). Here each rank writes its ``thread_count`` files from threads of its own
  process: file writes, checksums and fsync release the GIL, nothing is forked, nothing survives the
  trainer.
- **Hash while writing, fsync once per file.** Every byte goes through the checksum on its way to the file
  (one pass over memory); the digest feeds the step directory's checksum manifest. Each file is
  fsynced once, at its end, when ``fsync`` is on; every ``WRITEBACK_BYTES`` before that the kernel is
  asked to start writing what came so far, so the disk works while the file is produced.
- **No copies of views.** megatron-core clones tensors that view a larger storage (e.g. the gate and
  up halves of a fused fc1) because ``torch.save`` of a view writes the whole storage. A contiguous
  view is instead re-wrapped, without copying, as a tensor that owns exactly its bytes.
- **No zip CRC-32.** ``torch.save`` computes a CRC-32 per record that ``torch.load`` never checks;
  the checksum of the file covers it, so the CRC pass is switched off while items are written.
- **Async: a snapshot, then threads.** With ``snapshot=True`` the write buckets are first copied to
  host buffers that are kept between saves (pinned when the tensors live on a GPU), so training can
  overwrite the parameters while the threads write.
- **Reading straight into the parameters.** When a stored item is exactly the tensor the model asks
  for (same shape and dtype, the usual case when TP / PP do not change), its bytes are read from the
  file directly into the parameter: no intermediate tensor, one copy from the page cache. Other
  items (resharding) take ``torch.distributed.checkpoint``'s general path.

megatron-core builds its writer and reader inside ``TorchDistSaveShardedStrategy.async_save`` and
``TorchDistLoadShardedStrategy.load``; the two strategies below substitute ours for the duration of
that one call (``_substituted``), so the planning, metadata and resharding logic stay megatron's.

    strategy = ThreadedSaveStrategy(thread_count=2, fsync=True, snapshot=False)
    request = dist_checkpointing.save(sharded_sd, directory, sharded_strategy=strategy, async_sharded_save=True)
    request.execute_sync()            # or hand it to an AsyncCallsQueue (see training.checkpoint)
    strategy.digests()                # [FileDigest(path="__0_0.distcp", checksum=..., nbytes=...), ...]
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import io
import logging
import os
import pickle
import threading
import warnings
import zipfile
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from heapq import heappop, heappush
from pathlib import Path
from typing import Any

import torch
from megatron.core.dist_checkpointing.strategies import torch as mcore_torch_strategy
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCaller, AsyncCallsQueue, AsyncRequest
from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
from megatron.core.dist_checkpointing.strategies.torch import (
    TorchDistLoadShardedStrategy,
    TorchDistSaveShardedStrategy,
)
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, _StorageInfo
from torch.distributed.checkpoint.planner import LoadItemType, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from megatron_mugrpo import durable

logger = logging.getLogger(__name__)

DEFAULT_THREADS = 2
"""Writer threads (and files) per rank: enough to overlap the checksum of one file with the write of another."""
WRITEBACK_BYTES = 8 * 1024 * 1024
"""How much a writer produces before it asks the kernel to start writing it to disk (when fsyncing)."""
_STORE = "torch_dist"
_STORE_VERSION = 1

WriteBucket = tuple[str, str, tuple[list, list]]
"""megatron-core's unit of writing: (file path, file name, ([(item, bytes)], [(item, tensor)]))."""


CHECKSUM = durable.DEFAULT_ALGORITHM
"""The algorithm new step directories' manifests name (xxHash3-128: checksumming costs less than
writing the bytes). Manifests naming another of ``durable.CHECKSUMS`` (SHA-256 ones, written before)
still verify."""


@dataclass(frozen=True)
class FileDigest:
    """One written file: its path relative to the step directory, ``CHECKSUM`` (hex) and size."""

    path: str
    checksum: str
    nbytes: int


# --------------------------------------------------------------------------------- writing


def _libc_sync_file_range() -> Callable[[int, int, int, int], int] | None:
    """Linux's ``sync_file_range(2)`` (not in ``os``), or None where the C library lacks it."""
    try:
        function = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (AttributeError, OSError, TypeError):  # no such function, or no C library to open by None
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


_SYNC_FILE_RANGE = _libc_sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2  # start writeback of the range's dirty pages; do not wait for it


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing ``[offset, offset + nbytes)`` of ``fd`` to disk now (best effort).

    Without it the page cache holds a whole file's dirty pages until the final fsync, which then
    waits for all of them: the disk idles while the file is produced and the producer idles while
    the disk writes. Started early, the disk writes each chunk while the next one is produced.
    """
    if _SYNC_FILE_RANGE is not None:
        _SYNC_FILE_RANGE(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)  # failure only forgoes the overlap


class _HashingFile:
    """A write-only file that hashes what it writes and knows its position (for item offsets).

    With ``writeback`` on, the kernel is asked every ``WRITEBACK_BYTES`` to start writing what came
    before, so that the final fsync finds little left to do.
    """

    def __init__(self, path: str, *, writeback: bool = False) -> None:
        self._file = open(path, "wb", buffering=0)  # noqa: SIM115 - closed in finish()
        self._hash = durable.new_hasher(CHECKSUM)
        self._pos = 0
        self._writeback = writeback
        self._flushed = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self._hash.update(view)
        done = 0
        while done < len(view):  # a raw write may be partial
            done += self._file.write(view[done:])
        self._pos += done
        if self._writeback and self._pos - self._flushed >= WRITEBACK_BYTES:
            start_writeback(self._file.fileno(), self._flushed, self._pos - self._flushed)
            self._flushed = self._pos
        return done

    def tell(self) -> int:
        return self._pos

    def flush(self) -> None:
        """Nothing is buffered (torch.save calls this)."""

    def finish(self, *, fsync: bool) -> str:
        """Close (after one fsync when asked) and return the hex checksum of everything written."""
        try:
            if fsync:
                os.fsync(self._file.fileno())
        finally:
            self._file.close()
        return self._hash.hexdigest()


def _serialization_config() -> Any:
    """torch.save's config (``compute_crc32``), or None for a torch without the switch."""
    try:
        from torch.utils.serialization import config  # not imported by ``import torch``
    except ImportError:
        return None
    return config if hasattr(getattr(config, "save", None), "compute_crc32") else None


_CONFIG_PER_THREAD = tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 13)
"""From torch 2.13 on, config overrides live in a ContextVar: a value set in one thread is not seen
by another, so each writer thread must switch the CRC off for itself. Before, the switch was
process-wide and set once around the whole pool."""
_NO_CRC_USERS = 0
_NO_CRC_LOCK = threading.Lock()


@contextlib.contextmanager
def _without_zip_crc() -> Iterator[None]:
    """Skip torch.save's per-record CRC-32 while the writer threads run (torch.load never checks it).

    Process-wide torch (< 2.13): concurrent writers count themselves in and the last one out
    restores the previous value. Per-thread torch: nothing here, see ``_thread_without_zip_crc``.
    """
    global _NO_CRC_USERS
    save_config = getattr(_serialization_config(), "save", None)
    if save_config is None or _CONFIG_PER_THREAD:
        yield
        return
    with _NO_CRC_LOCK:
        if _NO_CRC_USERS == 0:
            _without_zip_crc.saved = save_config.compute_crc32  # type: ignore[attr-defined]
            save_config.compute_crc32 = False
        _NO_CRC_USERS += 1
    try:
        yield
    finally:
        with _NO_CRC_LOCK:
            _NO_CRC_USERS -= 1
            if _NO_CRC_USERS == 0:
                save_config.compute_crc32 = _without_zip_crc.saved  # type: ignore[attr-defined]


def _thread_without_zip_crc() -> contextlib.AbstractContextManager:
    """In the calling writer thread, skip torch.save's CRC-32 (torch >= 2.13, where the switch is per thread).

    Without it the CRC pass over every byte cost ~30% of a writer thread's time here.
    """
    config = _serialization_config()
    if config is None or not _CONFIG_PER_THREAD:
        return contextlib.nullcontext()
    return config.patch({"save.compute_crc32": False})


def exact_storage(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` (CPU) as a tensor whose storage holds exactly its bytes, so torch.save writes only those.

    A contiguous view of a larger storage is re-wrapped without copying; anything else that does not
    own its whole storage (a strided view) is copied.
    """
    tensor = tensor.detach()
    if tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size():
        return tensor
    if not tensor.is_contiguous():
        return tensor.contiguous()
    raw = tensor.reshape(-1).view(torch.uint8).numpy()  # a view of the same memory, exactly its bytes
    return torch.from_numpy(raw).view(tensor.dtype).view(tensor.shape)


def _write_bucket(bucket: WriteBucket, *, fsync: bool) -> tuple[list[WriteResult], FileDigest]:
    """Write one file of a rank's plan (bytes items, then tensors as torch.save records), hashing as it goes."""
    path, name, (bytes_data, tensor_data) = bucket
    out = _HashingFile(path, writeback=fsync)
    results = []
    try:
        for item, data in bytes_data:
            start = out.tell()
            out.write(data.getbuffer())
            results.append(_write_result(item, name, start, out.tell() - start))
        with _thread_without_zip_crc():
            for item, tensor in tensor_data:
                start = out.tell()
                torch.save(exact_storage(tensor), out)
                results.append(_write_result(item, name, start, out.tell() - start))
    finally:
        digest = out.finish(fsync=fsync)
    return results, FileDigest(path=name, checksum=digest, nbytes=out.tell())


def _write_result(item: WriteItem, file_name: str, offset: int, length: int) -> WriteResult:
    return WriteResult(
        index=item.index,
        size_in_bytes=length,
        storage_data=_StorageInfo(relative_path=file_name, offset=offset, length=length),
    )


def _item_bytes(item: WriteItem) -> int:
    if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
        return 0
    count = 1
    for size in item.tensor_data.chunk.sizes:
        count *= size
    return count * torch.empty((), dtype=item.tensor_data.properties.dtype).element_size()


def split_by_size(items: list[WriteItem], bins: int) -> list[list[WriteItem]]:
    """Items in ``bins`` groups of nearly equal byte size (largest first into the lightest bin).

    Byte items (small pickles) go round-robin. Empty bins are dropped.
    """
    buckets: list[list[WriteItem]] = [[] for _ in range(bins)]
    byte_items = [item for item in items if item.type == WriteItemType.BYTE_IO]
    for index, item in enumerate(byte_items):
        buckets[index % bins].append(item)
    heap = [(0, index) for index in range(bins)]
    tensors = sorted((item for item in items if item.type != WriteItemType.BYTE_IO), key=_item_bytes, reverse=True)
    for item in tensors:
        size, index = heappop(heap)
        buckets[index].append(item)
        heappush(heap, (size + _item_bytes(item), index))
    return [bucket for bucket in buckets if bucket]


class HostBufferPool:
    """Host copies of the tensors being saved, kept between saves so a snapshot costs one memcpy.

    Buffers are keyed by the item's checkpoint index and reused while its shape and dtype hold.
    They are pinned when the source lives on a GPU (fast, asynchronous device-to-host copies).
    """

    def __init__(self) -> None:
        self._buffers: dict[Any, torch.Tensor] = {}

    def copy(self, key: Any, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.detach()
        buffer = self._buffers.get(key)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda)
            self._buffers[key] = buffer
        buffer.copy_(tensor, non_blocking=tensor.is_cuda)
        return buffer

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())


def host_buckets(buckets: list[WriteBucket], pool: HostBufferPool, *, copy_cpu: bool) -> list[WriteBucket]:
    """The same buckets with tensors in host memory the writer threads can read on their own.

    Device tensors always go to (pinned) host buffers; CPU tensors are copied only with ``copy_cpu``
    (an async save: training may change the originals while the threads write).
    """
    copied = []
    on_gpu = False
    for path, name, (bytes_data, tensor_data) in buckets:
        tensors = []
        for item, tensor in tensor_data:
            if tensor.is_cuda or copy_cpu:
                on_gpu = on_gpu or tensor.is_cuda
                tensor = pool.copy((item.index.fqn, tuple(item.index.offset or ())), tensor)
            tensors.append((item, tensor))
        copied.append((path, name, (bytes_data, tensors)))
    if on_gpu:
        torch.cuda.synchronize()
    return copied


class ThreadedFileWriter(FileSystemWriterAsync):
    """megatron-core's async writer with its worker processes replaced by threads of this process.

    ``prepare_write_data`` plans ``thread_count`` files per rank (nothing is copied and no results
    queue server is started); the save function writes them from a thread pool, hashing and
    fsyncing each once; ``retrieve_write_results`` hands the results over in memory.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *args: Any,
        fsync: bool = True,
        snapshot: bool = False,
        pool: HostBufferPool | None = None,
        on_create: Callable[[ThreadedFileWriter], None] | None = None,
        **kwargs: Any,
    ) -> None:
        kwargs["sync_files"] = fsync  # the .metadata file the coordinator writes at the end, too
        super().__init__(path, *args, **kwargs)
        self.fsync = fsync
        self.snapshot = snapshot
        self.pool = pool or HostBufferPool()
        self.results: list[WriteResult] | None = None
        self.file_digests: list[FileDigest] = []
        if on_create is not None:
            on_create(self)

    def prepare_write_data(self, plan: Any, planner: Any) -> None:
        prefix = plan.storage_data.prefix
        self.write_buckets = []
        for index, items in enumerate(split_by_size(list(plan.items), max(1, self.thread_count))):
            name = f"{prefix}{index}{DEFAULT_SUFFIX}"
            bytes_data = [(item, planner.resolve_data(item)) for item in items if item.type == WriteItemType.BYTE_IO]
            tensor_data = [
                (item, planner.resolve_data(item).detach()) for item in items if item.type != WriteItemType.BYTE_IO
            ]
            self.write_buckets.append((os.path.join(self.checkpoint_dir, name), name, (bytes_data, tensor_data)))
        self.results_queue = None

    def get_save_function_and_args(self) -> tuple[Callable | None, Callable | None, list]:
        if not self.write_buckets:
            self.results = []
            return None, None, []
        on_device = any(t.is_cuda for _, _, (_, tensors) in self.write_buckets for _, t in tensors)
        stage = self.snapshot or on_device
        preload = partial(host_buckets, self.write_buckets, self.pool, copy_cpu=self.snapshot) if stage else None
        # megatron's AsyncRequest convention: args[1] holds the buckets (the preload result replaces it).
        return self.write_files, preload, [0, self.write_buckets, None]

    def write_files(self, _rank: int, buckets: list[WriteBucket], _queue: Any) -> None:
        """Write every bucket from its own thread; results and digests stay on this object."""
        with _without_zip_crc(), ThreadPoolExecutor(len(buckets), thread_name_prefix="ckpt-write") as pool:
            outcomes = list(pool.map(partial(_write_bucket, fsync=self.fsync), buckets))
        self.results = [result for results, _ in outcomes for result in results]
        self.file_digests = [digest for _, digest in outcomes]

    def retrieve_write_results(self) -> list[WriteResult]:
        if self.results is None:
            raise RuntimeError(f"checkpoint files under {self.checkpoint_dir} were not written (writer failed)")
        return self.results


@contextlib.contextmanager
def _substituted(module: Any, name: str, replacement: Any) -> Iterator[bool]:
    """Temporarily replace ``module.name`` (megatron-core's hook-less factories); yields whether it existed."""
    if not hasattr(module, name):
        yield False
        return
    original = getattr(module, name)
    setattr(module, name, replacement)
    try:
        yield True
    finally:
        setattr(module, name, original)


class ThreadedSaveStrategy(TorchDistSaveShardedStrategy):
    """megatron-core's ``torch_dist`` save strategy writing through ``ThreadedFileWriter``.

    Args:
        thread_count: files (and writer threads) per rank.
        fsync: fsync each file once when it is complete (durable against power loss).
        snapshot: copy the tensors to host buffers before returning the request (async saves).
    """

    def __init__(self, *, thread_count: int = DEFAULT_THREADS, fsync: bool = True, snapshot: bool = False) -> None:
        super().__init__(_STORE, _STORE_VERSION, thread_count=thread_count)
        self.fsync = fsync
        self.snapshot = snapshot
        self.pool = HostBufferPool()
        self.writers: list[ThreadedFileWriter] = []

    def async_save(self, sharded_state_dict: Any, checkpoint_dir: Any) -> AsyncRequest:
        self.writers = []
        writer = partial(
            ThreadedFileWriter, fsync=self.fsync, snapshot=self.snapshot, pool=self.pool, on_create=self.writers.append
        )
        with _substituted(mcore_torch_strategy, "FileSystemWriterAsync", writer) as found:
            if not found:
                raise RuntimeError(
                    "this megatron-core version builds its checkpoint writer differently; "
                    "megatron_mugrpo.training.checkpoint_io supports megatron-core 0.16-0.19"
                )
            return super().async_save(sharded_state_dict, checkpoint_dir)

    def digests(self) -> list[FileDigest]:
        """Files the last save wrote on this rank (after its request ran)."""
        return [digest for writer in self.writers for digest in writer.file_digests]


# --------------------------------------------------------------------------------- reading


class _TensorLayout(pickle.Unpickler):
    """Reads the ``data.pkl`` of a torch.save record of one tensor without building the tensor.

    ``load()`` returns (storage persistent id, storage offset, size, stride).
    """

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return lambda storage, offset, size, stride, *_rest: (storage, offset, tuple(size), tuple(stride))
        if module == "torch" and name.endswith("Storage"):
            return getattr(torch, name)
        if (module, name) == ("collections", "OrderedDict"):
            import collections

            return collections.OrderedDict
        raise pickle.UnpicklingError(f"not a plain tensor record ({module}.{name})")

    def persistent_load(self, pid: Any) -> Any:
        return pid  # ('storage', StorageType, key, location, numel)


def _contiguous_strides(size: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for dim in reversed(size):
        strides.append(step)
        step *= dim
    return tuple(reversed(strides))


def _record_data_span(stream: Any, offset: int, length: int, target: torch.Tensor) -> int | None:
    """File offset of the raw bytes of the torch.save record at [offset, offset + length) when they are
    exactly ``target``'s bytes (one storage of its size, no offset, contiguous, same dtype and shape)."""
    try:
        archive = zipfile.ZipFile(_Window(stream, offset, length))
        names = archive.namelist()
        pickles = [n for n in names if n.endswith("/data.pkl")]
        datas = [n for n in names if "/data/" in n]
        if len(pickles) != 1 or len(datas) != 1:
            return None
        pickled, info = archive.getinfo(pickles[0]), archive.getinfo(datas[0])
        if pickled.compress_type != zipfile.ZIP_STORED or info.compress_type != zipfile.ZIP_STORED:
            return None
        # Read data.pkl by position, not through zipfile: the writers skip torch.save's CRC-32 (it
        # reads 0), which zipfile would reject; the file's checksum in the manifest covers these bytes.
        stream.seek(_member_start(stream, offset, pickled))
        storage, storage_offset, size, stride = _TensorLayout(io.BytesIO(stream.read(pickled.file_size))).load()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # TypedStorage classes are deprecated; only their dtype is read
            dtype = storage[1].dtype
    except (zipfile.BadZipFile, pickle.UnpicklingError, ValueError, TypeError, KeyError, IndexError, AttributeError):
        return None
    nbytes = target.numel() * target.element_size()
    if (
        dtype != target.dtype
        or storage[4] != target.numel()
        or storage_offset != 0
        or size != tuple(target.shape)
        or stride != _contiguous_strides(size)
        or info.file_size != nbytes
    ):
        return None
    return _member_start(stream, offset, info)


def _member_start(stream: Any, offset: int, info: zipfile.ZipInfo) -> int:
    """File offset of the first byte of a stored (uncompressed) zip member of the record at ``offset``."""
    stream.seek(offset + info.header_offset)
    header = stream.read(30)
    name_len, extra_len = int.from_bytes(header[26:28], "little"), int.from_bytes(header[28:30], "little")
    return offset + info.header_offset + 30 + name_len + extra_len


class _Window(io.RawIOBase):
    """A read-only, seekable view of [offset, offset + length) of a file (for zipfile)."""

    def __init__(self, stream: Any, offset: int, length: int) -> None:
        self._stream, self._start, self._length, self._pos = stream, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        self._pos = max(0, min(self._length, base + pos))
        return self._pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        count = min(len(view), self._length - self._pos)
        self._stream.seek(self._start + self._pos)
        got = self._stream.readinto(view[:count])
        self._pos += got
        return got


def _read_exact(stream: Any, position: int, target: torch.Tensor) -> None:
    view = memoryview(target.reshape(-1).view(torch.uint8).numpy())
    stream.seek(position)
    done = 0
    while done < len(view):
        got = stream.readinto(view[done:])
        if not got:
            raise EOFError(f"unexpected end of file at byte {position + done}")
        done += got


class DirectFileSystemReader(FileSystemReader):
    """``FileSystemReader`` that reads whole stored tensors straight into their destination.

    An item takes the direct path when the plan asks for the whole stored chunk and the destination
    is a contiguous CPU tensor of the stored shape and dtype; everything else (resharded reads, GPU
    destinations, byte items) goes through the parent class, one file at a time. Files are read by
    ``DEFAULT_THREADS`` threads, as they were written (``readinto`` releases the GIL).
    """

    def read_data(self, plan: Any, planner: Any) -> Future:
        per_file: dict[str, list[Any]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        with ThreadPoolExecutor(max(1, min(DEFAULT_THREADS, len(per_file))), thread_name_prefix="ckpt-read") as pool:
            outcomes = list(pool.map(lambda entry: self._read_file(*entry, planner), per_file.items()))
        general = []
        for direct, rest in outcomes:
            for item, target in direct:
                planner.commit_tensor(item, target)
            general += rest
        if general:
            return super().read_data(dataclasses.replace(plan, items=general), planner)
        future: Future = Future()
        future.set_result(None)
        return future

    def _read_file(self, relative_path: str, items: list[Any], planner: Any) -> tuple[list[Any], list[Any]]:
        """Read one file's items that take the direct path; returns ([(item, tensor read)], [other items])."""
        direct, rest = [], []
        with open(os.path.join(self.path, relative_path), "rb", buffering=0) as stream:
            for item in sorted(items, key=lambda it: self.storage_data[it.storage_index].offset):
                target = self._read_direct(stream, item, planner)
                if target is None:
                    rest.append(item)
                else:
                    direct.append((item, target))
        return direct, rest

    def _read_direct(self, stream: Any, item: Any, planner: Any) -> torch.Tensor | None:
        """The destination of ``item`` with the stored bytes read into it, or None if it needs the general path."""
        if item.type != LoadItemType.TENSOR or any(item.storage_offsets) or any(item.dest_offsets):
            return None
        info = self.storage_data[item.storage_index]
        if getattr(info, "transform_descriptors", None):
            return None
        target = planner.resolve_tensor(item).detach()
        if target.device.type != "cpu" or not target.is_contiguous() or tuple(target.shape) != tuple(item.lengths):
            return None
        position = _record_data_span(stream, info.offset, info.length, target)
        if position is None:
            return None
        _read_exact(stream, position, target)
        return target


class DirectLoadStrategy(TorchDistLoadShardedStrategy):
    """megatron-core's ``torch_dist`` load strategy reading through ``DirectFileSystemReader``."""

    def load(self, sharded_state_dict: Any, checkpoint_dir: Any) -> Any:
        def reader(directory: Any, cache_metadata: bool = False) -> FileSystemReader:
            return DirectFileSystemReader(directory)

        # Where this megatron-core version has no such factory, its own reader is used (slower, same result).
        with _substituted(mcore_torch_strategy, "_get_filesystem_reader", reader):
            return super().load(sharded_state_dict, checkpoint_dir)


# ------------------------------------------------------------------------------ async queue


class ThreadAsyncCaller(AsyncCaller):
    """Runs an AsyncRequest's function in a thread of this process (megatron-core forks a process).

    The snapshot (preload) runs in the caller before the thread starts. The function should not
    raise: ranks finalize collectively, so a failure must travel with the request to its finalize
    functions and be raised there on every rank (``training.checkpoint`` does this).
    """

    def __init__(self) -> None:
        self.thread: threading.Thread | None = None

    def schedule_async_call(self, async_req: AsyncRequest) -> None:
        if async_req.async_fn is None:
            return
        args = list(async_req.async_fn_args)
        if async_req.preload_fn:
            args[1] = async_req.preload_fn()
        self.thread = threading.Thread(
            target=async_req.async_fn, args=args, kwargs=async_req.async_fn_kwargs, name="ckpt-async-save", daemon=True
        )
        self.thread.start()

    def is_current_async_call_done(self, blocking: bool = False, no_dist: bool = False) -> bool:
        alive = int(self.thread is not None and self.thread.is_alive())
        done = (not alive) if no_dist else self.sync_all_async_calls(alive)
        if done or blocking:
            self.close()
            done = True
        return done

    def sync_all_async_calls(self, is_alive: int) -> bool:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        flag = torch.tensor([is_alive], dtype=torch.int, device=device)
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(flag)
        return int(flag[0]) == 0

    def close(self, abort: bool = False) -> None:
        if self.thread is not None:
            self.thread.join()
            self.thread = None

    def __del__(self) -> None:
        pass


class ThreadAsyncCallsQueue(AsyncCallsQueue):
    """megatron-core's AsyncCallsQueue (schedule now, finalize collectively later) with thread callers."""

    def __init__(self) -> None:
        super().__init__(persistent=False)

    def _get_async_caller(self) -> AsyncCaller:
        return ThreadAsyncCaller()


# ------------------------------------------------------------------------------- checksums


def hash_files(
    paths: Iterable[Path], threads: int = DEFAULT_THREADS, algorithm: str = CHECKSUM
) -> dict[Path, tuple[str, int] | OSError]:
    """Checksum and size of each file (or the OSError that reading it raised), ``threads`` files at a time."""
    paths = list(paths)
    local = threading.local()

    def one(path: Path) -> tuple[str, int] | OSError:
        if not hasattr(local, "buffer"):
            local.buffer = bytearray(durable.HASH_CHUNK_BYTES)
        try:
            checksum, size = durable.file_checksum(path, algorithm, local.buffer)
            return checksum.hexdigest, size
        except OSError as err:
            return err

    if not paths:
        return {}
    with ThreadPoolExecutor(max(1, min(threads, len(paths))), thread_name_prefix="ckpt-verify") as pool:
        return dict(zip(paths, pool.map(one, paths)))


def bytes_digest(path: str, data: bytes) -> FileDigest:
    return FileDigest(path=path, checksum=durable.Checksum.of_bytes(data, CHECKSUM).hexdigest, nbytes=len(data))
