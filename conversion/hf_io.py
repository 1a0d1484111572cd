"""Hugging Face checkpoint directories: lazy safetensors reading (single file or sharded index) and
atomic, streaming writing (safetensors shards + index + config.json + tokenizer files).

    ckpt = HfCheckpoint("/models/Qwen2.5-Math-7B")   # opens nothing until a tensor is asked for
    ckpt.validate()                                  # missing / extra tensors, shape mismatches
    q = ckpt.tensor("model.layers.0.self_attn.q_proj.weight")      # a copy
    q = ckpt.mapped("model.layers.0.self_attn.q_proj.weight")      # a read-only view of the page cache
    save_hf_dir(export_hf(chunks, ckpt.config, groups), "/out/hf", ckpt.config, tokenizer_dir=ckpt.path)

Reading for conversion maps the files and copies each tensor once, from the page cache into its
destination (``mapped``). Writing streams: each tensor's bytes go to the file as it arrives, with
no intermediate dict of the shard, no clone and no serialisation buffer; the safetensors header
(which precedes the data) is written last into space reserved for it, padded with spaces as the
format allows. Tensors on a GPU pass through one reused pinned host buffer.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import shutil
import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from megatron_mugrpo.conversion.errors import ConversionError
from megatron_mugrpo.conversion.mappings import IGNORED_HF_SUFFIXES, expected_hf_shapes, expected_hf_tensors
from safetensors import safe_open
from torch import Tensor

from megatron_mugrpo import durable

SAFE_INDEX = "model.safetensors.index.json"
SAFE_SINGLE = "model.safetensors"
DEFAULT_SHARD_BYTES = 4 * 1024**3
"""Safetensors shard size when saving, as transformers' default ``max_shard_size`` (roughly)."""
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "generation_config.json",
    "chat_template.jinja",
)
"""Non-weight files copied next to exported weights (whichever exist in the source directory)."""
SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_DTYPE_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}
HEADER_BYTES_PER_TENSOR = 160
"""Header space reserved per tensor beyond its name (dtype, shape, offsets take ~90 bytes in JSON)."""
DEFAULT_HEADER_BYTES = 64 * 1024
"""Header space reserved per shard when the tensor names are not known in advance."""


def load_hf_config(hf_dir: str | Path) -> dict[str, Any]:
    """The ``config.json`` dict of a Hugging Face directory; ConversionError when absent or unreadable."""
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise ConversionError(f"{path} does not exist: --hf-dir must be a Hugging Face checkpoint directory")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ConversionError(f"{path} is not valid JSON ({err})") from err


class HfCheckpoint:
    """Read access to the tensors of a HF directory, by name, without loading the whole model."""

    def __init__(self, hf_dir: str | Path) -> None:
        self.path = Path(hf_dir)
        self.config = load_hf_config(self.path)
        self.files = _tensor_files(self.path)
        self._handles: dict[Path, Any] = {}
        self._maps: dict[Path, _MappedSafetensors] = {}

    def names(self) -> set[str]:
        """Names of all tensors stored in the directory."""
        return set(self.files)

    def _handle(self, name: str) -> Any:
        if name not in self.files:
            raise ConversionError(f"{self.path}: tensor {name!r} is missing from the safetensors files")
        file = self.files[name]
        if file not in self._handles:
            self._handles[file] = safe_open(str(file), framework="pt")
        return self._handles[file]

    def shape(self, name: str) -> tuple[int, ...]:
        """Stored shape of tensor ``name`` (reads only the header)."""
        return tuple(self._handle(name).get_slice(name).get_shape())

    def tensor(self, name: str) -> Tensor:
        """Tensor ``name`` as stored (dtype unchanged), in memory of its own."""
        return self._handle(name).get_tensor(name)

    def mapped(self, name: str) -> Tensor:
        """Tensor ``name`` as a read-only view of the file's pages (no copy); read it, never write to it.

        Falls back to ``tensor`` for dtypes the view cannot express.
        """
        if name not in self.files:
            raise ConversionError(f"{self.path}: tensor {name!r} is missing from the safetensors files")
        file = self.files[name]
        if file not in self._maps:
            self._maps[file] = _MappedSafetensors(file)
        view = self._maps[file].view(name)
        return view if view is not None else self.tensor(name)

    def validate(self) -> None:
        """Raise ConversionError for missing or extra tensors or shapes that disagree with config.json."""
        expected = expected_hf_shapes(self.config)
        present = {n for n in self.names() if not n.endswith(IGNORED_HF_SUFFIXES)}
        # A tied model's checkpoint may still carry lm_head.weight (a copy): HF ignores it, so do we.
        if "lm_head.weight" not in expected:
            present.discard("lm_head.weight")
        missing, extra = sorted(set(expected) - present), sorted(present - set(expected))
        if missing:
            raise ConversionError(
                f"{self.path}: {len(missing)} tensors missing for {self.config.get('model_type')}: "
                f"{missing[:8]}{' ...' if len(missing) > 8 else ''}"
            )
        if extra:
            raise ConversionError(
                f"{self.path}: {len(extra)} unexpected tensors (not in the "
                f"{self.config.get('model_type')} map): {extra[:8]}{' ...' if len(extra) > 8 else ''}"
            )
        for name, shape in sorted(expected.items()):
            if self.shape(name) != shape:
                raise ConversionError(
                    f"{self.path}: tensor {name!r} has shape {self.shape(name)}, but config.json implies {shape}"
                )


