"""Hugging Face <-> Megatron checkpoint conversion with TP/PP resharding.

- ``mappings``: the declarative name map per architecture (Qwen2, Llama, Qwen3);
- ``fused``: one pure function pair per fused tensor (QKV interleave, gated fc1, vocab padding);
- ``live``: ``load_hf_into_model`` / ``export_hf`` on a live TP/PP-sharded model;
- ``hf_io`` / ``megatron_io``: HF directories and Megatron step directories on disk;
- ``convert`` / ``verify`` / ``cli``: whole-checkpoint conversion, the logit check
  (``conversion.verify.verify``), ``mugrpo convert``.

Imports are lazy so ``import conversion`` stays cheap (Megatron loads on first use).
"""

from __future__ import annotations

from typing import Any

from conversion.errors import ConversionError

_EXPORTS = {
    "load_hf_into_model": "conversion.live",
    "export_hf": "conversion.live",
    "save_hf_dir": "conversion.hf_io",
    "HfCheckpoint": "conversion.hf_io",
    "hf_to_megatron": "conversion.convert",
    "megatron_to_hf": "conversion.convert",
}

__all__ = ["ConversionError", *_EXPORTS]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'conversion' has no attribute {name!r}")
