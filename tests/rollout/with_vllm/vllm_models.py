"""Tiny head_dim-64 Qwen2 checkpoints for the vLLM tests (vLLM's CPU attention refuses head_dim 16:
"Unsupported CPU attention configuration: head_dim=16"; one head over a 64-wide residual stream runs)."""

from __future__ import annotations

from pathlib import Path

from megatron_mugrpo.training.tiny import tiny_hf_dir

VOCAB = 48
EOS_IDS = [2, 3]
"""Two EOS ids, so that a random model's 24-token responses both stop and run to the end."""
SHAPE = {
    "hidden_size": 64,
    "num_attention_heads": 1,
    "num_key_value_heads": 1,
    "intermediate_size": 128,
    "max_position_embeddings": 128,
    "tie_word_embeddings": True,
}


def vllm_model_dir(path: Path, *, seed: int) -> Path:
    """A random tiny Qwen2 (head_dim 64, EOS ids ``EOS_IDS``, no tokenizer) saved in ``path``."""
    return tiny_hf_dir(path, seed=seed, tokenizer=False, vocab_size=VOCAB, eos_token_id=EOS_IDS, **SHAPE)
