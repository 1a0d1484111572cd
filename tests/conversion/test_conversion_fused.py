"""Pure fused-tensor functions: hand-built layouts and TP shard-then-gather identities."""

from __future__ import annotations

import pytest
import torch
from megatron_mugrpo.conversion import fused
from megatron_mugrpo.conversion.mappings import ModelDims, TensorMap, to_hf, to_megatron_shard


def _rows(n: int, start: int = 0, width: int = 1) -> torch.Tensor:
    """[n, width] tensor whose row i is filled with start + i: layouts become readable row ids."""
    return (torch.arange(n, dtype=torch.float32) + start).unsqueeze(1).expand(n, width).contiguous()


def test_qkv_fuse_interleaves_per_query_group() -> None:
    # 4 heads, 2 groups, head_dim 1: q rows 0..3, k rows 10..11, v rows 20..21.
    fused_qkv = fused.qkv_fuse(_rows(4), _rows(2, 10), _rows(2, 20), num_heads=4, num_groups=2, head_dim=1)
    assert fused_qkv[:, 0].tolist() == [0, 1, 10, 20, 2, 3, 11, 21]


def test_qkv_shard_gives_each_rank_whole_groups() -> None:
    q, k, v = _rows(8, 0, 3), _rows(4, 100, 3), _rows(4, 200, 3)  # 4 heads × d=2, 2 groups × d=2
    shards = [fused.qkv_shard(q, k, v, num_heads=4, num_groups=2, head_dim=2, tp=2, rank=r) for r in range(2)]
    assert shards[0][:, 0].tolist() == [0, 1, 2, 3, 100, 101, 200, 201]
    assert shards[1][:, 0].tolist() == [4, 5, 6, 7, 102, 103, 202, 203]
    for got, want in zip(fused.qkv_gather(shards, num_heads=4, num_groups=2, head_dim=2), (q, k, v)):
        assert torch.equal(got, want)


def test_qkv_bias_uses_the_same_layout() -> None:
    q, k, v = torch.arange(8.0), torch.arange(4.0) + 100, torch.arange(4.0) + 200
    fused_bias = fused.qkv_fuse(q, k, v, num_heads=4, num_groups=2, head_dim=2)
    assert fused_bias.tolist() == [0, 1, 2, 3, 100, 101, 200, 201, 4, 5, 6, 7, 102, 103, 202, 203]
    assert all(torch.equal(a, b) for a, b in zip(fused.qkv_unfuse(fused_bias, 4, 2, 2), (q, k, v)))


def test_gated_fc1_rank_holds_its_gate_and_up_chunks() -> None:
    gate, up = _rows(4, 0, 2), _rows(4, 10, 2)
    shards = [fused.gated_fc1_shard(gate, up, tp=2, rank=r) for r in range(2)]
    assert shards[0][:, 0].tolist() == [0, 1, 10, 11]
    assert shards[1][:, 0].tolist() == [2, 3, 12, 13]
    # Not a plain split of [gate; up], which would give rank 0 only gate rows.
    assert not torch.equal(shards[0], torch.cat([gate, up]).chunk(2)[0])
    got_gate, got_up = fused.gated_fc1_gather(shards)
    assert torch.equal(got_gate, gate) and torch.equal(got_up, up)


def test_vocab_padding_and_unpadding() -> None:
    weight = _rows(5, 1, 3)
    shards = [fused.vocab_shard(weight, padded_vocab=8, tp=2, rank=r) for r in range(2)]
    assert [s.shape[0] for s in shards] == [4, 4]
    assert shards[1][1:].abs().sum() == 0  # rows 5..7 are zero padding
    assert torch.equal(fused.vocab_gather(shards, vocab_size=5), weight)
    with pytest.raises(ValueError, match="padded_vocab"):
        fused.vocab_pad(weight, 4)


KINDS = {
    "replicated": (("n",), [(6,)]),
    "column": (("w",), [(8, 6)]),
    "row": (("w",), [(6, 8)]),
    "qkv": (("q", "k", "v"), [(8 * 3, 6), (2 * 3, 6), (2 * 3, 6)]),
    "gated_fc1": (("gate", "up"), [(8, 6), (8, 6)]),
    "vocab": (("emb",), [(300, 6)]),
}


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("tp", [1, 2])
def test_every_kind_shard_then_gather_is_identity(kind: str, tp: int) -> None:
    names, shapes = KINDS[kind]
    dims = ModelDims(num_heads=8, num_groups=2, head_dim=3, vocab_size=300)
    entry = TensorMap("m", names, kind)
    tensors = [torch.randn(shape) for shape in shapes]
    shards = [to_megatron_shard(entry, tensors, dims, tp=tp, rank=r) for r in range(tp)]
    for (name, got), want, expected_name in zip(to_hf(entry, shards, dims), tensors, names):
        assert name == expected_name and torch.equal(got, want)
