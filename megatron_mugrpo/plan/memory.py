"""Bytes one GPU holds, role by role: pure arithmetic on a model shape and a layout.

Trainer (per rank, megatron-core DDP with ``grad_reduce_in_fp32`` as ``training.setup`` builds it):

- **weights**: the parameters in ``model.dtype``; with the distributed optimizer they live in DDP's
  contiguous buffer, padded as megatron-core pads it (each parameter starts on a multiple of 64
  elements, each bucket ends on a multiple of lcm(DP, 128));
- **gradients**: the fp32 main-gradient buffer of the same layout;
- **optimizer state**: Adam's two fp32 moments, plus fp32 main weights when the model is bf16/fp16;
  with the distributed optimizer only this rank's 1/DP slice of each bucket (experts at EP > 1 are
  sliced over the expert-data-parallel ranks instead);
- **activations** saved for backward per micro-batch, times the micro-batches a pipeline stage holds
  in flight under 1F1B; **logits** of the log-prob; **routing replay**: the replayed expert ids.

Rollout engine (SGLang): weights, and the KV cache SGLang sizes at start as
``mem_fraction_static × GPU memory − what is already allocated`` (its ``profile_max_num_token``),
which sets the largest number of concurrent sequences; in async memory publication a worker also
stages up to two publications (the one staged and the one arriving, ``asynchronous.publish.Staging``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_mugrpo.plan.models import ModelShape, RankLayout, Tensor, padded_vocab, rank_tensors

PARAM_ALIGN = 64
"""megatron-core's distributed optimizer starts every parameter on a multiple of 64 elements."""
BUCKET_ALIGN = 128
"""... and ends every bucket on a multiple of lcm(DP, 128) elements, so DP ranks get equal slices."""
FP32 = 4
ADAM_MOMENTS = 2
"""exp_avg and exp_avg_sq, fp32 each (the scalar step counters are not counted)."""
ROUTE_BYTES = 8
"""The trainer's replayed routes are int64 [moe_layers, tokens, k] (``training.routing_replay``)."""
LOGITS_COPIES_UNFUSED = 3
"""The materialised log-prob path holds about three float32 [tokens, V/tp] buffers (``kernels.config``)."""
SGLANG_RUNTIME_BYTES = 3 * 2**30
"""What SGLang needs outside its static pool (activations of a decode batch, CUDA-graph buffers, sampling):
an assumption; SGLang's docs only say the rest of the memory after mem_fraction_static is for these."""
FUSED_BLOCK_BYTES = 32 * 2**20
"""The fused log-prob's working block (``kernels.autograd.DEFAULT_BLOCK_BYTES``), float32."""


@dataclass(frozen=True, kw_only=True)
class BufferShard:
    """One DDP buffer as this rank sees it."""

    numel: int
    """Elements of the buffer, padding included (what weights and gradients allocate)."""
    params: int
    """Elements that are parameters (numel less the padding)."""
    shard: int
    """Parameter elements in this rank's optimizer slice (all of them without the distributed optimizer)."""


def ddp_buffer(tensors: list[Tensor], *, dp: int, dp_rank: int, distributed: bool) -> BufferShard:
    """megatron-core's ``_ParamAndGradBuffer`` with one bucket per buffer (``overlap_grad_reduce`` off),
    tensors taken in reverse order; a split tied embedding gets a bucket of its own."""
    if not tensors:
        return BufferShard(numel=0, params=0, shard=0)
    pad = (lambda n, d: math.ceil(n / d) * d) if distributed else (lambda n, d: n)
    end_align = math.lcm(dp, BUCKET_ALIGN)
    buckets: list[tuple[int, int]] = []
    ranges: list[tuple[int, int, int]] = []
    start = bucket_start = 0
    count = 0
    for tensor in reversed(tensors):
        start = pad(start, PARAM_ALIGN)
        own = tensor.shared_embedding and distributed
        if own and count:
            start = pad(start, end_align)
            buckets.append((bucket_start, start))
            bucket_start, count = start, 0
        ranges.append((start, start + tensor.numel, len(buckets)))
        start += tensor.numel
        count += 1
        if own:
            start = pad(start, end_align)
            buckets.append((bucket_start, start))
            bucket_start, count = start, 0
    if count:
        start = pad(start, end_align)
        buckets.append((bucket_start, start))
    params = sum(t.numel for t in tensors)
    if not distributed:
        return BufferShard(numel=params, params=params, shard=params)
    shard = 0
    for lo, hi, bucket in ranges:
        b_lo, b_hi = buckets[bucket]
        size = (b_hi - b_lo) // dp
        s_lo = b_lo + dp_rank * size
        shard += max(0, min(hi, s_lo + size) - max(lo, s_lo))
    return BufferShard(numel=start, params=params, shard=shard)


