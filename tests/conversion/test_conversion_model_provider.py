"""The model provider's Hugging Face -> Megatron config translation (no ranks needed)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_mugrpo.training.model import (
    ModelConfigError,
    check_divisibility,
    llama3_inv_freq,
    padded_vocab_size,
    rope_parameters,
    tiny_hf_config,
    transformer_config_from_hf,
)


def test_padded_vocab_size_matches_megatron_rule() -> None:
    assert padded_vocab_size(256, 1) == 256
    assert padded_vocab_size(300, 1) == 384
    assert padded_vocab_size(300, 2) == 512
    assert padded_vocab_size(151936, 1) == 151936  # Qwen2.5 / Qwen3: 128 × 1187
    assert padded_vocab_size(151936, 2) == 152064  # 256 × 594
    assert padded_vocab_size(128256, 8) == 129024  # Llama 3: 1024 × 126


@pytest.mark.parametrize(
    ("arch", "qkv_bias", "qk_norm", "kv_channels"),
    [("qwen2", True, False, 16), ("llama", False, False, 16), ("qwen3", False, True, 24)],
)
def test_transformer_config_per_architecture(arch: str, qkv_bias: bool, qk_norm: bool, kv_channels: int) -> None:
    config = transformer_config_from_hf(tiny_hf_config(arch), dtype=torch.float32)
    assert (config.add_qkv_bias, config.qk_layernorm, config.kv_channels) == (qkv_bias, qk_norm, kv_channels)
    assert config.normalization == "RMSNorm" and config.gated_linear_unit and config.activation_func is F.silu
    assert not config.add_bias_linear
    assert (config.num_attention_heads, config.num_query_groups, config.ffn_hidden_size) == (4, 2, 128)
    assert config.layernorm_epsilon == 1e-6 and config.hidden_dropout == 0.0


def test_rope_parameters_read_both_config_formats() -> None:
    released = {"rope_theta": 5e5, "rope_scaling": {"type": "llama3", "factor": 32.0}}
    transformers5 = {"rope_parameters": {"rope_type": "llama3", "factor": 32.0, "rope_theta": 5e5}}
    for config in (released, transformers5):
        params = rope_parameters(config)
        assert (params["rope_type"], params["rope_theta"], params["factor"]) == ("llama3", 5e5, 32.0)
    assert rope_parameters({})["rope_type"] == "default"


def test_llama3_inv_freq_matches_transformers() -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    band = {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    hf = LlamaConfig(hidden_size=128, num_attention_heads=2, rope_theta=5e5, rope_scaling=dict(band))
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    ours = llama3_inv_freq(64, 5e5, **{k: v for k, v in band.items() if k != "rope_type"})
    torch.testing.assert_close(ours, expected.float(), rtol=1e-6, atol=0)


@pytest.mark.parametrize(
    ("overrides", "tp", "pp", "message"),
    [
        ({}, 4, 1, "must divide num_attention_heads=4 and num_key_value_heads=2"),
        ({}, 1, 4, "must divide num_hidden_layers=2"),
        ({"num_key_value_heads": 3}, 1, 1, "not a multiple of num_key_value_heads=3"),
    ],
)
def test_parallel_sizes_that_cannot_split_the_model(overrides: dict, tp: int, pp: int, message: str) -> None:
    with pytest.raises(ModelConfigError, match=message):
        check_divisibility(tiny_hf_config("qwen2", **overrides), tp, pp)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"model_type": "mistral"}, "model_type='mistral'"),
        ({"hidden_act": "gelu"}, "SwiGLU"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn'"),
    ],
)
def test_unsupported_configs_are_clear_errors(overrides: dict, message: str) -> None:
    with pytest.raises(ModelConfigError, match=message):
        transformer_config_from_hf(tiny_hf_config("llama", **overrides), dtype=torch.float32)


def test_tiny_config_rejects_unknown_arch() -> None:
    with pytest.raises(ModelConfigError, match="unknown arch"):
        tiny_hf_config("gpt2")
