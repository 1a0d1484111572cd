"""The declarative name maps against real transformers models (no disk, no Megatron ranks)."""

from __future__ import annotations

import pytest
import torch
from megatron_mugrpo.conversion.errors import ConversionError
from megatron_mugrpo.conversion.mappings import (
    architecture_maps,
    canonical_megatron_name,
    entry_for,
    expected_hf_shapes,
    expected_hf_tensors,
)

from megatron_mugrpo.training.model import tiny_hf_config
from megatron_mugrpo.training.tiny import tiny_model


def _transformers_state_shapes(arch: str, tied: bool) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        state = tiny_model(arch, tie_word_embeddings=tied).state_dict()
    if tied:
        state.pop("lm_head.weight")  # tied: saved once, as embed_tokens
    return {name: tuple(t.shape) for name, t in state.items()}


@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3"])
@pytest.mark.parametrize("tied", [False, True])
def test_map_covers_exactly_the_transformers_state_dict(arch: str, tied: bool) -> None:
    config = tiny_hf_config(arch, tie_word_embeddings=tied)
    assert expected_hf_shapes(config) == _transformers_state_shapes(arch, tied)


def test_every_hf_tensor_is_used_by_exactly_one_megatron_parameter() -> None:
    config = tiny_hf_config("qwen2")
    names = [name for entry in architecture_maps(config) for name in entry.hf]
    assert len(names) == len(set(names)) == len(expected_hf_tensors(config))


def test_tied_output_layer_reads_the_embedding() -> None:
    entry = entry_for("output_layer.weight", tiny_hf_config("qwen3", tie_word_embeddings=True))
    assert entry.hf == ("model.embed_tokens.weight",)
    assert entry_for("output_layer.weight", tiny_hf_config("qwen3")).hf == ("lm_head.weight",)


def test_pipeline_stage_local_names_map_to_global_layers() -> None:
    # Second stage of PP=2 on a 4-layer model: local layers 0, 1 are global layers 2, 3.
    offsets = {0: 2, 1: 3}
    assert canonical_megatron_name("decoder.layers.1.input_layernorm.weight", offsets) == (
        "decoder.layers.3.self_attention.linear_qkv.layer_norm_weight"
    )
    assert canonical_megatron_name("decoder.layers.0.mlp.linear_fc1.weight", offsets) == (
        "decoder.layers.2.mlp.linear_fc1.weight"
    )
    entry = entry_for("decoder.layers.3.self_attention.linear_qkv.bias", tiny_hf_config("qwen2"))
    assert entry.hf == tuple(f"model.layers.3.self_attn.{p}_proj.bias" for p in "qkv")


def test_unknown_architecture_and_unmapped_parameters_are_errors() -> None:
    with pytest.raises(ConversionError, match="model_type='gpt2'"):
        expected_hf_tensors({**tiny_hf_config("qwen2"), "model_type": "gpt2"})
    with pytest.raises(ConversionError, match="no Hugging Face mapping"):
        entry_for("decoder.layers.0.self_attention.q_layernorm.weight", tiny_hf_config("qwen2"))
