"""``training.sdpa_attention``: megatron-core's local attention computed by one SDPA call.

Against megatron-core's own ``DotProductAttention`` in float64, values and input gradients: causal
without a mask, the packed rows' block-diagonal mask, grouped-query heads, a tensor-parallel rank's
share of the heads, and the fallbacks (attention dropout while training draws megatron's mask). The
layer specs the model builder chooses on CPU carry it, dense and MoE alike."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from dist_utils import run_distributed
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_mugrpo.training.model import build_gpt_model, layer_spec, transformer_config_from_hf
from megatron_mugrpo.training.sdpa_attention import SdpaDotProductAttention

from .common import hf_config

HEADS, GROUPS, HEAD_DIM, SEQ, BATCH = 4, 2, 8, 6, 3
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
"""Where megatron's attention allocates its score buffer (the current CUDA device when there is one)."""


def _config(**overrides) -> TransformerConfig:
    fields = dict(
        num_layers=1,
        hidden_size=HEADS * HEAD_DIM,
        num_attention_heads=HEADS,
        num_query_groups=GROUPS,
        kv_channels=HEAD_DIM,
        params_dtype=torch.float64,
        attention_dropout=0.0,
    )
    return TransformerConfig(**{**fields, **overrides})


def _tp(size: int) -> SimpleNamespace:
    """The one thing the attention modules ask of their process groups outside a checkpoint: TP's size."""
    return SimpleNamespace(tp=SimpleNamespace(size=lambda: size))


def _pair(config: TransformerConfig, tp: int = 1) -> tuple[DotProductAttention, SdpaDotProductAttention]:
    kwargs = dict(layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self", pg_collection=_tp(tp))
    return DotProductAttention(config, **kwargs), SdpaDotProductAttention(config, **kwargs)


def _qkv(heads: int = HEADS, groups: int = GROUPS, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(SEQ, BATCH, heads, HEAD_DIM), (SEQ, BATCH, groups, HEAD_DIM), (SEQ, BATCH, groups, HEAD_DIM)]
    return [torch.randn(shape, generator=gen, dtype=torch.float64).to(DEVICE) for shape in shapes]


def _packed_mask() -> torch.Tensor:
    """[B, 1, S, S], True = masked: row 0 holds sequences of 2 + 4 tokens, row 1 one of 6, row 2 3 + 3."""
    bounds = [[0, 0, 1, 1, 1, 1], [0] * 6, [0, 0, 0, 1, 1, 1]]
    seq = torch.tensor(bounds)
    same = seq[:, :, None] == seq[:, None, :]
    causal = torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
    return (~(same & causal)[:, None]).to(DEVICE)


def _forward_backward(module: DotProductAttention, qkv: list[torch.Tensor], mask: torch.Tensor | None):
    inputs = [t.clone().requires_grad_(True) for t in qkv]
    out = module(*inputs, mask)
    out.backward(torch.linspace(-1, 1, out.numel(), dtype=out.dtype, device=out.device).reshape(out.shape))
    return out.detach(), [t.grad for t in inputs]


def _compare_body(rank: int, world_size: int, case: str) -> None:
    torch.set_num_threads(1)
    from megatron_mugrpo.training.parallel import initialize_parallel

    initialize_parallel(1, 1, seed=0)  # megatron's forward takes its score buffer from parallel_state
    mcore, sdpa = _pair(_config())
    qkv, mask = _qkv(), None
    if case == "packed":
        mask = _packed_mask()
    elif case == "mha":
        mcore, sdpa = _pair(_config(num_query_groups=HEADS))
        qkv = _qkv(groups=HEADS)
    expected, expected_grads = _forward_backward(mcore, qkv, mask)
    got, grads = _forward_backward(sdpa, qkv, mask)
    assert got.shape == (SEQ, BATCH, HEADS * HEAD_DIM)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    for g, e in zip(grads, expected_grads):
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("case", ["causal-gqa", "packed", "mha"])
def test_equals_megatron_local_attention_in_float64(case: str) -> None:
    run_distributed(_compare_body, 1, case)


def test_a_tensor_parallel_rank_computes_its_own_heads() -> None:
    """At TP = 2 a rank holds heads/2 query heads and groups/2 key-value groups; its context is the
    unsplit attention's columns for those heads (each head attends on its own)."""
    _, full = _pair(_config())
    _, rank_module = _pair(_config(), tp=2)
    q, k, v = _qkv()
    mask = _packed_mask()
    whole = full(q, k, v, mask).reshape(SEQ, BATCH, HEADS, HEAD_DIM)
    for rank in range(2):
        heads, groups = slice(rank * 2, rank * 2 + 2), slice(rank, rank + 1)
        part = rank_module(q[:, :, heads], k[:, :, groups], v[:, :, groups], mask)
        torch.testing.assert_close(part, whole[:, :, heads].reshape(SEQ, BATCH, -1), rtol=1e-12, atol=1e-12)


def _dropout_body(rank: int, world_size: int) -> None:
    torch.set_num_threads(1)
    from megatron.core import tensor_parallel

    from megatron_mugrpo.training.parallel import initialize_parallel

    initialize_parallel(1, 1, seed=0)
    mcore, sdpa = _pair(_config(attention_dropout=0.5))
    qkv = _qkv()
    outputs = []
    for module in (mcore, sdpa):
        tensor_parallel.model_parallel_cuda_manual_seed(7)  # the same dropout draw for both
        outputs.append(module.train()(*qkv, None))
    assert torch.equal(outputs[0], outputs[1])  # the fallback is megatron's own forward
    no_dropout = sdpa.eval()(*qkv, None)
    assert not torch.equal(outputs[1], no_dropout)  # and dropout was really applied


def test_attention_dropout_while_training_is_megatrons() -> None:
    run_distributed(_dropout_body, 1)


def _model_body(rank: int, world_size: int) -> None:
    torch.set_num_threads(1)
    from megatron_mugrpo.training.parallel import initialize_parallel

    groups = initialize_parallel(1, 1, seed=0)  # megatron's MoE block spec reads the pipeline rank
    moe_hf = hf_config("qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    block = layer_spec(transformer_config_from_hf(moe_hf, dtype=torch.float32))
    assert {s.submodules.self_attention.submodules.core_attention for s in block.layer_specs} == {
        SdpaDotProductAttention
    }
    model = build_gpt_model(hf_config(), groups, dtype=torch.float64)
    cores = [m for m in model.modules() if isinstance(m, DotProductAttention)]
    assert len(cores) == 2 and all(type(m) is SdpaDotProductAttention for m in cores)
    # No state of its own: the checkpoint keys are those of megatron's local attention.
    assert not any("core_attention" in key for key in model.state_dict())


def test_cpu_specs_and_built_model_use_it_with_unchanged_state() -> None:
    run_distributed(_model_body, 1)
