"""Tiny models with the character tokenizer that write searches, for the agentic run tests: their
samples follow ``SEARCH_CHAIN`` (probability ~1e-7 off it), so every trajectory holds observations
without a warm start. The residual stream carries the current token's one-hot embedding (attention and
the MLP or experts add nothing) and the LM head maps it to the chain's next-character log-probs."""

from __future__ import annotations

import math
from pathlib import Path

import torch

SEARCH_CHAIN = {"<": {"s": 0.6, "/": 0.4}, "/": {"s": 1.0}, ">": {"A": 1.0}, "A": {"<": 1.0}}
SEARCH_CHAIN |= {a: {b: 1.0} for a, b in zip("search", "earch>")}
"""Next-character probabilities: '<search>A', repeated until a '</search>' closes the turn (any other
character, e.g. the prompt's or an observation's last, is followed by '<')."""
POSITIONS = 448
EXPERTS, TOPK = 4, 2


def searching_model(out: Path, *, moe: bool = False, heads: int = 4) -> Path:
    """A tiny Qwen2 (or, with ``moe``, a Qwen3-MoE of 4 experts top-2 whose routers see each token's
    one-hot embedding through a N(0, 1) gate, so each token's top-2 is far from a tie: the trainer, in
    Megatron, must choose exactly the engine's experts) saved to ``out``. ``heads=1`` gives head_dim 64,
    the smallest vLLM's CPU attention takes (attention adds nothing here either way)."""
    from megatron_mugrpo.char_tokenizer import build_char_tokenizer
    from megatron_mugrpo.warmstart import TinyModelConfig, build_tiny_model

    tokenizer = build_char_tokenizer(out)
    shape = dict(hidden_size=64, num_layers=2, num_attention_heads=heads, num_key_value_heads=max(1, heads // 2))
    if moe:
        shape |= dict(arch="qwen3_moe", num_experts=EXPERTS, num_experts_per_tok=TOPK, moe_intermediate_size=32)
    else:
        shape |= dict(intermediate_size=128)
    tiny = TinyModelConfig(**shape, max_position_embeddings=POSITIONS, tie_word_embeddings=False)
    model = build_tiny_model(tiny, tokenizer, seed=0)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        _follow_the_chain(model, tokenizer.get_vocab(), tiny.hidden_size)
        for layer in model.model.layers:  # the residual stream keeps the current token's embedding
            layer.self_attn.o_proj.weight.zero_()
            if moe:
                layer.mlp.experts.down_proj.zero_()
                layer.mlp.gate.weight.copy_(torch.randn(layer.mlp.gate.weight.shape, generator=generator))
            else:
                layer.mlp.down_proj.weight.zero_()
        model.model.norm.weight.fill_(1.0)
    model.save_pretrained(str(out), safe_serialization=True)
    return out


def _follow_the_chain(model: torch.nn.Module, vocab: dict[str, int], hidden: int) -> None:
    """One-hot embeddings of the chain's characters (state 0: every other character) and a head giving
    each state its next characters' log-probs (+20, so the rest is ~1e-9 each)."""
    embedding, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    embedding.zero_()
    embedding[:, 0] = 1.0  # state 0: any character outside the chain, followed by '<'
    head.zero_()
    head[vocab["<"], 0] = 20.0 / math.sqrt(hidden)  # the final RMSNorm scales a unit vector by √H
    for state, char in enumerate(SEARCH_CHAIN, start=1):
        embedding[vocab[char]] = 0.0
        embedding[vocab[char], state] = 1.0
        for after, p in SEARCH_CHAIN[char].items():
            head[vocab[after], state] = (20.0 + math.log(p)) / math.sqrt(hidden)
