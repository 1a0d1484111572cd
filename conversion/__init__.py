"""Hugging Face <-> Megatron checkpoint conversion with TP/PP resharding.

- ``mappings``: the declarative name map per architecture (Qwen2, Llama, Qwen3);
- ``fused``: one pure function pair per fused tensor (QKV interleave, gated fc1, vocab padding);
- ``live``: ``load_hf_into_model`` / ``export_hf`` on a live TP/PP-sharded model, ``load_hf_policy``;
- ``hf_io`` / ``megatron_io``: HF directories and Megatron step directories on disk;
- ``convert`` / ``verify`` / ``cli``: whole-checkpoint conversion, the logit check
  (``megatron_mugrpo.conversion.verify.verify``), ``mugrpo convert``.

Imports are lazy so ``import megatron_mugrpo.conversion`` stays cheap (Megatron loads on first use).
The code lives in the repository's top-level ``conversion/`` directory and installs as
``megatron_mugrpo.conversion`` (setup.py's ``package_dir``), so no generic top-level module named
``conversion`` enters a user's environment.
"""

from __future__ import annotations

from typing import Any

from megatron_mugrpo.conversion.errors import ConversionError

_EXPORTS = {
    "load_hf_into_model": "megatron_mugrpo.conversion.live",
    "export_hf": "megatron_mugrpo.conversion.live",
    "export_policy": "megatron_mugrpo.conversion.live",
    "load_hf_policy": "megatron_mugrpo.conversion.live",
    "save_hf_dir": "megatron_mugrpo.conversion.hf_io",
    "HfCheckpoint": "megatron_mugrpo.conversion.hf_io",
    "hf_to_megatron": "megatron_mugrpo.conversion.convert",
    "megatron_to_hf": "megatron_mugrpo.conversion.convert",
}

__all__ = ["ConversionError", *_EXPORTS]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'megatron_mugrpo.conversion' has no attribute {name!r}")
