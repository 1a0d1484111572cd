"""Pure tensor functions for the fused Megatron parameters, one pair per fused layout.

Each ``*_shard`` function builds the tensor one TP rank holds from Hugging Face tensors (its
``*_shard_into`` twin writes it straight into an existing tensor, e.g. the live parameter, copying
each element once); each ``*_gather`` function inverts it from the list of all TP ranks' shards.
No process groups, no I/O: the live loader, the exporter and the tests call the same functions.

Layouts (checked against megatron-core's ``Attention.get_query_key_value_tensors`` and
``mlp.apply_swiglu_sharded_factory``):

- QKV: rows grouped per query group g: [q heads of g (heads/groups × head_dim rows); k_g (head_dim
  rows); v_g (head_dim rows)]. TP rank r holds the contiguous groups [r·groups/tp, (r+1)·groups/tp),
  so the global fused tensor is the concatenation of the TP shards. Weights [rows, H] and biases
  [rows] use the same function.
- Gated fc1: TP rank r holds [gate_r; up_r] ([2·F/tp, H]), where gate_r / up_r are the r-th row
  chunks of gate / up. This is *not* a chunk of [gate; up].
- Vocabulary: rows padded with zeros from V to V_pad, then row-chunked over TP.
"""

from __future__ import annotations

import torch
from torch import Tensor


def split_shard(tensor: Tensor, axis: int | None, tp: int, rank: int) -> Tensor:
    """TP rank ``rank``'s chunk of ``tensor`` along ``axis`` (the whole tensor when ``axis`` is None)."""
    if axis is None:
        return tensor
    return torch.chunk(tensor, tp, dim=axis)[rank]


def concat_shards(shards: list[Tensor], axis: int | None) -> Tensor:
    """Inverse of ``split_shard`` over all ranks: concatenation along ``axis`` (rank 0's copy if None).

    One shard (TP = 1) comes back as is, not copied.
    """
    if axis is None or len(shards) == 1:
        return shards[0]
    return torch.cat(shards, dim=axis)


def qkv_fuse(q: Tensor, k: Tensor, v: Tensor, num_heads: int, num_groups: int, head_dim: int) -> Tensor:
    """Megatron's interleaved QKV from HF q [heads·d, *], k [groups·d, *], v [groups·d, *].

    Returns [(heads + 2·groups)·d, *]: per group g, q heads of g, then k_g, then v_g.
    """
    trailing = q.shape[1:]
    per_group = num_heads // num_groups
    q = q.reshape(num_groups, per_group * head_dim, *trailing)
    k = k.reshape(num_groups, head_dim, *trailing)
    v = v.reshape(num_groups, head_dim, *trailing)
    return torch.cat([q, k, v], dim=1).reshape(-1, *trailing)


def qkv_unfuse(fused: Tensor, num_heads: int, num_groups: int, head_dim: int) -> tuple[Tensor, Tensor, Tensor]:
    """Inverse of ``qkv_fuse``: HF (q [heads·d, *], k [groups·d, *], v [groups·d, *]) from the fused tensor."""
    trailing = fused.shape[1:]
    per_group = num_heads // num_groups
    grouped = fused.reshape(num_groups, (per_group + 2) * head_dim, *trailing)
    q, k, v = torch.split(grouped, [per_group * head_dim, head_dim, head_dim], dim=1)
    return (
        q.reshape(num_heads * head_dim, *trailing),
        k.reshape(num_groups * head_dim, *trailing),
        v.reshape(num_groups * head_dim, *trailing),
    )


def qkv_shard_into(
    out: Tensor, q: Tensor, k: Tensor, v: Tensor, *, num_heads: int, num_groups: int, head_dim: int, tp: int, rank: int
) -> Tensor:
    """Write TP rank ``rank``'s fused QKV [(heads + 2·groups)·d / tp, *] into ``out`` (cast to its dtype)."""
    trailing = q.shape[1:]
    per_group, local = num_heads // num_groups, num_groups // tp
    mine = slice(rank * local, (rank + 1) * local)  # the rank's query groups are contiguous
    dst = out.view(local, (per_group + 2) * head_dim, *trailing)
    q_rows = per_group * head_dim
    dst[:, :q_rows].copy_(q.reshape(num_groups, q_rows, *trailing)[mine])
    dst[:, q_rows : q_rows + head_dim].copy_(k.reshape(num_groups, head_dim, *trailing)[mine])
    dst[:, q_rows + head_dim :].copy_(v.reshape(num_groups, head_dim, *trailing)[mine])
    return out