@dataclass(frozen=True, kw_only=True)
class TrainerLayout:
    """The trainer's parallel layout and this rank's place in it."""

    model: RankLayout
    dp: int
    """Data-parallel ranks of the dense parameters: trainer ranks / (TP × PP)."""
    edp: int
    """Expert-data-parallel ranks: trainer ranks / (PP × ETP × EP)."""
    distributed_optimizer: bool


@dataclass(frozen=True, kw_only=True)
class StaticBytes:
    """Weights, gradients and optimizer state of one trainer rank, bytes."""

    weights: int
    grads: int
    optimizer: int
    params: int
    """Parameters this rank holds (no padding)."""

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.optimizer


def static_bytes(
    shape: ModelShape, layout: TrainerLayout, *, dtype_bytes: int, pp_rank: int, dp_rank: int = 0, edp_rank: int = 0
) -> StaticBytes:
    """Weights, fp32 gradients and Adam state of the rank at (pp_rank, dp_rank, edp_rank)."""
    tensors = rank_tensors(shape, layout.model, pp_rank)
    distributed = layout.distributed_optimizer
    dense = ddp_buffer([t for t in tensors if not t.expert], dp=layout.dp, dp_rank=dp_rank, distributed=distributed)
    experts = ddp_buffer([t for t in tensors if t.expert], dp=layout.edp, dp_rank=edp_rank, distributed=distributed)
    main_copy = 0 if dtype_bytes == FP32 else FP32  # an fp32 model is its own main copy
    weights = (dense.numel + experts.numel) if distributed else dense.params + experts.params
    per_state = ADAM_MOMENTS * FP32 + main_copy
    return StaticBytes(
        weights=weights * dtype_bytes,
        grads=(dense.numel + experts.numel) * FP32,
        optimizer=(dense.shard + experts.shard) * per_state,
        params=dense.params + experts.params,
    )


@dataclass(frozen=True, kw_only=True)
class ActivationInputs:
    """What sizes one micro-batch's saved activations."""

    tokens: int
    """Tokens of a micro-batch (rows × padded length, or the token budget)."""
    seq_len: int
    """Longest row (the local spec's SDPA attention keeps no [S, S] scores; kept for the record and callers)."""
    dtype_bytes: int
    sequence_parallel: bool
    fused_kernels: bool
    """The GPU layer spec (Transformer Engine): fused RMSNorm and SwiGLU keep only their inputs. False:
    megatron-core's local spec in torch ops (CPU), which also keeps each norm's normalised input and the
    SwiGLU's gate activation. Neither keeps [S, S] attention scores (the local spec's attention is one
    SDPA call, ``training.sdpa_attention``)."""
    in_flight: int
    """Micro-batches whose activations a stage holds at once (1F1B: min(PP, micro-batches))."""


def layer_activation_elements(shape: ModelShape, layout: RankLayout, sparse: bool, inputs: ActivationInputs) -> float:
    """Elements one layer saves for backward per token (Korthikanti et al. 2022, for GQA and SwiGLU).

    Norm inputs and the linear layers' inputs are split over TP only with sequence parallelism; the
    QKV, attention output and MLP intermediates are split over TP; experts see each token top-k times.
    Without fused kernels (``ActivationInputs.fused_kernels``) the attention (one SDPA call) also keeps
    the whole fused QKV output, of which its value input is a view (q + kv more than v alone), and a
    log-sum-exp per head; every RMSNorm its normalised input, and every SwiGLU its gate activation (one
    more MLP width).
    """
    tp, fused = layout.tp, inputs.fused_kernels
    sp = tp if inputs.sequence_parallel else 1
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    norms = 1 if fused else 2  # elements per normalised element: input (+ normalised input, unfused)
    glu = 3 if fused else 4  # fc1 out (gate and up) and the product (+ the gate's activation, unfused)
    elements = (norms + 1) * shape.hidden / sp + (2 * q + 2 * kv) / tp  # norm, QKV in; q, k, v, context
    if not fused:
        elements += (q + kv + shape.heads) / tp  # v's storage: the QKV output; SDPA's log-sum-exp [b, heads, s]
        elements += (q + kv) / tp if shape.qk_norm else 0  # q / k norms' normalised inputs
    elements += (norms + 1) * shape.hidden / sp  # the MLP's norm and its first linear's input
    if not sparse:
        return elements + glu * shape.ffn / tp
    width = shape.expert_ffn / layout.etp
    routed = shape.topk * (2 * shape.hidden + glu * width)  # permuted in, SwiGLU, expert out
    return elements + shape.experts + routed + (glu * shape.shared_ffn / tp if shape.shared_ffn else 0)


