"""Megatron's local core attention computed by ``torch.nn.functional.scaled_dot_product_attention``.

megatron-core's local layer spec (the one used without Transformer Engine: always on CPU) builds
``DotProductAttention``: scores by ``baddbmm`` into a [b·heads, s, s] buffer, the causal or packed
mask written into the scores by ``masked_fill_``, a softmax module, dropout under the RNG tracker,
``bmm`` with the values, then a permute-copy back to [s, b, h]; grouped-query keys and values are
first copied out by ``repeat_interleave``. At the CPU demo's update shape that chain was the largest
model-level cost Megatron had over the plain PyTorch update (``benchmarks/train_step.py``).

``SdpaDotProductAttention`` is that module with one fused call in its place: SDPA applies the scale,
the causal mask (``is_causal``) or the caller's mask, the softmax and the value product, shares the
key / value heads across query groups itself (``enable_gqa``) and has its own backward. It is put
into the layer spec through megatron-core's ``core_attention`` slot (``local_spec_with_sdpa``), as
megatron's TE spec substitutes ``TEDotProductAttention``; megatron-core is not patched.

Same inputs, outputs and state as ``DotProductAttention`` (it is a subclass: no parameters of its
own, so checkpoints are unchanged):

* query [sq, b, heads/tp, d], key / value [sk, b, groups/tp, d] → context [sq, b, heads/tp · d];
  with TP each rank holds its own heads, exactly as before.
* ``attention_mask`` [b or 1, 1, sq, sk] bool, True = masked (megatron's convention; the packed rows'
  block-diagonal mask of ``training.packing``); None with a causal mask type means causal.

Masked scores get probability 0 here (SDPA's −inf) where megatron wrote −10000 before the softmax:
identical whenever a query keeps at least one visible key (exp(−10000 − max) is 0.0 in float32 and
float64), which a causal or block-diagonal causal mask guarantees (every token sees itself).

Whatever SDPA does not express the same way falls back to megatron's own forward, unchanged:
attention dropout while training (megatron draws it under its RNG tracker), a softmax offset
(``softmax_type`` other than ``vanilla``), sliding-window layers, query-key layer scaling, an
attention bias, ``packed_seq_params`` (megatron's local attention refuses them; the packed-row mask
above is the local path), and a causal mask between unequal query and key lengths.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.utils import is_layer_window_attention
from torch import Tensor


class SdpaDotProductAttention(DotProductAttention):
    """``DotProductAttention`` whose forward is one ``scaled_dot_product_attention`` call (see module doc)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        config = self.config
        windowed = is_layer_window_attention(config.window_size, config.window_attn_skip_freq, self.layer_number)
        # Fixed at construction: the cases whose math SDPA does not reproduce as megatron computes it.
        self.sdpa_unsupported = (
            config.softmax_type != "vanilla" or bool(windowed) or bool(config.apply_query_key_layer_scaling)
        )

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> Tensor:
        if not self._sdpa_applies(query, key, attention_mask, attention_bias, packed_seq_params):
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params)
        sq, b, heads, d = query.shape
        causal = attention_mask is None and self.attn_mask_type == AttnMaskType.causal and sq > 1
        # SDPA's mask is True = attend, megatron's True = masked.
        mask = None if attention_mask is None else ~attention_mask
        context = torch.nn.functional.scaled_dot_product_attention(
            query.permute(1, 2, 0, 3),  # [b, heads, sq, d] views; SDPA takes strided inputs
            key.permute(1, 2, 0, 3),
            value.permute(1, 2, 0, 3),
            attn_mask=mask,
            is_causal=causal,
            scale=self.softmax_scale,
            enable_gqa=heads != key.shape[2],
        )
        return context.permute(2, 0, 1, 3).reshape(sq, b, heads * d)  # [sq, b, heads/tp · d]

    def _sdpa_applies(
        self,
        query: Tensor,
        key: Tensor,
        attention_mask: Tensor | None,
        attention_bias: Tensor | None,
        packed_seq_params: Any,
    ) -> bool:
        if self.sdpa_unsupported or attention_bias is not None or packed_seq_params is not None:
            return False
        if self.training and self.attention_dropout.p > 0:
            return False
        causal_unequal = self.attn_mask_type == AttnMaskType.causal and query.shape[0] not in (1, key.shape[0])
        return not (attention_mask is None and causal_unequal)


def with_sdpa_attention(spec: ModuleSpec) -> ModuleSpec:
    """``spec`` (a transformer layer's) with megatron's local ``DotProductAttention`` replaced by
    ``SdpaDotProductAttention``; any other core attention (Transformer Engine's, MLA's) is kept."""
    attention = getattr(spec.submodules, "self_attention", None)
    inner = getattr(attention, "submodules", None)
    if inner is None or getattr(inner, "core_attention", None) is not DotProductAttention:
        return spec
    inner = dataclasses.replace(inner, core_attention=SdpaDotProductAttention)
    attention = dataclasses.replace(attention, submodules=inner)
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, self_attention=attention))
