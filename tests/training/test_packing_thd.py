"""Packed rows as megatron-core THD input (``training.packing.thd_params``, ``thd_inputs``): the
``cu_seqlens`` and positions of a packed micro-batch equal hand-computed values, the THD path is taken
only with Transformer Engine's attention, and a model without it is refused with a clear error.

Transformer Engine's attention itself needs a GPU; what is checkable on CPU is what we hand it."""

from __future__ import annotations

import itertools

import pytest
import torch
from dist_utils import run_distributed

from megatron_mugrpo.records import RolloutGroup, RolloutSample, collate
from megatron_mugrpo.training.batching import packed_micro_batches, row_lengths
from megatron_mugrpo.training.packing import TE_ATTENTION, pack_micro_batch, te_attention, thd_inputs, thd_params
from megatron_mugrpo.training.parallel import initialize_parallel
from megatron_mugrpo.training.setup import build_policy
from megatron_mugrpo.training.train_step import take

from .common import hf_config


def _packed():
    """Four responses of 4, 2, 1, 5 tokens after a 2-token prompt: rows of 5, 3, 2 and 6 columns, packed
    first-fit decreasing into rows of 6 as (row 3), (row 0), (rows 1 and 2)."""
    samples = [
        RolloutSample(response_ids=list(range(3, 3 + n)), behaviour_logprobs=[-1.0] * n, finish_reason="stop")
        for n in (4, 2, 1, 5)
    ]
    batch = collate([RolloutGroup(prompt_id="p", prompt_ids=[1, 2], answer="", samples=samples)], pad_id=0)
    lengths = row_lengths(batch.response_mask)
    assert lengths == [5, 3, 2, 6]
    (plan,) = packed_micro_batches([0, 1, 2, 3], lengths, 18)
    assert plan.bins == ((3,), (0,), (1, 2)) and plan.packed_width == 6
    return pack_micro_batch(take(batch, plan), plan, lengths)


def test_cu_seqlens_and_positions_of_a_packed_micro_batch() -> None:
    packed = _packed()
    # Flattened [1, 18]: row 0 = sequence of 6; row 1 = 5 + 1 padding; row 2 = 3 + 2 + 1 padding.
    assert packed.cu_seqlens.tolist() == [0, 6, 11, 14, 16]
    assert packed.cu_seqlens_padded.tolist() == [0, 6, 12, 15, 18]
    assert packed.cu_seqlens.dtype == packed.cu_seqlens_padded.dtype == torch.int32  # what TE takes
    row0, row1, row2 = [0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 0], [0, 1, 2, 0, 1, 0]
    assert packed.positions.reshape(-1).tolist() == [*row0, *row1, *row2]
    params = thd_params(packed)
    assert params.qkv_format == "thd"
    assert params.cu_seqlens_q is params.cu_seqlens_kv is packed.cu_seqlens
    assert params.cu_seqlens_q_padded is params.cu_seqlens_kv_padded is packed.cu_seqlens_padded
    assert params.max_seqlen_q == params.max_seqlen_kv == 6  # the longest padded span


def test_positions_restart_where_megatrons_rope_restarts_them() -> None:
    """megatron-core's THD RoPE gives each token its offset from its ``cu_seqlens_q_padded`` segment's
    start; at every real token that is our per-sequence position (what the CPU mask path applies)."""
    packed = _packed()
    bounds = packed.cu_seqlens_padded.tolist()
    offset = torch.cat([torch.arange(end - start) for start, end in itertools.pairwise(bounds)])
    real = packed.tokens.reshape(-1) != 0
    assert torch.equal(offset[real], packed.positions.reshape(-1)[real])


def test_thd_inputs_need_transformer_engines_attention() -> None:
    packed = _packed()

    class TEDotProductAttention(torch.nn.Module):  # the name is what identifies TE's attention
        pass

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), TEDotProductAttention())
    assert TEDotProductAttention.__name__ == TE_ATTENTION and te_attention(model)
    tokens, positions, params = thd_inputs(model, packed)
    assert tokens.shape == positions.shape == (1, 18)
    assert torch.equal(tokens.reshape(3, 6), packed.tokens) and params.cu_seqlens_q.tolist() == [0, 6, 11, 14, 16]


def _local_attention_is_refused(rank: int, world_size: int) -> None:
    model = build_policy(hf_config(), groups=initialize_parallel(1, 1, seed=0), dtype=torch.float32, optim=None)
    bare = model.unwrapped()[0]
    assert not te_attention(bare)  # the CPU build: megatron-core's local DotProductAttention
    with pytest.raises(ValueError, match="packed THD input needs Transformer Engine's attention"):
        thd_inputs(bare, _packed())


def test_a_model_without_transformer_engine_is_refused() -> None:
    run_distributed(_local_attention_is_refused, 1)