class _MappedSafetensors:
    """A safetensors file mapped read-only; ``view`` returns zero-copy tensors over its pages."""

    def __init__(self, path: Path) -> None:
        with open(path, "rb") as stream:
            header_len = int.from_bytes(stream.read(8), "little")
            header = json.loads(stream.read(header_len))
            # The mapping outlives the file object; tensors viewing it keep it alive.
            self._map = mmap.mmap(stream.fileno(), 0, access=mmap.ACCESS_READ)
        self._data_start = 8 + header_len
        self._entries = {name: entry for name, entry in header.items() if name != "__metadata__"}

    def view(self, name: str) -> Tensor | None:
        entry = self._entries[name]
        dtype = SAFETENSORS_DTYPES.get(entry["dtype"])
        if dtype is None:
            return None
        start, end = entry["data_offsets"]
        shape = tuple(entry["shape"])
        if end == start:
            return torch.empty(shape, dtype=dtype)
        offset = self._data_start + start
        page = offset - offset % mmap.PAGESIZE
        with contextlib.suppress(OSError, ValueError, AttributeError):
            self._map.madvise(mmap.MADV_WILLNEED, page, offset + (end - start) - page)  # start readahead
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "non-writable buffer": the view is read, never written
            flat = torch.frombuffer(self._map, dtype=dtype, count=(end - start) // dtype.itemsize, offset=offset)
        return flat.view(shape)


def _tensor_files(hf_dir: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file, from the sharded index or the single file."""
    index = hf_dir / SAFE_INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: hf_dir / file for name, file in weight_map.items()}
    single = hf_dir / SAFE_SINGLE
    if single.is_file():
        with safe_open(str(single), framework="pt") as handle:
            return dict.fromkeys(handle.keys(), single)
    raise ConversionError(
        f"{hf_dir} holds neither {SAFE_SINGLE} nor {SAFE_INDEX}; only safetensors checkpoints are supported"
    )


def check_output_dir(out_dir: str | Path) -> Path:
    """``out_dir`` as a Path; ConversionError when it exists and is not empty (nothing is overwritten)."""
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConversionError(f"output {out} already exists and is not empty; choose a new path or remove it")
    return out


@contextmanager
def atomic_output_dir(out_dir: str | Path, *, fsync: bool = False) -> Iterator[Path]:
    """``durable.atomic_dir`` for the converter's outputs, which never overwrite: a temporary sibling
    directory that becomes ``out_dir`` only when the block succeeds; ConversionError first when
    ``out_dir`` exists and is not empty. ``fsync``: durable before and after the rename, for a
    directory that a record will name."""
    with durable.atomic_dir(check_output_dir(out_dir), fsync=fsync) as tmp:
        yield tmp


class _PinnedStaging:
    """One host buffer, reused (and grown) for every device tensor on its way to a file; pinned on CUDA."""

    def __init__(self) -> None:
        self._buffer: Tensor | None = None

    def host(self, tensor: Tensor) -> Tensor:
        nbytes = tensor.numel() * tensor.element_size()
        if self._buffer is None or self._buffer.numel() < nbytes:
            self._buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        view = self._buffer[:nbytes].view(tensor.dtype).view(tensor.shape)
        view.copy_(tensor)
        return view


def _tensor_bytes(tensor: Tensor, staging: _PinnedStaging) -> memoryview:
    """The bytes of ``tensor`` in row-major order, without copying when it is a contiguous CPU tensor."""
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = staging.host(tensor)
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    if tensor.numel() == 0:
        return memoryview(b"")
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def _write_all(raw: Any, data: Any) -> int:
    """Write every byte of ``data`` to an unbuffered file (whose writes may be partial)."""
    view = memoryview(data).cast("B")
    done = 0
    while done < len(view):
        done += raw.write(view[done:])
    return done


class _ShardFile:
    """One safetensors file written as tensors arrive: data after a reserved header, the header last."""

    def __init__(self, path: Path, header_bytes: int) -> None:
        self.path = path
        self.reserved = -(-header_bytes // 8) * 8  # data stays 8-byte aligned
        self._file = open(path, "wb", buffering=0)  # noqa: SIM115 - closed in close()
        self._file.seek(8 + self.reserved)
        self.entries: dict[str, dict[str, Any]] = {}
        self.nbytes = 0

    def add(self, name: str, tensor: Tensor, staging: _PinnedStaging) -> None:
        if tensor.dtype not in _DTYPE_NAMES:
            raise ConversionError(f"tensor {name!r} has dtype {tensor.dtype}, which safetensors cannot store")
        done = _write_all(self._file, _tensor_bytes(tensor, staging))
        offsets = [self.nbytes, self.nbytes + done]
        self.entries[name] = {"dtype": _DTYPE_NAMES[tensor.dtype], "shape": list(tensor.shape), "data_offsets": offsets}
        self.nbytes += done

    def close(self, *, fsync: bool) -> None:
        header = json.dumps({"__metadata__": {"format": "pt"}, **self.entries}, separators=(",", ":")).encode()
        try:
            if len(header) <= self.reserved:
                padded = header.ljust(self.reserved)  # trailing spaces: allowed by the format
                self._file.seek(0)
                _write_all(self._file, len(padded).to_bytes(8, "little") + padded)
                if fsync:
                    os.fsync(self._file.fileno())
        finally:
            self._file.close()
        if len(header) > self.reserved:  # more (or longer) names than budgeted: move the data once
            self._rewrite(header, fsync=fsync)

    def abort(self) -> None:
        """Close without a header (the caller discards the file)."""
        self._file.close()

    def _rewrite(self, header: bytes, *, fsync: bool) -> None:
        header += b" " * (-len(header) % 8)
        moved = self.path.with_suffix(".moving")
        with open(self.path, "rb") as src, open(moved, "wb") as dst:
            dst.write(len(header).to_bytes(8, "little") + header)
            src.seek(8 + self.reserved)
            shutil.copyfileobj(src, dst, 16 * 1024 * 1024)
            if fsync:
                dst.flush()
                os.fsync(dst.fileno())
        durable.replace(moved, self.path, fsync=fsync)


def header_budget(hf_config: dict[str, Any]) -> int:
    """Bytes of safetensors header to reserve per shard: enough for every tensor the config implies."""
    try:
        names = expected_hf_tensors(hf_config)
    except (ConversionError, KeyError, TypeError, ValueError):
        return DEFAULT_HEADER_BYTES
    return 64 + sum(len(name) + HEADER_BYTES_PER_TENSOR for name in names)


def _write_shards(
    named_tensors: Iterable[tuple[str, Tensor]], out: Path, shard_bytes: int, header_bytes: int, *, fsync: bool
) -> dict[str, str]:
    """Stream tensors into numbered safetensors files of about ``shard_bytes``; returns the weight map."""
    weight_map: dict[str, str] = {}
    staging = _PinnedStaging()
    shard: _ShardFile | None = None
    count = 0
    try:
        for name, tensor in named_tensors:
            if name in weight_map:
                raise ConversionError(f"tensor {name!r} was produced twice by the exporter")
            nbytes = tensor.numel() * tensor.element_size()
            if shard is not None and shard.entries and shard.nbytes + nbytes > shard_bytes:
                shard, finished = None, shard
                finished.close(fsync=fsync)
            if shard is None:
                count += 1
                shard = _ShardFile(out / f"model-{count:05d}.safetensors", header_bytes)
            shard.add(name, tensor, staging)
            weight_map[name] = shard.path.name
    except BaseException:
        if shard is not None:
            shard.abort()
        raise
    if shard is not None:
        shard.close(fsync=fsync)
    return _finalise_shard_names(weight_map, count, out)


def _finalise_shard_names(weight_map: dict[str, str], count: int, out: Path) -> dict[str, str]:
    """Rename shards to transformers' ``model-XXXXX-of-YYYYY`` names (or ``model.safetensors`` if one)."""
    renames = {}
    for index in range(1, count + 1):
        old = f"model-{index:05d}.safetensors"
        new = SAFE_SINGLE if count == 1 else f"model-{index:05d}-of-{count:05d}.safetensors"
        durable.rename_unpublished(out / old, out / new)
        renames[old] = new
    return {name: renames[file] for name, file in weight_map.items()}


def save_hf_dir(
    named_tensors: Iterable[tuple[str, Tensor]],
    out_dir: str | Path,
    hf_config: dict[str, Any],
    tokenizer_dir: str | Path | None = None,
    *,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    fsync: bool = False,
) -> Path:
    """Write a loadable HF directory: safetensors (+ index when sharded), config.json, tokenizer files.

    ``named_tensors`` is consumed as a stream (e.g. ``export_hf(...)`` on the writing rank): each
    tensor is written before the next is requested, so tensors that view live memory are fine.
    Tensors are saved in the dtype they arrive in. ``out_dir`` must not exist or be empty; it appears
    only complete. ``fsync``: make every file durable before the directory is renamed, and the rename
    before this returns (off by default, as in ``transformers``' ``save_pretrained``; on for a
    directory that a pointer will name).
    """
    with atomic_output_dir(out_dir, fsync=fsync) as tmp:
        weight_map = _write_shards(named_tensors, tmp, shard_bytes, header_budget(hf_config), fsync=fsync)
        if not weight_map:
            raise ConversionError("save_hf_dir: the tensor stream was empty; nothing to save")
        if len(set(weight_map.values())) > 1:
            total = sum(os.path.getsize(tmp / f) for f in set(weight_map.values()))
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
            (tmp / SAFE_INDEX).write_text(json.dumps(index, indent=2))
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True))
        if tokenizer_dir is not None:
            for file in TOKENIZER_FILES:
                if (Path(tokenizer_dir) / file).is_file():
                    shutil.copy2(Path(tokenizer_dir) / file, tmp / file)
    return Path(out_dir)
