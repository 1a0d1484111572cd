"""Which prompts each batch of each rollout worker samples: sizes ramp up, every prompt is sampled once.

A worker's batch b has ``batch_size(cfg, b)`` groups: ``async.first_batch_groups`` doubling up to
``async.batch_groups`` (constant without a ramp). Batch b of all R workers together covers the
R · n_b prompts of the seeded prompt stream after every earlier batch; worker w takes the w-th n_b of
them. So each stream position belongs to one fixed (worker, batch), whichever process makes it,
also when a worker restarts after a crash. Without a ramp, worker w's batch b is slice b · R + w of
``batch_groups`` prompts.

    prompt_range(cfg.async_, batch=3, worker=1)   # range(start, start + n_3)
"""

from __future__ import annotations

from megatron_mugrpo.asynchronous.config import AsyncConfig


def batch_size(cfg: AsyncConfig, batch: int) -> int:
    """Groups in a worker's batch ``batch`` (0-based)."""
    first = cfg.first_batch_groups or cfg.batch_groups
    return min(cfg.batch_groups, first << min(batch, 62))


def groups_before(cfg: AsyncConfig, batch: int) -> int:
    """Groups one worker generates in its batches 0 .. batch - 1."""
    ramp, total = 0, 0
    while ramp < batch and batch_size(cfg, ramp) < cfg.batch_groups:
        total, ramp = total + batch_size(cfg, ramp), ramp + 1
    return total + (batch - ramp) * cfg.batch_groups


def prompt_range(cfg: AsyncConfig, batch: int, worker: int) -> range:
    """Positions in the seeded prompt stream of batch ``batch`` of worker ``worker`` (of ``rollout_ranks``)."""
    size = batch_size(cfg, batch)
    start = cfg.rollout_ranks * groups_before(cfg, batch) + worker * size
    return range(start, start + size)
