"""Reading a step directory's ``torch_dist`` files straight into the parameters.

When a stored item is exactly the tensor the model asks for (same shape and dtype, the usual case
when TP / PP do not change), its bytes are read from the file directly into the parameter: no
intermediate tensor, one copy from the page cache. Other items (resharding, GPU destinations, byte
items) take ``torch.distributed.checkpoint``'s general path.

``DirectLoadStrategy`` is a subclass of megatron-core's ``TorchDistLoadShardedStrategy`` whose
``load`` builds a ``DirectFileSystemReader`` (a subclass of torch's public ``FileSystemReader``)
itself and loads through ``torch.distributed.checkpoint.load`` with megatron's ``MCoreLoadPlanner``:
nothing in megatron-core is replaced while it runs. The private helpers that translate megatron's
sharded state dicts come from ``mcore_compat``.

    loaded = dist_checkpointing.load(sharded_sd, directory, sharded_strategy=DirectLoadStrategy(groups=groups))
"""

from __future__ import annotations

import collections
import dataclasses
import io
import os
import pickle
import warnings
import zipfile
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.dist_checkpointing.strategies.torch import (
    MCoreLoadPlanner,
    TorchDistLoadShardedStrategy,
    mcore_to_pyt_state_dict,
)
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.planner import LoadItemType
from torch.futures import Future

from megatron_mugrpo.training import mcore_compat
from megatron_mugrpo.training.checkpoint_digests import DEFAULT_THREADS
from megatron_mugrpo.training.parallel import ParallelGroups


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

    reader_class: type[FileSystemReader] = DirectFileSystemReader

    def __init__(self, *, groups: ParallelGroups) -> None:
        super().__init__()
        self.groups = groups
        """The ranks that load together (torch.distributed.checkpoint plans on ``groups.world_group``)."""

    def load(self, sharded_state_dict: Any, checkpoint_dir: Any, *_args: Any, **_kwargs: Any) -> Any:
        """Load ``sharded_state_dict``'s tensors and objects from ``checkpoint_dir`` (collective).

        megatron-core's own ``load``, with our reader. Extra arguments (megatron-core >= 0.17 passes
        ``async_strategy``, which only picks its reader) are ignored.
        """
        sharded = [value for value in nested_values(sharded_state_dict) if isinstance(value, ShardedTensor)]
        flat, flat_mapping, rename_mapping = mcore_compat.replace_state_dict_keys_with_sharded_keys(
            sharded_state_dict, False
        )
        pyt_state_dict = mcore_to_pyt_state_dict(flat, True)
        planner = MCoreLoadPlanner(
            shapes_validation_sharded_tensors=[t for t in sharded if not t.allow_shape_mismatch],
            allow_shape_mismatch_sharded_tensors={t.key: t for t in sharded if t.allow_shape_mismatch},
        )
        dcp.load(
            pyt_state_dict,
            storage_reader=self.reader_class(checkpoint_dir),
            planner=planner,
            process_group=self.groups.world_group,
        )
        loaded = {key: mcore_compat.unwrap_pyt_sharded_tensor(value) for key, value in pyt_state_dict.items()}
        loaded = mcore_compat.replace_sharded_keys_with_state_dict_keys(loaded, flat_mapping, rename_mapping)
        mcore_compat.restore_dict_types(loaded, sharded_state_dict)
        return loaded
