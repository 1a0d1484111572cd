"""Which prompts each batch of each rollout worker samples: sizes ramp up, every prompt is sampled once.

A worker's batch b has ``batch_size(cfg, b)`` groups: ``async.first_batch_groups`` doubling up to
``async.batch_groups`` (constant without a ramp). Batch b of all R workers together covers the
R · n_b prompts of the seeded prompt stream after every earlier batch; worker w takes the w-th n_b of
them. So each stream position belongs to one fixed (worker, batch), whichever process makes it,
also when a worker restarts after a crash. Without a ramp, worker w's batch b is slice b · R + w of
``batch_groups`` prompts.

    prompt_range(cfg.async_, batch=3, worker=1)   # range(start, start + n_3)

``lag_pause`` decides whether a worker waits before a batch whose groups would be dropped for their
lag when the trainer reaches them (generating them would only waste the engine's time).

    lag_pause(cfg.async_, groups=64, unconsumed=120, trainer_update=40, version=36, mini_groups=32)
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


def consumed_by(*, trainer_update: int, ahead: int, mini_groups: int) -> int:
    """Updates the trainer will have made when it reaches a group with ``ahead`` unconsumed groups in
    front of it in the queue: the ``update`` that group's lag is measured at (``rollout.queue.group_lag``).

    An estimate: groups the trainer already took for the update it is assembling (consumed, not yet
    trained on) make it up to one update later (a drop the pause missed, counted as a drop), drops
    among the groups ahead make it earlier (a pause that was not needed).
    """
    return trainer_update + ahead // mini_groups


def lag_pause(
    cfg: AsyncConfig, *, groups: int, unconsumed: int, trainer_update: int, version: int, mini_groups: int
) -> bool:
    """Whether a worker should wait before generating a batch of ``groups`` groups with the policy of
    ``version`` (trainer updates behind it) because its last group would be dropped as more than
    ``async.max_lag`` updates old when the trainer reaches it.

    ``unconsumed`` groups are in the queue before it and the trainer has made ``trainer_update``
    updates (its cursor file says both). Never with an empty queue: the trainer then waits for groups,
    and a batch too large for ``max_lag`` even at the front of the queue is better made and partly
    dropped (counted) than never made. A pause ends when the trainer has consumed enough or published
        newer weights, and the trainer needs nothing from this worker to do either (it waits for groups
    only once it has consumed every admitted one), so a pause cannot deadlock the run.
    """
    if unconsumed <= 0:
        return False
    last = consumed_by(trainer_update=trainer_update, ahead=unconsumed + groups - 1, mini_groups=mini_groups)
    return last - version > cfg.max_lag
