"""Shared pieces of the training tests: a tiny model config, synthetic batches, TP gathering."""

from __future__ import annotations

import random
from typing import Any

import torch
import torch.distributed as dist

from megatron_mugrpo.algorithms.config import AlgoConfig
from megatron_mugrpo.records import RolloutGroup, RolloutSample, TrainBatch, collate
from megatron_mugrpo.training.model import tiny_hf_config
from megatron_mugrpo.training.train_step import train_step

VOCAB = 100
"""True vocabulary: deliberately not a multiple of 128·tp, so every shard layout has padding rows."""


def hf_config(arch: str = "qwen2", **overrides: Any) -> dict[str, Any]:
    """Tiny config: hidden 32, 2 layers, 4 heads / 2 KV heads, vocab 100."""
    base = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2}
    return tiny_hf_config(arch, **{**base, **overrides})


def make_batch(seed: int, groups: int = 2, group_size: int = 4, *, zero_advantage: bool = False) -> TrainBatch:
    """Random prompt groups with varied prompt / response lengths, behaviour log-probs near -log V."""
    rng = random.Random(seed)
    records = []
    for g in range(groups):
        prompt = [rng.randrange(3, VOCAB) for _ in range(rng.randint(2, 5))]
        samples = []
        for _ in range(group_size):
            length = rng.randint(1, 7)
            samples.append(
                RolloutSample(
                    response_ids=[rng.randrange(3, VOCAB) for _ in range(length)],
                    behaviour_logprobs=[-4.6 + rng.uniform(-0.5, 0.5) for _ in range(length)],
                    finish_reason="stop",
                    advantage=0.0 if zero_advantage else rng.uniform(-1.5, 1.5),
                )
            )
        records.append(RolloutGroup(prompt_id=str(g), prompt_ids=prompt, answer="", samples=samples))
    return collate(records, pad_id=0)


def gather_tp(
    param: torch.nn.Parameter, tensor: torch.Tensor, name: str, tp_group: dist.ProcessGroup, tp: int
) -> torch.Tensor:
    """The full (TP=1 layout) version of ``tensor`` (the parameter or its gradient), sharded like ``param``."""
    if tp == 1 or not getattr(param, "tensor_model_parallel", False):
        return tensor.detach().clone()
    dim = param.partition_dim
    shards = [torch.empty_like(tensor) for _ in range(tp)]
    dist.all_gather(shards, tensor.detach().contiguous(), group=tp_group)
    if name.endswith("linear_fc1.weight"):  # SwiGLU: each rank holds [gate_shard; up_shard]
        gates = [s.chunk(2, dim=0)[0] for s in shards]
        ups = [s.chunk(2, dim=0)[1] for s in shards]
        return torch.cat(gates + ups, dim=0)
    return torch.cat(shards, dim=dim)


def mu_grpo_step(policy: Any, batch: TrainBatch, micro_batch_size: int, **options: Any) -> dict[str, float]:
    """One update with μ-GRPO's default loss options at temperature 1: the equivalence tests' update."""
    return train_step(
        policy,
        batch,
        loss_name="mu_grpo",
        loss_options=AlgoConfig().loss_options(),
        temperature=1.0,
        micro_batch_size=micro_batch_size,
        **options,
    )


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest |a - b| over same-named tensors; rows past the shorter one are vocabulary padding, which
    grows with TP, and are left out."""
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    worst = 0.0
    for name in a:
        rows = min(a[name].shape[0], b[name].shape[0])
        worst = max(worst, float((a[name][:rows] - b[name][:rows]).abs().max()))
    return worst
