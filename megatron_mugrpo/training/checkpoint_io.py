"""Storage engine of the step directories: megatron-core's ``torch_dist`` format, written and read at disk speed.

``training.checkpoint`` decides *what* goes into a step directory; the modules re-exported here
decide *how the bytes move*:

- ``checkpoint_writer``: ``ThreadedSaveStrategy`` / ``ThreadedFileWriter``, writer threads that
  hash every file as they write it (no zip CRC, no copies of views, early writeback, one fsync);
- ``checkpoint_reader``: ``DirectLoadStrategy`` / ``DirectFileSystemReader``, whole stored tensors
  read by position straight into the parameters;
- ``checkpoint_async``: ``ThreadAsyncCallsQueue``, background saves in a thread, finalized
  collectively;
- ``checkpoint_digests``: ``FileDigest``, ``CHECKSUM`` (xxHash3-128), ``hash_files``;
- ``mcore_compat``: the only place that touches megatron-core's (and torch's) private names.

Both strategies are plain subclasses of megatron-core's ``torch_dist`` strategies; nothing is
assigned into megatron-core's modules. This module only re-exports their public names (import from
the modules above in new code).
"""

from __future__ import annotations

from megatron_mugrpo.training.checkpoint_async import ThreadAsyncCallsQueue, run_request
from megatron_mugrpo.training.checkpoint_digests import CHECKSUM, DEFAULT_THREADS, FileDigest, bytes_digest, hash_files
from megatron_mugrpo.training.checkpoint_reader import DirectFileSystemReader, DirectLoadStrategy
from megatron_mugrpo.training.checkpoint_writer import (
    WRITEBACK_BYTES,
    HostBufferPool,
    ThreadedFileWriter,
    ThreadedSaveStrategy,
    exact_storage,
    host_buckets,
    split_by_size,
    start_writeback,
)

__all__ = [
    "CHECKSUM",
    "DEFAULT_THREADS",
    "WRITEBACK_BYTES",
    "DirectFileSystemReader",
    "DirectLoadStrategy",
    "FileDigest",
    "HostBufferPool",
    "ThreadAsyncCallsQueue",
    "ThreadedFileWriter",
    "ThreadedSaveStrategy",
    "bytes_digest",
    "exact_storage",
    "hash_files",
    "host_buckets",
    "run_request",
    "split_by_size",
    "start_writeback",
]
