"""Files that survive a crash whole: atomic replacement, fsync, and checksums that name their algorithm.

Every file that another process (or a resumed run) trusts goes through here:

- ``atomic_write_bytes`` / ``atomic_write_text`` / ``atomic_write_json``: write to ``NAME.tmp`` in the
  same directory, fsync it, ``os.replace`` it over ``NAME``, fsync the directory. A reader sees the old
  content or the new, never half of it; after a power loss the new name points at complete bytes.
  A writer killed mid-write leaves only ``NAME.tmp``, which nobody reads.
- ``atomic_path``: the same for a file that a library writes itself (Arrow, Parquet): the block
  writes to the temporary path it is given.
- ``atomic_dir``: the same for a whole directory (a Hugging Face export, a built base model): the block
  fills a fresh temporary sibling, which is fsynced (when asked) and renamed into place, replacing an
  older directory when asked. A reader sees the old directory or the complete new one.
- ``read_json``: the JSON value of a file that other processes replace atomically, or None before the
  first write.
- ``Checksum``: ``(algorithm, hexdigest)``. New records use xxHash3-128 (``DEFAULT_ALGORITHM``);
  records written with SHA-256 still verify, because every record names its algorithm.

The order rule that makes records trustworthy: a record (manifest, pointer, shard record) that names
a file is written only after that file is durable, i.e. after ``atomic_write_*`` / ``atomic_path``
returned for it. Then a record that survives a crash never names a file that did not.

This module imports nothing from the package except ``errors``: every layer may use it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from megatron_mugrpo.errors import InputError

TMP_SUFFIX = ".tmp"
"""Suffix of the temporary a file is written under before its rename (cleaners match it)."""

CHECKSUMS: dict[str, Callable[[], Any]] = {"xxh3_128": xxhash.xxh3_128, "sha256": hashlib.sha256}
"""Checksum algorithms a record may name (hashlib-style constructors)."""
DEFAULT_ALGORITHM = "xxh3_128"
"""xxHash3-128: ~12 GB/s on one core of the 2-core benchmark machine where SHA-256 runs at ~1.4 GB/s,
so checksumming costs less than writing the bytes. Checksums guard against accidental damage (torn
writes, truncation, bit rot); like SHA-256 next to the files it protects, none is a defence against
someone who can rewrite both."""
PRE_RELEASE_ALGORITHM = "sha256"
"""What files written before checksums named their algorithm (pre-release runs) used: a bare digest
under ``sha256`` in a record, a manifest without ``algorithm``. ``Checksum.split_record`` is the one
reader that still understands them; delete it there when those files no longer matter."""
HASH_CHUNK_BYTES = 1024 * 1024
"""Read size when hashing a file: small enough that each chunk is still in the CPU cache when it is
hashed (16 MiB chunks hashed at 2.9 GB/s here, 1 MiB chunks at 6.4 GB/s), large enough that the
syscalls cost nothing; memory stays flat however large the file."""


class ChecksumError(InputError, ValueError):
    """A file does not match the checksum its record holds, or a record names an unknown algorithm."""


# ------------------------------------------------------------------------------------ checksums


def new_hasher(algorithm: str = DEFAULT_ALGORITHM) -> Any:
    """A fresh hashlib-style object (``update`` / ``hexdigest``) of the named algorithm."""
    if algorithm not in CHECKSUMS:
        raise ChecksumError(f"checksum algorithm {algorithm!r} is not one of {sorted(CHECKSUMS)}")
    return CHECKSUMS[algorithm]()


@dataclass(frozen=True)
class Checksum:
    """The checksum of some bytes, with the algorithm that computed it.

    Stored in JSON records as ``{"algorithm": ..., "hexdigest": ...}`` (``dataclasses.asdict``)."""

    algorithm: str
    """One of ``CHECKSUMS``."""
    hexdigest: str

    def __post_init__(self) -> None:
        if self.algorithm not in CHECKSUMS:
            raise ChecksumError(f"checksum algorithm {self.algorithm!r} is not one of {sorted(CHECKSUMS)}")

    @classmethod
    def of_bytes(cls, data: bytes | memoryview, algorithm: str = DEFAULT_ALGORITHM) -> Checksum:
        hasher = new_hasher(algorithm)
        hasher.update(data)
        return cls(algorithm, hasher.hexdigest())

    @classmethod
    def of_file(cls, path: str | Path, algorithm: str = DEFAULT_ALGORITHM) -> Checksum:
        """The checksum of a file's bytes, streamed in ``HASH_CHUNK_BYTES`` reads."""
        return file_checksum(path, algorithm)[0]

    @classmethod
    def from_json(cls, value: dict[str, str]) -> Checksum:
        try:
            return cls(value["algorithm"], value["hexdigest"])
        except (KeyError, TypeError) as exc:
            raise ChecksumError(f"{value!r} is not a checksum record (algorithm, hexdigest)") from exc

    @classmethod
    def split_record(cls, record: dict[str, Any], algorithm: str | None = None) -> tuple[Checksum, dict[str, Any]]:
        """(the checksum, the other fields) of a JSON record that holds one under ``checksum``.

        ``algorithm``: the one its container names (a checkpoint manifest names it once for all its
        entries, each of which holds a bare hex digest); None: the record names its own
        (``{"algorithm", "hexdigest"}``). Pre-release records hold the bare digest under the
        algorithm's name instead (``PRE_RELEASE_ALGORITHM`` when nothing names it)."""
        legacy = algorithm or PRE_RELEASE_ALGORITHM
        rest = {key: value for key, value in record.items() if key not in ("checksum", legacy)}
        if "checksum" in record:
            value = record["checksum"]
            return (cls(algorithm, value) if algorithm and isinstance(value, str) else cls.from_json(value)), rest
        if legacy in record:
            return cls(legacy, record[legacy]), rest
        raise ChecksumError(f"record {sorted(record)} holds no checksum")

    def verify_file(self, path: str | Path, what: str = "file") -> None:
        """Raise ChecksumError unless ``path``'s bytes have this checksum (recomputed with this algorithm)."""
        found = Checksum.of_file(path, self.algorithm)
        if found != self:
            raise ChecksumError(
                f"{what} {path} does not match its recorded {self.algorithm} checksum "
                f"(recorded {self.hexdigest}, found {found.hexdigest}): it is corrupted or was modified"
            )


