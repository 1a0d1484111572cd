"""Per-token log-probs of given tokens under the trained policy, vocab-parallel across TP.

    logprob[b, t] = log_softmax(logits[b, t] / T)[targets[b, t]]     over the TRUE vocabulary

T is the rollout temperature, so the trainer scores exactly the distribution the behaviour policy
sampled from (DESIGN.md: anything else biases the importance ratio). Each TP rank holds vocabulary
rows ``[vocab_start, vocab_start + V_pad/tp)``; Megatron's padding rows (ids >= the true vocab size,
absent from Hugging Face and the rollout engine) are excluded from the softmax. Full-vocabulary
logits are never gathered: max and sum-exp are all-reduced over the TP group.

Two implementations behind one switch (``impl``):

* ``"unfused"``: the model's output layer materialises logits [B, L, V/tp]; ``VocabParallelLogprob``
  below turns them into log-probs (plain torch, one [N, V/tp] float32 softmax saved for backward).
* ``"fused"``: the output layer is bypassed (``hidden_states_instead_of_logits``) and
  ``megatron_mugrpo.kernels.fused_linear_logprobs`` multiplies the final hidden states with the
  output-weight shard block by block, never holding [N, V/tp] float32 logits. With tied embeddings
  the weight is the embedding matrix on the first stage and Megatron's synchronised copy
  (``output_layer.weight``) on the last stage — ``GPTModel`` passes whichever applies.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.models.gpt import GPTModel
from torch import Tensor

LOGPROB_IMPLS = ("fused", "unfused")


def vocab_range(n_local: int, tp_group: dist.ProcessGroup | None) -> tuple[int, int]:
    """Global ids [start, stop) of this TP rank's vocabulary shard of ``n_local`` rows."""
    rank = dist.get_rank(tp_group) if tp_group is not None and dist.get_world_size(tp_group) > 1 else 0
    return rank * n_local, (rank + 1) * n_local


class VocabParallelLogprob(torch.autograd.Function):
    """log_softmax(logits / T)[target] for logits split over the vocabulary across ``tp_group``.

    Forward: logits [N, V/tp] (any float dtype), targets [N] int64 global ids → [N] float32.
    Backward: d logits = g · (onehot(target) − softmax) / T on this shard (no communication: the
    reduced statistics were saved in forward).
    """

    @staticmethod
    def forward(
        ctx: Any,
        logits: Tensor,
        targets: Tensor,
        temperature: float,
        vocab_size: int,
        tp_group: dist.ProcessGroup | None,
    ) -> Tensor:
        n_local = logits.shape[-1]
        start, stop = vocab_range(n_local, tp_group)
        scaled = logits.float() / temperature
        if stop > vocab_size:  # padding rows on this shard: never sampled, never in the softmax
            valid = torch.arange(start, stop, device=logits.device) < vocab_size
            scaled = scaled.masked_fill(~valid, float("-inf"))
        local_max = scaled.max(dim=-1).values
        global_max = _all_reduce(local_max.clone(), dist.ReduceOp.MAX, tp_group)
        exp = torch.exp(scaled - global_max.unsqueeze(-1))
        sum_exp = _all_reduce(exp.sum(dim=-1), dist.ReduceOp.SUM, tp_group)
        owned = (targets >= start) & (targets < stop)
        local_index = torch.where(owned, targets - start, 0)
        picked = scaled.gather(-1, local_index.unsqueeze(-1)).squeeze(-1)
        target_logit = _all_reduce(torch.where(owned, picked, 0.0), dist.ReduceOp.SUM, tp_group)
        logprob = target_logit - global_max - torch.log(sum_exp)
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_index, owned)
        ctx.temperature = temperature
        ctx.logits_dtype = logits.dtype
        return logprob

    @staticmethod
    def backward(ctx: Any, grad_logprob: Tensor) -> tuple[Tensor | None, ...]:
        softmax, local_index, owned = ctx.saved_tensors
        grad = softmax.neg_()
        grad.scatter_add_(-1, local_index.unsqueeze(-1), owned.to(grad.dtype).unsqueeze(-1))
        grad.mul_((grad_logprob / ctx.temperature).unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None, None, None


def _all_reduce(tensor: Tensor, op: dist.ReduceOp, group: dist.ProcessGroup | None) -> Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


def logprobs_from_logits(
    logits: Tensor, targets: Tensor, *, temperature: float, vocab_size: int, tp_group: dist.ProcessGroup | None
) -> Tensor:
    """The "unfused" path: logits [B, L, V/tp] (this TP rank's shard), targets [B, L] → [B, L] float32."""
    batch, length, n_local = logits.shape
    flat = VocabParallelLogprob.apply(
        logits.reshape(batch * length, n_local), targets.reshape(-1), float(temperature), vocab_size, tp_group
    )
    return flat.view(batch, length)


def logprobs_from_hidden(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    temperature: float,
    vocab_size: int,
    tp_group: dist.ProcessGroup | None,
) -> Tensor:
    """The "fused" path: hidden [B, L, H] after the final norm, weight [V/tp, H] → [B, L] float32.

    The kernel all-reduces d hidden over TP in backward, the job Megatron's
    ``copy_to_tensor_model_parallel_region`` does in front of the bypassed output layer.
    """
    from megatron_mugrpo.kernels import fused_linear_logprobs

    batch, length, width = hidden.shape
    start, _ = vocab_range(weight.shape[0], tp_group)
    flat = fused_linear_logprobs(
        hidden.reshape(batch * length, width),
        weight,
        targets.reshape(-1),
        temperature=float(temperature),
        vocab_start=start,
        vocab_size=vocab_size,
        tp_group=tp_group,
    )
    return flat.view(batch, length)


class OutputWeight:
    """Receives the output-layer weight that ``GPTModel`` passes (tied) or owns (untied)."""

    def __init__(self) -> None:
        self.weight: Tensor | None = None


@contextlib.contextmanager
def hidden_states_instead_of_logits(model: GPTModel) -> Iterator[OutputWeight]:
    """Within the context, ``model(...)`` returns final hidden states [B, L, H] instead of logits.

    The last stage's output layer is replaced (on this instance only, parameters untouched, so
    state dicts and checkpoints are unaffected) by a pass-through that records the weight it would
    have multiplied with; the yielded ``OutputWeight`` holds it after the forward. On stages
    without an output layer the context does nothing.
    """
    layer = getattr(model, "output_layer", None) if model.post_process else None
    holder = OutputWeight()
    if layer is None:
        yield holder
        return

    def passthrough(self: Any, hidden: Tensor, weight: Tensor | None = None, **_kwargs: Any) -> tuple[Tensor, None]:
        holder.weight = self.weight if weight is None else weight
        return hidden, None

    layer.forward = types.MethodType(passthrough, layer)
    try:
        yield holder
    finally:
        del layer.forward  # back to the class's forward


def check_impl(impl: str) -> None:
    if impl not in LOGPROB_IMPLS:
        raise ValueError(f"logprob impl={impl!r} is not one of {LOGPROB_IMPLS} (config: kernels.logprob_impl)")
