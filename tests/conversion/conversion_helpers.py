"""Tiny random Hugging Face models on disk for the conversion tests (no downloads)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from megatron_mugrpo.training.tiny import tiny_hf_dir

NORM_JITTER = 0.5
"""Norm weights are drawn around 1 (not left at 1) so a swapped or missing norm changes the logits."""


def _jitter(model: torch.nn.Module) -> None:
    """Redraw every weight: norms around 1, the rest N(0, 0.1), so each tensor's role shows in the logits."""
    for name, param in model.named_parameters():
        if "norm" in name:
            param.copy_(1.0 + NORM_JITTER * (torch.rand_like(param) - 0.5))
        else:
            param.normal_(0.0, 0.1)


def make_hf_dir(out_dir: str | Path, arch: str, *, tied: bool = False, seed: int = 0, **overrides: Any) -> Path:
    """Save a random-weight transformers model of ``tiny_hf_config(arch)`` as safetensors in ``out_dir``."""
    return tiny_hf_dir(out_dir, arch, seed=seed, tokenizer=False, adjust=_jitter, tie_word_embeddings=tied, **overrides)