def file_checksum(
    path: str | Path, algorithm: str = DEFAULT_ALGORITHM, buffer: bytearray | None = None
) -> tuple[Checksum, int]:
    """(checksum, size in bytes) of a file, read into ``buffer`` (reusable across calls of one thread)."""
    digest = new_hasher(algorithm)
    view = memoryview(buffer if buffer is not None else bytearray(HASH_CHUNK_BYTES))
    size = 0
    with open(path, "rb", buffering=0) as stream:
        while got := stream.readinto(view):
            digest.update(view[:got])
            size += got
    return Checksum(algorithm, digest.hexdigest()), size


# ---------------------------------------------------------------------------------------- fsync


def fsync_file(path: str | Path) -> None:
    """Flush a closed file's data to stable storage."""
    with open(path, "rb") as stream:
        os.fsync(stream.fileno())


def fsync_dir(path: str | Path) -> None:
    """Persist a directory's entries (new files, renames) on POSIX; a no-op where directories cannot be
    opened (the rename itself is still atomic there)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def replace(tmp: str | Path, path: str | Path, *, fsync: bool = True) -> None:
    """Rename ``tmp`` over ``path`` (a file or directory already durable when ``fsync``), then persist
    the rename by fsyncing ``path``'s directory."""
    os.replace(tmp, path)
    if fsync:
        fsync_dir(Path(path).parent)


# ---------------------------------------------------------------------------------- atomic writes


def temporary_path(path: str | Path) -> Path:
    """Where ``path`` is written before its rename: ``NAME.tmp`` in the same directory (same filesystem)."""
    path = Path(path)
    return path.with_name(path.name + TMP_SUFFIX)


