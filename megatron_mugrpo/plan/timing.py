"""How long a run takes, from FLOPs and bytes: a roofline for rollouts, an assumed MFU for updates.

Rollout (one engine of ``tp`` GPUs, ``batch`` sequences decoding together at mean context ``c``): a decode
step reads the weights once (of a MoE, the experts some token of the batch picks) and every sequence's
KV cache, and computes 2 × active parameters + attention FLOPs per sequence; it takes the longer of
bytes / HBM bandwidth and FLOPs / peak. Tokens/s = batch / step time. Prefill is compute-bound. A
measured engine rate (``--rollout-tokens-per-s``) replaces the roofline.

Optimizer phase: 6 × active parameters per trained token (forward + backward) plus causal attention
(6 × 2 × layers × heads × head_dim × S / 2 per token), at ``mfu`` of the trainer GPUs' peak.

Async mode: workers produce groups at rate R, the trainer consumes B_mini per update; when R falls
short the trainer waits (idle = 1 − R / C); publication blocks it while it sends. Lag (updates between
the policy that sampled a group and the one that trains on it): half the sync interval, plus the
groups queued ahead of it, plus the updates that pass while its batch is generated; capped by max_lag.

    rate = decode_tokens_per_s(shape, gpu, tp=1, batch=256, context=2048, weight_bytes=2)
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_mugrpo.plan.gpus import GpuSpec
from megatron_mugrpo.plan.models import ModelShape

PREFILL_MFU = 0.5
"""Fraction of peak a prefill reaches (large compute-bound GEMMs)."""
SYNC_BYTES_PER_S = 5.7e9
"""Staged mode's in-memory weight sync (export + engine load), measured (docs: 5.7 GB/s)."""
PUBLISH_BYTES_PER_S = 10e9
"""Async memory publication (bucketed NCCL broadcast from one rank): an assumption, 10 GB/s."""


def attention_flops_per_token(shape: ModelShape, context: float) -> float:
    """Forward FLOPs of attention scores and values for one token attending to ``context`` tokens."""
    return 4.0 * shape.layers * shape.heads * shape.head_dim * context


def expert_weight_bytes(shape: ModelShape, weight_bytes: float) -> float:
    """Bytes of the routed experts (all layers), the part of a MoE's weights a small batch reads sparsely."""
    return sum(shape.sparse) * shape.experts * 3 * shape.expert_ffn * shape.hidden * weight_bytes


def decode_step_s(
    shape: ModelShape, gpu: GpuSpec, *, tp: int, batch: int, context: float, weight_bytes: float, fp8: bool = False
) -> float:
    """Seconds of one decode step of ``batch`` sequences at mean context ``context`` on ``tp`` GPUs."""
    experts = expert_weight_bytes(shape, weight_bytes)
    touched = 1.0 - (1.0 - shape.topk / shape.experts) ** batch if shape.experts else 0.0
    weights = shape.total_params() * weight_bytes - experts + experts * touched
    kv = batch * context * shape.kv_bytes_per_token()
    flops = batch * (2.0 * shape.active_params() + attention_flops_per_token(shape, context))
    peak = gpu.fp8_flops if fp8 and gpu.fp8_flops else gpu.bf16_flops
    return max((weights + kv) / (tp * gpu.hbm_bytes_per_s), flops / (tp * peak))


def prefill_s(shape: ModelShape, gpu: GpuSpec, *, tp: int, tokens: float, prompt: float) -> float:
    flops = tokens * (2.0 * shape.active_params() + attention_flops_per_token(shape, prompt / 2))
    return flops / (tp * gpu.bf16_flops * PREFILL_MFU)


@dataclass(frozen=True, kw_only=True)
class RolloutTime:
    seconds: float
    tokens: float
    """Response tokens generated per stage."""
    tokens_per_s_per_engine: float
    concurrency: int
    """Sequences each engine decodes at once (its KV pool's limit, or its share of the stage)."""


def rollout_time(
    shape: ModelShape,
    gpu: GpuSpec,
    *,
    sequences: int,
    engines: int,
    tp: int,
    max_concurrent: int,
    prompt: int,
    response: float,
    weight_bytes: float,
    measured_tokens_per_s: float | None = None,
) -> RolloutTime:
    """Time to generate ``sequences`` responses of mean length ``response`` on ``engines`` engines."""
    per_engine = -(-sequences // engines)
    batch = max(1, min(max_concurrent, per_engine))
    context = prompt + response / 2
    if measured_tokens_per_s:
        rate = measured_tokens_per_s
    else:
        rate = batch / decode_step_s(shape, gpu, tp=tp, batch=batch, context=context, weight_bytes=weight_bytes)
    tokens = sequences * response
    seconds = per_engine * response / rate + prefill_s(shape, gpu, tp=tp, tokens=per_engine * prompt, prompt=prompt)
    return RolloutTime(seconds=seconds, tokens=tokens, tokens_per_s_per_engine=rate, concurrency=batch)


def update_flops(shape: ModelShape, *, sequences: int, seq_tokens: float) -> float:
    """Forward + backward FLOPs of one update over ``sequences`` rows of ``seq_tokens`` tokens each."""
    tokens = sequences * seq_tokens
    return tokens * (6.0 * shape.active_params() + 3.0 * attention_flops_per_token(shape, seq_tokens / 2))


def update_s(flops: float, gpu: GpuSpec, *, gpus: int, mfu: float, fp8: bool) -> float:
    peak = gpu.fp8_flops if fp8 and gpu.fp8_flops else gpu.bf16_flops
    return flops / (gpus * peak * mfu)


@dataclass(frozen=True, kw_only=True)
class AsyncBalance:
    idle_fraction: float
    """Share of the trainer's wall-clock spent waiting for groups or publishing weights."""
    mean_lag: float
    """Mean updates between the policy that sampled a group and the update that trains on it."""
    produce_groups_per_s: float
    consume_groups_per_s: float


def async_balance(
    *,
    produce_groups_per_s: float,
    update_s: float,
    mini_groups: int,
    sync_every: int,
    publish_s: float,
    queue_groups: int,
    batch_groups: int,
    workers: int,
    max_lag: int,
) -> AsyncBalance:
    """Idle fraction and mean lag of the trainer in steady state."""
    consume = mini_groups / update_s
    waiting = max(0.0, 1.0 - produce_groups_per_s / consume)  # per update, the share spent waiting for groups
    step = update_s / (1.0 - waiting) if waiting < 1.0 else float("inf")
    publishing = publish_s / (sync_every * step + publish_s)
    idle = 1.0 - (1.0 - waiting) * (1.0 - publishing)
    queued = queue_groups if produce_groups_per_s >= consume else 0  # a faster producer keeps the queue full
    # updates that pass while one worker generates its batch (each worker makes 1/workers of the rate)
    generating = batch_groups * workers / produce_groups_per_s / step
    lag = (sync_every - 1) / 2 + queued / mini_groups + generating
    return AsyncBalance(
        idle_fraction=idle,
        mean_lag=min(float(max_lag), lag),
        produce_groups_per_s=produce_groups_per_s,
        consume_groups_per_s=consume,
    )
