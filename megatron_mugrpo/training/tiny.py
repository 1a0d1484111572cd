"""Tiny randomly initialised Hugging Face models for tests and benchmarks, all built one way.

``training.model.tiny_hf_config`` gives the ``config.json`` dict (qwen2, llama or qwen3; hidden 64,
2 layers, vocab 256 unless overridden); ``tiny_model`` turns it into a transformers model and
``tiny_hf_dir`` saves one as an ordinary Hugging Face directory (safetensors, and by default the
built-in character tokenizer), which the engines, the converter and the trainer load like a released
checkpoint. Nothing is downloaded.

    hf_dir = tiny_hf_dir(tmp_path / "model", seed=1, hidden_size=32)  # qwen2 + char tokenizer
    bare = tiny_hf_dir(tmp_path / "bare", "llama", tokenizer=False, tie_word_embeddings=True)
    policy = tiny_model("qwen3", seed=0, vocab_size=100).eval()
    with torch.device("meta"):
        shapes = {n: t.shape for n, t in tiny_model("qwen2").state_dict().items()}  # no memory

A seed gives the same weights whatever ``dtype``: the model is initialised in float32 and then cast.
``pad_token_id`` stays unset unless given, since transformers zeroes that row of the embedding. The
Megatron side of a test takes the same dict: ``build_gpt_model(tiny_hf_config(arch, **overrides), ...)``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from megatron_mugrpo.char_tokenizer import build_char_tokenizer
from megatron_mugrpo.training.model import ModelConfigError, tiny_hf_config

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def tiny_model(
    arch: str = "qwen2", *, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides: Any
) -> PreTrainedModel:
    """A randomly initialised transformers causal LM of ``tiny_hf_config(arch, **overrides)``.

    ``torch.manual_seed(seed)`` is set just before the weights are drawn (in float32); the model is
    then cast to ``dtype`` (``save_pretrained`` records the cast dtype). It is returned as transformers
    builds it: training mode, SDPA attention unless ``attn_implementation`` is overridden.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**tiny_hf_config(arch, **overrides))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.to(dtype)


def tiny_hf_dir(
    out_dir: str | Path,
    arch: str = "qwen2",
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    tokenizer: bool = True,
    adjust: Callable[[PreTrainedModel], None] | None = None,
    **overrides: Any,
) -> Path:
    """Save ``tiny_model(arch, seed=seed, dtype=dtype, **overrides)`` as a Hugging Face directory.

    With ``tokenizer`` the built-in character tokenizer (``char_tokenizer.build_char_tokenizer``) is
    saved beside the weights and sets the defaults of ``vocab_size`` (its length), ``bos_token_id``
    and ``eos_token_id``; an explicit ``vocab_size`` must cover it. ``adjust(model)`` runs under
    ``torch.no_grad()`` after the cast and before saving, for weights a check wants other than the
    random ones (e.g. a sharpened output layer). Returns ``out_dir`` as a Path.
    """
    out = Path(out_dir)
    if tokenizer:
        tok = build_char_tokenizer(out)
        if overrides.get("vocab_size", len(tok)) < len(tok):
            raise ModelConfigError(
                f"tiny_hf_dir: vocab_size={overrides['vocab_size']} is smaller than the character "
                f"tokenizer ({len(tok)} tokens); drop vocab_size or pass tokenizer=False"
            )
        overrides = {
            "vocab_size": len(tok),
            "bos_token_id": tok.bos_token_id,
            "eos_token_id": tok.eos_token_id,
            **overrides,
        }
    model = tiny_model(arch, seed=seed, dtype=dtype, **overrides)
    if adjust is not None:
        with torch.no_grad():
            adjust(model)
    model.save_pretrained(str(out), safe_serialization=True)
    return out
