"""Packed sequences on the local attention path: several responses in one row, each seeing only itself.

``parallel.pack_sequences`` (with ``parallel.micro_batch_tokens``): ``training.batching`` puts rows
into packed rows first-fit decreasing; this module builds what the model sees and reads its
log-probs back:

* the tokens of each sequence side by side, with **per-sequence position ids** (0, 1, ... again at
  each sequence's start) turned into per-token rotary embeddings (``per_sequence_rotary``);
* a **block-diagonal causal mask** [R, 1, W, W] (True = masked), so attention stays inside each
  sequence. The local layer spec's attention applies it (``training.sdpa_attention``: SDPA gives
  masked scores weight exactly 0, as megatron's ``FusedScaleMaskSoftmax`` does by filling them with
  -10000), so a packed sequence's log-probs are those of the same sequence alone up to the order of
  float additions;
* each sequence's own targets (and replayed MoE routes: they follow their tokens), and an index
  that gathers the packed [R, W] log-probs back into the unpacked micro-batch's [n, L] layout,
  where the loss runs unchanged (per-response aggregation needs one response per row). The gather
  carries the gradient.

With Transformer Engine's attention (``te_attention``; the paper's GPU set-up) the same packed rows
go to megatron-core as THD instead (``thd_params``): the [R, W] rows flattened to one row [1, R·W]
and a ``PackedSeqParams`` whose ``cu_seqlens`` bound each sequence, so TE's attention and megatron's
RoPE (which restarts positions at each ``cu_seqlens_q_padded`` boundary) stay inside each sequence
without the W × W mask. A packed row's trailing padding counts as padding of its last sequence
(``cu_seqlens_*_padded``). megatron-core 0.16's local ``DotProductAttention`` refuses
``PackedSeqParams``, so without TE the mask path above is the one taken (``parallel.pack_sequences``
chooses nothing else: the model decides).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from megatron_mugrpo.records import TrainBatch
from megatron_mugrpo.training.batching import MicroBatchPlan

if TYPE_CHECKING:  # megatron-core is imported where THD parameters are built
    from megatron.core.packed_seq_params import PackedSeqParams


@dataclass(kw_only=True)
class PackedRows:
    """One packed micro-batch: the model's inputs and the way back to one response per row."""

    tokens: Tensor
    """[R, W] int64 input ids, sequences side by side, 0 after the last one."""
    targets: Tensor
    """[R, W] int64: each sequence's own response targets, 0 elsewhere (pad ids need not be real)."""
    positions: Tensor
    """[R, W] int64 position of each token within its own sequence."""
    attention_mask: Tensor
    """[R, 1, W, W] bool, True = masked: causal inside each sequence, nothing across sequences."""
    index: Tensor
    """[n, L] int64: flat index into [R · W] of the unpacked micro-batch's (row, column)."""
    valid: Tensor
    """[n, L] bool: columns of the unpacked rows that lie inside their sequence."""
    response_mask: Tensor
    """[R, W] float32: 1 where ``targets`` is a response token (what routing replay reads as real tokens)."""
    cu_seqlens: Tensor
    """[S + 1] int32: cumulative real lengths of the S packed sequences, in row-major order (THD)."""
    cu_seqlens_padded: Tensor
    """[S + 1] int32: where each sequence starts in the flattened [R · W] row, each row's trailing padding
    counted in its last sequence (THD; the last entry is R · W)."""
    routes: Tensor | None = None
    """[R, W, moe_layers, k]: each token's replayed experts, following it into the packed row."""

    def unpack(self, packed: Tensor) -> Tensor:
        """[R, W] per-token values (log-probs) → the unpacked [n, L] layout, 0 outside each sequence."""
        gathered = packed.reshape(-1)[self.index]
        return torch.where(self.valid, gathered, torch.zeros((), dtype=packed.dtype, device=packed.device))