def qkv_shard(
    q: Tensor, k: Tensor, v: Tensor, *, num_heads: int, num_groups: int, head_dim: int, tp: int, rank: int
) -> Tensor:
    """TP rank ``rank``'s fused QKV [(heads + 2·groups)·d / tp, *]: a row chunk of the global fused tensor."""
    out = q.new_empty(((num_heads + 2 * num_groups) * head_dim // tp, *q.shape[1:]))
    return qkv_shard_into(out, q, k, v, num_heads=num_heads, num_groups=num_groups, head_dim=head_dim, tp=tp, rank=rank)


def qkv_gather(
    shards: list[Tensor], *, num_heads: int, num_groups: int, head_dim: int
) -> tuple[Tensor, Tensor, Tensor]:
    """HF (q, k, v) from every TP rank's fused QKV shard (in rank order)."""
    return qkv_unfuse(torch.cat(shards, dim=0), num_heads, num_groups, head_dim)


def gated_fc1_shard_into(out: Tensor, gate: Tensor, up: Tensor, *, tp: int, rank: int) -> Tensor:
    """Write TP rank ``rank``'s fc1 [2·F/tp, H] = [gate_r; up_r] into ``out`` (cast to its dtype)."""
    rows = gate.shape[0] // tp
    out[:rows].copy_(gate[rank * rows : (rank + 1) * rows])
    out[rows:].copy_(up[rank * rows : (rank + 1) * rows])
    return out


def gated_fc1_shard(gate: Tensor, up: Tensor, *, tp: int, rank: int) -> Tensor:
    """TP rank ``rank``'s fc1 [2·F/tp, H] = [gate_r; up_r] from HF gate [F, H] and up [F, H]."""
    out = gate.new_empty((2 * gate.shape[0] // tp, *gate.shape[1:]))
    return gated_fc1_shard_into(out, gate, up, tp=tp, rank=rank)


def gated_fc1_gather(shards: list[Tensor]) -> tuple[Tensor, Tensor]:
    """HF (gate [F, H], up [F, H]) from every TP rank's [gate_r; up_r] shard (in rank order)."""
    halves = [torch.chunk(shard, 2, dim=0) for shard in shards]
    return torch.cat([g for g, _ in halves], dim=0), torch.cat([u for _, u in halves], dim=0)


def vocab_pad(weight: Tensor, padded_vocab: int) -> Tensor:
    """[V, H] -> [V_pad, H] with zero rows appended (the padded ids never occur in HF or the engine)."""
    extra = padded_vocab - weight.shape[0]
    if extra < 0:
        raise ValueError(f"vocab_pad: weight has {weight.shape[0]} rows, more than padded_vocab={padded_vocab}")
    if extra == 0:
        return weight
    return torch.cat([weight, weight.new_zeros(extra, *weight.shape[1:])], dim=0)


def vocab_shard_into(out: Tensor, weight: Tensor, *, padded_vocab: int, tp: int, rank: int) -> Tensor:
    """Write TP rank ``rank``'s rows [V_pad / tp, H] of the zero-padded ``weight`` into ``out``."""
    if padded_vocab < weight.shape[0]:
        raise ValueError(f"vocab_pad: weight has {weight.shape[0]} rows, more than padded_vocab={padded_vocab}")
    rows = padded_vocab // tp
    start = rank * rows
    real = max(0, min(rows, weight.shape[0] - start))
    out[:real].copy_(weight[start : start + real])
    out[real:].zero_()
    return out


def vocab_shard(weight: Tensor, *, padded_vocab: int, tp: int, rank: int) -> Tensor:
    """TP rank ``rank``'s rows [V_pad / tp, H] of the zero-padded embedding / output weight."""
    out = weight.new_empty((padded_vocab // tp, *weight.shape[1:]))
    return vocab_shard_into(out, weight, padded_vocab=padded_vocab, tp=tp, rank=rank)


def vocab_gather(shards: list[Tensor], *, vocab_size: int) -> Tensor:
    """HF [V, H] from every TP rank's padded rows: concatenate, then drop the padding rows."""
    return concat_shards(shards, 0)[:vocab_size]
