"""Writing a step directory's ``torch_dist`` files from threads of the trainer, hashing as they go.

The files are exactly what megatron-core's default ``torch_dist`` strategy writes (a
``torch.distributed.checkpoint`` directory: ``__<rank>_<i>.distcp`` files, ``.metadata``;
``dist_checkpointing.save`` adds ``common.pt`` and ``metadata.json``), so any megatron-core tool
reads them and resharding on load works unchanged. What changes is how the bytes move:

- **Writer threads instead of writer processes.** megatron-core forks one process per file and
  collects results through a ``multiprocessing.Manager`` server (a spawned process that outlives a
  SIGKILLed trainer). Here each rank writes its ``thread_count`` files from threads of its own
  process: file writes, checksums and fsync release the GIL, nothing is forked, nothing survives the
  trainer.
- **Hash while writing, fsync once per file.** Every byte goes through the checksum on its way to the
  file (one pass over memory); the digest feeds the step directory's checksum manifest. Each file is
  fsynced once, at its end, when ``fsync`` is on; every ``WRITEBACK_BYTES`` before that the kernel is
  asked to start writing what came so far, so the disk works while the file is produced.
- **No copies of views.** megatron-core clones tensors that view a larger storage (e.g. the gate and
  up halves of a fused fc1) because ``torch.save`` of a view writes the whole storage. A contiguous
  view is instead re-wrapped, without copying, as a tensor that owns exactly its bytes.
- **No zip CRC-32.** ``torch.save`` computes a CRC-32 per record that ``torch.load`` never checks;
  the checksum of the file covers it, so the writer threads switch the CRC pass off
  (``mcore_compat.thread_without_zip_crc``).
- **Async: a snapshot, then threads.** With ``snapshot=True`` the write buckets are first copied to
  host buffers that are kept between saves (pinned when the tensors live on a GPU), so training can
  overwrite the parameters while the threads write.

``ThreadedSaveStrategy`` is a subclass of megatron-core's ``TorchDistSaveShardedStrategy`` whose
``async_save`` builds a ``ThreadedFileWriter`` itself and plans with megatron's public
``save_state_dict_async_plan`` and ``MCoreSavePlanner``: nothing in megatron-core is replaced while
it runs. The private helpers it still needs come from ``mcore_compat``.

    strategy = ThreadedSaveStrategy(groups=groups, thread_count=2, fsync=True, snapshot=False)
    request = dist_checkpointing.save(sharded_sd, directory, sharded_strategy=strategy, async_sharded_save=True)
    run_request(request, groups)      # or hand it to a ThreadAsyncCallsQueue (see training.checkpoint)
    strategy.digests()                # [FileDigest(path="__0_0.distcp", checksum=..., nbytes=...), ...]
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from heapq import heappop, heappush
from typing import Any

import torch
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
from megatron.core.dist_checkpointing.strategies.state_dict_saver import (
    save_state_dict_async_finalize,
    save_state_dict_async_plan,
)
from megatron.core.dist_checkpointing.strategies.torch import (
    MCoreSavePlanner,
    TorchDistSaveShardedStrategy,
    mcore_to_pyt_state_dict,
)
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from megatron_mugrpo import durable
from megatron_mugrpo.training import mcore_compat
from megatron_mugrpo.training.checkpoint_async import run_request
from megatron_mugrpo.training.checkpoint_digests import CHECKSUM, DEFAULT_THREADS, FileDigest
from megatron_mugrpo.training.parallel import ParallelGroups

WRITEBACK_BYTES = 8 * 1024 * 1024
"""How much a writer produces before it asks the kernel to start writing it to disk (when fsyncing)."""
_STORE = "torch_dist"
_STORE_VERSION = 1

WriteBucket = tuple[str, str, tuple[list, list]]
"""One file of a rank's plan: (file path, file name, ([(item, bytes)], [(item, tensor)]))."""


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
        with mcore_compat.thread_without_zip_crc():
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
        storage_data=mcore_compat.storage_info(file_name, offset, length),
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
    """megatron-core's ``FileSystemWriterAsync`` writing from threads of this process.

    Planning (local / global / decentralized plans) and the ``.metadata`` file the coordinator writes
    at the end are the parent's; the writing is ours. ``prepare_write_data`` splits this rank's items
    into ``files_per_rank`` files of nearly equal size (nothing is copied, no results queue server is
    started); ``stage`` copies them to host buffers when they must be (an async snapshot, or tensors
    on a GPU); ``write_files`` writes every file from its own thread, hashing and fsyncing each once;
    ``retrieve_write_results`` hands the results over in memory.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        files_per_rank: int = DEFAULT_THREADS,
        fsync: bool = True,
        snapshot: bool = False,
        pool: HostBufferPool | None = None,
    ) -> None:
        # sync_files: the .metadata file the coordinator writes at the end is fsynced too.
        super().__init__(path, thread_count=files_per_rank, sync_files=fsync)
        self.directory = str(path)
        self.files_per_rank = max(1, files_per_rank)
        self.fsync = fsync
        self.snapshot = snapshot
        self.pool = pool or HostBufferPool()
        self.buckets: list[WriteBucket] = []
        self.staged = False
        self.results: list[WriteResult] | None = None
        self.file_digests: list[FileDigest] = []

    def prepare_write_data(self, plan: Any, planner: Any) -> None:
        prefix = plan.storage_data.prefix
        self.buckets = []
        for index, items in enumerate(split_by_size(list(plan.items), self.files_per_rank)):
            name = f"{prefix}{index}{DEFAULT_SUFFIX}"
            bytes_data = [(item, planner.resolve_data(item)) for item in items if item.type == WriteItemType.BYTE_IO]
            tensor_data = [
                (item, planner.resolve_data(item).detach()) for item in items if item.type != WriteItemType.BYTE_IO
            ]
            self.buckets.append((os.path.join(self.directory, name), name, (bytes_data, tensor_data)))

    def needs_staging(self) -> bool:
        """Whether the tensors must be copied before the threads may write them (snapshot, or on a GPU)."""
        on_device = any(t.is_cuda for _, _, (_, tensors) in self.buckets for _, t in tensors)
        return not self.staged and (self.snapshot or on_device)

    def stage(self) -> None:
        """Copy the tensors to host buffers (in the caller, before the writer threads start); idempotent."""
        if self.needs_staging():
            self.buckets = host_buckets(self.buckets, self.pool, copy_cpu=self.snapshot)
        self.staged = True

    def write_files(self) -> None:
        """Write every file from its own thread; results and digests stay on this object."""
        self.stage()  # a no-op when the request's preload already staged them
        if not self.buckets:
            self.results = []
            return
        writer = partial(_write_bucket, fsync=self.fsync)
        with (
            mcore_compat.writers_without_zip_crc(),
            ThreadPoolExecutor(len(self.buckets), thread_name_prefix="ckpt-write") as pool,
        ):
            outcomes = list(pool.map(writer, self.buckets))
        self.results = [result for results, _ in outcomes for result in results]
        self.file_digests = [digest for _, digest in outcomes]

    def retrieve_write_results(self) -> list[WriteResult]:
        if self.results is None:
            raise RuntimeError(f"checkpoint files under {self.directory} were not written (writer failed)")
        return self.results


class ThreadedSaveStrategy(TorchDistSaveShardedStrategy):
    """megatron-core's ``torch_dist`` save strategy writing through ``ThreadedFileWriter``.

    ``async_save`` returns an ``AsyncRequest`` whose ``preload_fn`` takes the snapshot (call it in
    the training thread, before ``async_fn``; its result is not used) and whose ``async_fn`` (no
    arguments) writes the files; ``run_request`` runs one in the caller, ``ThreadAsyncCallsQueue``
    in a thread.

    Args:
        groups: the ranks that save together (planning and the sync save's barrier use its world group).
        thread_count: files (and writer threads) per rank.
        fsync: fsync each file once when it is complete (durable against power loss).
        snapshot: copy the tensors to host buffers before the request's write runs (async saves).
    """

    writer_class: type[ThreadedFileWriter] = ThreadedFileWriter

    def __init__(
        self, *, groups: ParallelGroups, thread_count: int = DEFAULT_THREADS, fsync: bool = True, snapshot: bool = False
    ) -> None:
        super().__init__(_STORE, _STORE_VERSION, thread_count=thread_count)
        self.groups = groups
        self.files_per_rank = thread_count
        self.fsync = fsync
        self.snapshot = snapshot
        self.pool = HostBufferPool()
        self.writer: ThreadedFileWriter | None = None

    def save(self, sharded_state_dict: Any, checkpoint_dir: Any, *_args: Any, **_kwargs: Any) -> None:
        run_request(self.async_save(sharded_state_dict, checkpoint_dir), self.groups)

    def async_save(self, sharded_state_dict: Any, checkpoint_dir: Any, *_args: Any, **_kwargs: Any) -> AsyncRequest:
        """Plan the save (collective) and return the request that writes it.

        Extra arguments (megatron-core >= 0.17 passes ``async_strategy``) are ignored: the writing is
        always this module's threads.
        """
        # One file per (key, shard) owner: replicas other than the main one are not written.
        flat, _, _ = mcore_compat.replace_state_dict_keys_with_sharded_keys(sharded_state_dict, True)
        writer = self.writer_class(
            checkpoint_dir, files_per_rank=self.files_per_rank, fsync=self.fsync, snapshot=self.snapshot, pool=self.pool
        )
        planned, *_cache = save_state_dict_async_plan(
            mcore_to_pyt_state_dict(flat, False),
            writer,
            self.groups.world_group,
            0,  # coordinator rank: writes .metadata
            planner=MCoreSavePlanner(dedup_replicated_tensors=False, flatten_state_dict=False),
        )
        self.writer = writer
        return AsyncRequest(
            writer.write_files,
            (),
            [partial(save_state_dict_async_finalize, *planned)],
            preload_fn=writer.stage if writer.needs_staging() else None,
        )

    def digests(self) -> list[FileDigest]:
        """Files the last save wrote on this rank (after its request ran)."""
        return [] if self.writer is None else list(self.writer.file_digests)
