"""Hugging Face checkpoint directories: lazy safetensors reading (single file or sharded index) and
atomic writing (safetensors shards + index + config.json + tokenizer files).

    ckpt = HfCheckpoint("/models/Qwen2.5-Math-7B")   # opens nothing until a tensor is asked for
    ckpt.validate()                                  # missing / extra tensors, shape mismatches
    q = ckpt.tensor("model.layers.0.self_attn.q_proj.weight")
    save_hf_dir(export_hf(model, ckpt.config), "/out/hf", ckpt.config, tokenizer_dir=ckpt.path)
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from conversion.errors import ConversionError
from conversion.mappings import IGNORED_HF_SUFFIXES, expected_hf_shapes

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
        """Tensor ``name`` as stored (dtype unchanged)."""
        return self._handle(name).get_tensor(name)

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
def atomic_output_dir(out_dir: str | Path) -> Iterator[Path]:
    """A temporary sibling directory that becomes ``out_dir`` only when the block succeeds.

    On failure the temporary directory is removed, so no partial output ever sits at ``out_dir``.
    """
    out = check_output_dir(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        yield tmp
        if out.exists():
            out.rmdir()  # empty (checked above): os.replace needs it gone
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _write_shards(named_tensors: Iterable[tuple[str, Tensor]], out: Path, shard_bytes: int) -> dict[str, str]:
    """Stream tensors into numbered safetensors files of about ``shard_bytes``; returns the weight map."""
    weight_map: dict[str, str] = {}
    shard: dict[str, Tensor] = {}
    size, count = 0, 0

    def flush() -> None:
        nonlocal shard, size, count
        if shard:
            count += 1
            file = f"model-{count:05d}.safetensors"
            save_file(shard, str(out / file), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, file))
            shard, size = {}, 0

    for name, tensor in named_tensors:
        if name in shard or name in weight_map:
            raise ConversionError(f"tensor {name!r} was produced twice by the exporter")
        nbytes = tensor.numel() * tensor.element_size()
        if shard and size + nbytes > shard_bytes:
            flush()
        # safetensors needs contiguous, CPU, non-shared storage.
        shard[name] = tensor.detach().to("cpu").contiguous().clone()
        size += nbytes
    flush()
    return _finalise_shard_names(weight_map, count, out)


def _finalise_shard_names(weight_map: dict[str, str], count: int, out: Path) -> dict[str, str]:
    """Rename shards to transformers' ``model-XXXXX-of-YYYYY`` names (or ``model.safetensors`` if one)."""
    renames = {}
    for index in range(1, count + 1):
        old = f"model-{index:05d}.safetensors"
        new = SAFE_SINGLE if count == 1 else f"model-{index:05d}-of-{count:05d}.safetensors"
        os.replace(out / old, out / new)
        renames[old] = new
    return {name: renames[file] for name, file in weight_map.items()}


def save_hf_dir(
    named_tensors: Iterable[tuple[str, Tensor]],
    out_dir: str | Path,
    hf_config: dict[str, Any],
    tokenizer_dir: str | Path | None = None,
    *,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> Path:
    """Write a loadable HF directory: safetensors (+ index when sharded), config.json, tokenizer files.

    ``named_tensors`` is consumed as a stream (e.g. ``export_hf(...)`` on the writing rank); tensors are
    saved in the dtype they arrive in. ``out_dir`` must not exist or be empty; it appears only complete.
    """
    with atomic_output_dir(out_dir) as tmp:
        weight_map = _write_shards(named_tensors, tmp, shard_bytes)
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
