"""training.tiny: the one builder of the tests' and benchmarks' tiny models (no downloads)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from megatron_mugrpo.training.model import ModelConfigError
from megatron_mugrpo.training.tiny import tiny_hf_dir, tiny_model

SMALL = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1}


def _equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]) for k in sa)


def test_a_seed_gives_the_same_weights_whatever_the_dtype() -> None:
    bf16 = tiny_model(seed=3, dtype=torch.bfloat16, **SMALL)
    assert bf16.dtype == torch.bfloat16
    assert _equal(bf16, tiny_model(seed=3, **SMALL).to(torch.bfloat16))
    assert not _equal(tiny_model(seed=3, **SMALL), tiny_model(seed=4, **SMALL))


@pytest.mark.parametrize(("arch", "cls"), [("llama", "LlamaForCausalLM"), ("qwen3", "Qwen3ForCausalLM")])
def test_arch_and_overrides_reach_the_model(arch: str, cls: str) -> None:
    with torch.device("meta"):  # shapes only
        model = tiny_model(arch, vocab_size=100, tie_word_embeddings=True)
    assert type(model).__name__ == cls
    assert model.config.vocab_size == 100 and model.lm_head.weight is model.model.embed_tokens.weight


def test_hf_dir_holds_the_char_tokenizer_and_the_seeded_model(tmp_path) -> None:
    path = tiny_hf_dir(tmp_path / "m", seed=1, **SMALL)
    tokenizer = AutoTokenizer.from_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    assert config["vocab_size"] == len(tokenizer) and config["eos_token_id"] == tokenizer.eos_token_id
    assert "pad_token_id" not in config or config["pad_token_id"] is None  # no zeroed embedding row
    loaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert _equal(loaded, tiny_model(seed=1, vocab_size=len(tokenizer), **SMALL))


def test_hf_dir_without_tokenizer_and_with_adjusted_weights(tmp_path) -> None:
    path = tiny_hf_dir(
        tmp_path / "m", tokenizer=False, adjust=lambda m: m.lm_head.weight.mul_(2.0), vocab_size=40, **SMALL
    )
    assert not (path / "tokenizer.json").exists()
    loaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    torch.testing.assert_close(loaded.lm_head.weight, 2.0 * tiny_model(vocab_size=40, **SMALL).lm_head.weight)


def test_a_vocab_smaller_than_the_tokenizer_is_refused(tmp_path) -> None:
    with pytest.raises(ModelConfigError, match="smaller than the character tokenizer"):
        tiny_hf_dir(tmp_path / "m", vocab_size=10, **SMALL)
