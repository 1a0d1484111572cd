"""Checksums of a step directory's files: what the writer threads record and what verification recomputes.

The algorithm and the hashing itself are ``megatron_mugrpo.durable``'s; this module only names the
one new manifests use, the record of one written file, and a threaded hash of many files.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from megatron_mugrpo import durable

DEFAULT_THREADS = 2
"""Writer threads (and files) per rank, and reader / hashing threads: enough to overlap the checksum
of one file with the I/O of another."""

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
