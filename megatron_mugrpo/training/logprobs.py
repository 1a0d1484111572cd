"""Per-token log-probs of given tokens under the trained policy, vocab-parallel across TP.

    logprob[b, t] = log_softmax(logits[b, t] / T)[targets[b, t]]     over the TRUE vocabulary

T is the rollout temperature, so the trainer scores exactly the distribution the behaviour policy
sampled from (docs/method.md: anything else biases the importance ratio). Each TP rank holds vocabulary
rows ``[vocab_start, vocab_start + V_pad/tp)``; Megatron's padding rows (ids >= the true vocab size,
absent from Hugging Face and the rollout engine) are excluded from the softmax. Full-vocabulary
logits are never gathered: max and sum-exp are all-reduced over the TP group.

Two implementations behind one switch (``impl``):

* ``"unfused"``: the model's output layer materialises logits [B, L, V/tp] and
  ``megatron_mugrpo.kernels.vocab_parallel_logprobs`` turns them into log-probs.
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

import torch.distributed as dist
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
from torch import Tensor

from megatron_mugrpo.kernels.config import LOGPROB_IMPLS


def vocab_range(n_local: int, tp_group: dist.ProcessGroup | None) -> tuple[int, int]:
    """Global ids [start, stop) of this TP rank's vocabulary shard of ``n_local`` rows."""
    rank = dist.get_rank(tp_group) if tp_group is not None and dist.get_world_size(tp_group) > 1 else 0
    return rank * n_local, (rank + 1) * n_local


def logprobs_from_logits(
    logits: Tensor, targets: Tensor, *, temperature: float, vocab_size: int, tp_group: dist.ProcessGroup | None
) -> Tensor:
    """The "unfused" path: logits [B, L, V/tp] (this TP rank's shard), targets [B, L] → [B, L] float32.

    The logits are materialised by the output layer; ``kernels.vocab_parallel_logprobs`` reduces them
    (the same TP statistics and padded-row exclusion as the fused path, minus the fused matmul).
    """
    from megatron_mugrpo.kernels import vocab_parallel_logprobs

    batch, length, n_local = logits.shape
    start, _ = vocab_range(n_local, tp_group)
    flat = vocab_parallel_logprobs(
        logits.reshape(batch * length, n_local),
        targets.reshape(-1),
        temperature=float(temperature),
        vocab_start=start,
        vocab_size=vocab_size,
        tp_group=tp_group,
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
        if getattr(self, "sequence_parallel", False):
            # Sequence parallelism hands the output layer [s/tp, b, h]; the log-prob needs every position.
            # The kernel all-reduces d hidden over TP itself, so the gather's backward only keeps this
            # rank's slice (tensor_parallel_output_grad=False) instead of reduce-scattering a second time.
            hidden = gather_from_sequence_parallel_region(
                hidden, tensor_parallel_output_grad=False, group=self.tp_group
            )
        return hidden, None

    layer.forward = types.MethodType(passthrough, layer)
    try:
        yield holder
    finally:
        del layer.forward  # back to the class's forward


def check_impl(impl: str) -> None:
    if impl not in LOGPROB_IMPLS:
        raise ValueError(f"logprob impl={impl!r} is not one of {LOGPROB_IMPLS} (config: kernels.logprob_impl)")