def activation_bytes(shape: ModelShape, layout: RankLayout, inputs: ActivationInputs, pp_rank: int = 0) -> int:
    """Activations a pipeline stage holds at its peak: per micro-batch × micro-batches in flight."""
    per_stage = shape.layers // layout.pp
    sparse = shape.sparse or (False,) * shape.layers
    layers = range(pp_rank * per_stage, (pp_rank + 1) * per_stage)
    per_token = sum(layer_activation_elements(shape, layout, sparse[i], inputs) for i in layers)
    return int(per_token * inputs.tokens * inputs.dtype_bytes * inputs.in_flight)


def logits_bytes(shape: ModelShape, tp: int, tokens: int, *, fused: bool, budget_bytes: int) -> int:
    """Log-prob working memory of the last stage per micro-batch: float32 logits [tokens, V/tp].

    Fused: the blocks kept for backward up to ``kernels.logits_budget_mib`` plus one working block;
    unfused: about three whole float32 logits buffers.
    """
    whole = tokens * padded_vocab(shape.vocab_size, tp) // tp * FP32
    if not fused:
        return LOGITS_COPIES_UNFUSED * whole
    return min(whole, budget_bytes) + min(whole, FUSED_BLOCK_BYTES)


def routing_replay_bytes(shape: ModelShape, pp: int, tokens: int, in_flight: int) -> int:
    """The replayed expert ids a stage holds: int64 [sparse layers of the stage, tokens, k] per micro-batch."""
    sparse_layers = math.ceil(sum(shape.sparse) / pp)
    return sparse_layers * tokens * shape.topk * ROUTE_BYTES * in_flight


def route_store_bytes_per_token(shape: ModelShape) -> int:
    """Bytes of routes one generated token adds to D_k (one byte per expert id up to 256 experts)."""
    return sum(shape.sparse) * shape.topk * (1 if shape.experts <= 256 else 2)


@dataclass(frozen=True, kw_only=True)
class EngineBytes:
    """One rollout engine GPU."""

    weights: int
    kv_cache: int
    """SGLang's KV pool (negative: nothing is left for it)."""
    staging: int
    """Async memory publication: the staged and the arriving publication (0 otherwise)."""
    kv_per_sequence: int
    """KV bytes of one sequence at the configured prompt + response length."""
    max_sequences: int
    """Sequences at full length that the KV pool holds at once."""
    outside_pool: int
    """Memory outside SGLang's static pool left for staging, after SGLang's own runtime needs."""


def engine_bytes(
    shape: ModelShape,
    *,
    engine_tp: int,
    gpu_bytes: int,
    usable_bytes: int,
    mem_fraction: float,
    weight_bytes_per_param: float,
    resident: int,
    context: int,
    staging: int,
) -> EngineBytes:
    """SGLang on one GPU of an engine of ``engine_tp`` GPUs, with ``resident`` bytes already allocated there
    (a colocated trainer's weights, gradients and optimizer state)."""
    weights = int(shape.total_params() * weight_bytes_per_param / engine_tp)
    kv_heads = max(1, shape.kv_heads // engine_tp)  # KV heads are replicated when TP exceeds them
    per_token = 2 * shape.layers * kv_heads * shape.head_dim * 2
    kv = int(mem_fraction * gpu_bytes) - (gpu_bytes - usable_bytes) - resident - weights
    per_sequence = per_token * context
    return EngineBytes(
        weights=weights,
        kv_cache=kv,
        staging=staging,
        kv_per_sequence=per_sequence,
        max_sequences=max(0, kv // per_sequence),
        outside_pool=gpu_bytes - int(mem_fraction * gpu_bytes) - SGLANG_RUNTIME_BYTES,
    )
