"""Tiny random Hugging Face models on disk for the conversion tests (no downloads)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from megatron_mugrpo.training.model import tiny_hf_config

NORM_JITTER = 0.5
"""Norm weights are drawn around 1 (not left at 1) so a swapped or missing norm changes the logits."""


def make_hf_dir(out_dir: str | Path, arch: str, *, tied: bool = False, seed: int = 0, **overrides: Any) -> Path:
    """Save a random-weight transformers model of ``tiny_hf_config(arch)`` as safetensors in ``out_dir``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config_dict = tiny_hf_config(arch, tie_word_embeddings=tied, **overrides)
    config = AutoConfig.for_model(**config_dict)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + NORM_JITTER * (torch.rand_like(param) - 0.5))
            else:
                param.normal_(0.0, 0.1)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    return Path(out_dir)