def pack_micro_batch(mb: TrainBatch, plan: MicroBatchPlan, lengths: list[int]) -> PackedRows:
    """Pack ``mb`` (``train_step.take(batch, plan)``: row i is the update's row ``plan.rows[i]``) into
    ``plan.bins``; ``lengths`` are the update's ``batching.row_lengths``."""
    rows, width = len(plan.bins), plan.packed_width
    device = mb.tokens.device
    tokens = torch.zeros(rows, width, dtype=torch.long, device=device)
    targets = torch.zeros_like(tokens)
    positions = torch.zeros_like(tokens)
    segment = torch.full_like(tokens, -1)
    index = torch.zeros_like(mb.tokens)
    valid = torch.zeros(mb.tokens.shape, dtype=torch.bool, device=device)
    own_targets = torch.where(mb.response_mask.bool(), mb.targets, 0)
    response_mask = torch.zeros(rows, width, dtype=mb.response_mask.dtype, device=device)
    routes = None if mb.routes is None else mb.routes.new_zeros((rows, width, *mb.routes.shape[2:]))
    real, starts = [0], [0]
    i = 0
    for r, members in enumerate(plan.bins):
        offset = 0
        for row in members:
            n = lengths[row]
            real.append(real[-1] + n)
            starts.append(r * width + offset + n)
            span = torch.arange(n, device=device)
            tokens[r, offset : offset + n] = mb.tokens[i, :n]
            targets[r, offset : offset + n] = own_targets[i, :n]
            response_mask[r, offset : offset + n] = mb.response_mask[i, :n]
            if routes is not None:  # a row's routes cover its n input tokens (records.collate)
                routes[r, offset : offset + n] = mb.routes[i, :n]
            positions[r, offset : offset + n] = span
            segment[r, offset : offset + n] = i
            index[i, :n] = r * width + offset + span
            valid[i, :n] = True
            offset += n
            i += 1
        starts[-1] = (r + 1) * width  # the row's trailing padding belongs to its last sequence
    causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
    same = (segment[:, :, None] == segment[:, None, :]) & (segment >= 0)[:, :, None]
    return PackedRows(
        tokens=tokens,
        targets=targets,
        positions=positions,
        attention_mask=~(same & causal)[:, None],
        index=index,
        valid=valid,
        response_mask=response_mask,
        cu_seqlens=torch.tensor(real, dtype=torch.int32, device=device),
        cu_seqlens_padded=torch.tensor(starts, dtype=torch.int32, device=device),
        routes=routes,
    )


@contextmanager
def per_sequence_rotary(model: torch.nn.Module, positions: Tensor) -> Iterator[None]:
    """For one forward: ``model``'s rotary embedding at ``positions`` [R, W] per token, not at 0..W-1.

    megatron-core 0.16.1's ``GPTModel`` computes RoPE for positions 0..S-1 of the whole row whatever
    ``position_ids`` says (per-sequence positions exist only on its THD path); the embedding it
    returns, [S, 1, 1, dim], broadcasts over the batch in ``apply_rotary_pos_emb``, so a per-row
    [S, R, 1, dim] table gathered at each token's own position applies per-sequence positions.
    """
    rotary = getattr(model, "rotary_pos_emb", None)
    if getattr(model, "position_embedding_type", None) != "rope" or rotary is None:
        raise ValueError(
            "parallel.pack_sequences needs a RoPE model (position_embedding_type 'rope'), got "
            f"{getattr(model, 'position_embedding_type', None)!r}; set parallel.pack_sequences=false"
        )
    table = rotary.get_emb(int(positions.max()) + 1)[:, 0, 0, :]  # [S, dim]
    per_token = table[positions.t()][:, :, None, :]  # [W, R, 1, dim], sequence-major like the activations
    rotary.forward = lambda *_args, **_kwargs: per_token  # the instance attribute shadows the cached method
    try:
        yield
    finally:
        del rotary.forward


TE_ATTENTION = "TEDotProductAttention"
"""megatron-core's Transformer Engine attention class (``megatron.core.extensions.transformer_engine``),
the one core attention that takes THD input. Matched by name so that this check imports nothing."""


def te_attention(model: torch.nn.Module) -> bool:
    """True when ``model``'s core attention is Transformer Engine's: packed rows then go in as THD."""
    return any(type(module).__name__ == TE_ATTENTION for module in model.modules())


def thd_params(packed: PackedRows) -> PackedSeqParams:
    """megatron-core's THD description of ``packed`` flattened to one row [1, R · W] (tokens, positions,
    targets and log-probs all flatten row-major): each sequence's real length and its padded span.

    ``max_seqlen_*`` is the longest padded span: megatron sizes the RoPE table by it and TE its kernels."""
    from megatron.core.packed_seq_params import PackedSeqParams

    longest = int((packed.cu_seqlens_padded[1:] - packed.cu_seqlens_padded[:-1]).max())
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=packed.cu_seqlens,
        cu_seqlens_kv=packed.cu_seqlens,
        cu_seqlens_q_padded=packed.cu_seqlens_padded,
        cu_seqlens_kv_padded=packed.cu_seqlens_padded,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
    )


def thd_inputs(model: torch.nn.Module, packed: PackedRows) -> tuple[Tensor, Tensor, PackedSeqParams]:
    """(tokens [1, R · W], positions [1, R · W], THD params) for ``model``; a model without Transformer
    Engine's attention is refused (megatron-core's local attention asserts on ``PackedSeqParams``)."""
    if not te_attention(model):
        raise ValueError(
            "packed THD input needs Transformer Engine's attention (TEDotProductAttention); this model uses "
            "megatron-core's local attention, which takes packed rows through the block-diagonal mask instead "
            "(training.packing.per_sequence_rotary with PackedRows.attention_mask)"
        )
    return packed.tokens.reshape(1, -1), packed.positions.reshape(1, -1), thd_params(packed)