@contextlib.contextmanager
def atomic_path(path: str | Path, *, fsync: bool = True) -> Iterator[Path]:
    """Yield a temporary path for the block to write ``path``'s new content to; on success it is
    fsynced and renamed over ``path``, on failure removed (``path`` keeps its old content)."""
    tmp = temporary_path(path)
    try:
        yield tmp
        if fsync:
            fsync_file(tmp)
        replace(tmp, path, fsync=fsync)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_bytes(path: str | Path, data: bytes, *, fsync: bool = True, mode: int | None = None) -> None:
    """Replace ``path``'s content with ``data``: temporary file, fsync, rename, fsync of the directory.

    ``fsync=False`` keeps the atomic rename but skips both fsyncs (for files that can be regenerated).
    ``mode`` (e.g. 0o600 for a secret): the file's permissions from its creation on, never the umask's
    for a moment; None leaves them to the umask."""
    with atomic_path(path, fsync=False) as tmp:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666 if mode is None else mode)
        with open(fd, "wb") as stream:
            if mode is not None:
                os.fchmod(fd, mode)  # a leftover temporary of that name keeps its old mode through O_TRUNC
            stream.write(data)
            if fsync:
                stream.flush()
                os.fsync(fd)
    if fsync:
        fsync_dir(Path(path).parent)


def atomic_write_text(path: str | Path, text: str, *, fsync: bool = True) -> None:
    atomic_write_bytes(path, text.encode(), fsync=fsync)


def atomic_write_json(
    path: str | Path, obj: Any, *, indent: int | None = 1, sort_keys: bool = False, fsync: bool = True, **dumps: Any
) -> None:
    """``atomic_write_bytes`` of ``json.dumps(obj)`` plus a final newline (``dumps`` go to ``json.dumps``)."""
    text = json.dumps(obj, indent=indent, sort_keys=sort_keys, **dumps) + "\n"
    atomic_write_bytes(path, text.encode(), fsync=fsync)


def fsync_tree(root: str | Path) -> None:
    """fsync every file, then every directory (deepest first), then ``root``. Files fsynced while they
    were written cost nothing here: they hold no dirty pages."""
    root = Path(root)
    for path in sorted(root.rglob("*"), key=lambda p: -len(p.parts)):
        if path.is_dir():
            fsync_dir(path)
        else:
            fsync_file(path)
    fsync_dir(root)


@contextlib.contextmanager
def atomic_dir(path: str | Path, *, replace_existing: bool = False, fsync: bool = False) -> Iterator[Path]:
    """Yield a fresh temporary sibling directory (``.NAME.tmp-XXXX``) for the block to build ``path`` in;
    when the block succeeds it becomes ``path``, on failure it is removed and ``path`` is untouched.

    ``fsync``: every file and directory in it is made durable before the rename, and the rename after,
    so that a record naming ``path`` can be trusted after a power loss (off for output that can be
    rebuilt). An existing empty ``path`` is replaced; a non-empty one only with ``replace_existing``,
    which moves it aside (``.NAME.old-XXXX``), renames the new one in, then deletes the old: a crash
    between the two renames leaves no ``path`` and the old content aside, never a half-built ``path``.
    Without ``replace_existing`` a non-empty ``path`` is a FileExistsError before anything is built."""
    path = Path(path)
    if not replace_existing and path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise FileExistsError(f"{path} exists and is not empty")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}{TMP_SUFFIX}-", dir=path.parent))
    try:
        yield tmp
        if fsync:
            fsync_tree(tmp)
        _swap_dir(tmp, path, fsync=fsync)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _swap_dir(new: Path, path: Path, *, fsync: bool) -> None:
    """Rename directory ``new`` to ``path``, moving an existing ``path`` aside first and deleting it after."""
    old = None
    if path.is_dir() and not any(path.iterdir()):
        path.rmdir()  # rename(2) may replace an empty directory, but not on every platform
    elif path.exists():
        old = path.with_name(f".{path.name}.old-{uuid.uuid4().hex[:8]}")
        os.replace(path, old)
    replace(new, path, fsync=fsync)
    if old is not None and old.is_dir():
        shutil.rmtree(old, ignore_errors=True)
    elif old is not None:
        old.unlink()


def rename_unpublished(source: str | Path, target: str | Path) -> None:
    """Rename inside a directory that ``atomic_dir`` is still building: nothing can read it before the
    directory's own rename, so this needs no fsync and no order (the converter's shard names, known
    only once the last shard is written)."""
    os.replace(source, target)


def read_json(path: str | Path) -> Any:
    """The JSON value in ``path``, or None when the file does not exist (yet). A file another process
    replaces through ``atomic_write_json`` is read whole, old or new."""
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        return None
