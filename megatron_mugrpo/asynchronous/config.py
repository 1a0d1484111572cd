"""The ``async`` section of a run config (``mode: async``): placement, queue bound, lag and weight sync.

The YAML and command-line key is ``async`` (``async.max_lag=8``); ``async`` is a Python keyword, so the
``RunConfig`` field is ``async_`` and ``megatron_mugrpo.config`` translates the spelling both ways.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_mugrpo.errors import require
from megatron_mugrpo.rollout.engine import KV_MODES, interruptible

PUBLISH_MODES = ("memory", "disk")


@dataclass(kw_only=True)
class AsyncConfig:
    """Asynchronous execution: rollout workers stream groups to the trainer through a bounded queue."""

    rollout_ranks: int = 1
    """R: the last R ranks of the launch are rollout workers (one engine each); the others train."""
    queue_groups: int = 256
    """Bound of the rollout queue: workers pause while this many generated groups are unconsumed."""
    max_lag: int = 4
    """Groups whose behaviour policy is more than this many trainer updates old are dropped (counted in
    rollout/dropped_groups). Equal to sync_every: no staleness beyond the sync interval (async GRPO)."""
    sync_every: int = 4
    """The trainer publishes its weights every this many updates (the paper: 4); workers pick them up
    between generation batches (with partial_rollout also between two decode steps)."""
    batch_groups: int = 64
    """Prompt groups a worker generates per batch (one queue shard); weights never change within one
    unless partial_rollout."""
    first_batch_groups: int | None = None
    """Size of a worker's first batch; each next one is twice as large, up to batch_groups. The trainer
    then starts as soon as a small batch is ready instead of waiting for a full one (large batches
    sample faster per group, so they are worth it once the queue has a lead). None, or a value of at
    least batch_groups: every batch has batch_groups groups."""
    worker_timeout_s: float = 300.0
    """A trainer or worker whose heartbeat has not changed for this long is dead: the run stops with
    an error naming it."""
    progress_timeout_s: float | None = 1800.0
    """A trainer or worker whose heartbeat goes on while its main loop makes no progress for this long
    hangs: the run stops with an error naming it and what it was doing. Progress is every response
    generated, batch written and update made, and every look at the other side while waiting; so this
    must exceed the longest step without any: one engine call of a worker (a whole batch with SGLang,
    up to 4096 rows), the trainer's setup, one evaluation, checkpoint or publication. null: off."""
    startup_timeout_s: float = 900.0
    """How long a rank waits for the other side's first heartbeat (ranks on other nodes may start
    later; a trainer loads its model before it watches the workers)."""
    publish: str = "memory"
    """How weights reach the workers. memory: broadcast in buckets over a process group of the trainer's
    writer rank and the workers (gloo on CPU, NCCL on GPU; ``asynchronous.transport``), received while
    the workers generate and applied between batches. disk: a Hugging Face directory in the run
    directory that each worker reads (for workers without a network path to the trainer, and the
    reference). Either way the first publication of a launch is a directory: a worker builds its
    engine, tokenizer and prompts from it."""
    bucket_mib: float = 256.0
    """Bytes per broadcast in memory publication (MiB): the trainer's only buffer. Larger buckets mean
    fewer round trips; a tensor larger than a bucket goes alone. An SGLang worker stages publications in
    pinned host memory (two model copies at most), and over NCCL one bucket lands on its GPU outside
    rollout.sglang.mem_fraction_static: leave that much room (``transport.staging_place``)."""
    publish_timeout_s: float = 600.0
    """A memory publication (workers joining the group included) that takes longer stops the run with an
    error naming the worker that fell behind."""
    verify_weights: bool = False
    """Workers hash the weights they loaded and the trainer checks the hash against the publication's
    (costs one pass over all weights per sync; the tests switch it on)."""
    partial_rollout: bool = False
    """Interruptible generation: a worker applies a staged publication between two decode steps and
    continues the same sequences under it, instead of only between batches. Every token then records
    the version that sampled it (its behaviour log-prob is that policy's), lag is measured per token
    (rollout/token_lag_mean, rollout/token_lag_max) and max_lag applies to a group's oldest token.
    Needs async.publish=memory and rollout.engine=transformers. Off by default: it makes tokens fresher
    (lower token lag) at the cost of a KV-cache recompute per switch, but the trainer never waits for a
    worker's in-flight sequences here (publications are staged while workers generate), so it is not
    expected to make the trainer less idle; benchmarks/partial_rollout.py measures both."""
    partial_kv: str = "recompute"
    """With partial_rollout, what happens to an in-flight sequence's KV cache at a switch. recompute: one
    prefill forward under the new weights, so every later token is sampled from exactly the new policy
    (its log-prob equals the trainer's at that version). keep: no extra forward, but the tokens after
    the switch come from the new weights attending to the old weights' keys and values, a policy the
    trainer never computes: their ratio at the first update is off by that gap."""

    def __post_init__(self) -> None:
        for name in ("rollout_ranks", "queue_groups", "sync_every", "batch_groups"):
            require(getattr(self, name) >= 1, f"async.{name}={getattr(self, name)} must be >= 1")
        require(
            self.max_lag >= self.sync_every,
            f"async.max_lag={self.max_lag} < async.sync_every={self.sync_every}: a worker samples with each "
            "published policy until the next publication sync_every updates later, so the groups it makes late "
            "in every interval would be dropped as too old. Set async.max_lag >= async.sync_every (equal: no "
            "staleness beyond the sync interval, as async GRPO)",
        )
        require(
            self.publish in PUBLISH_MODES,
            f"async.publish={self.publish!r} is not one of {PUBLISH_MODES} (memory: broadcast to the workers; "
            "disk: a directory in the run directory)",
        )
        for name in ("worker_timeout_s", "startup_timeout_s", "bucket_mib", "publish_timeout_s"):
            require(getattr(self, name) > 0, f"async.{name}={getattr(self, name)} must be > 0")
        require(
            self.progress_timeout_s is None or self.progress_timeout_s > 0,
            f"async.progress_timeout_s={self.progress_timeout_s} must be > 0 (or null: no hang detection)",
        )
        require(
            self.partial_kv in KV_MODES,
            f"async.partial_kv={self.partial_kv!r} is not one of {KV_MODES} (recompute: rebuild an in-flight "
            "sequence's KV cache under new weights; keep: keep the old one)",
        )
        require(
            not self.partial_rollout or self.publish == "memory",
            "async.partial_rollout=true needs async.publish=memory (weights staged in memory are applied between "
            "two decode steps; a directory reload rebuilds the engine): set async.publish=memory or "
            "async.partial_rollout=false",
        )
        if self.first_batch_groups is not None:
            require(
                self.first_batch_groups >= 1,
                f"async.first_batch_groups={self.first_batch_groups} must be >= 1 (or null: every batch has "
                "batch_groups groups)",
            )


def partial_rollout_problem(cfg: AsyncConfig, engine: str) -> str:
    """Why ``async.partial_rollout`` cannot run with ``rollout.engine=engine`` ('' when it can)."""
    if not cfg.partial_rollout or interruptible(engine):
        return ""
    return (
        f"async.partial_rollout=true is not supported with rollout.engine={engine}: only an engine that applies "
        "weights between two decode steps can (transformers; SGLang's offline engine blocks in generate() and "
        "does not say which weights sampled each token). Set async.partial_rollout=false or "
        "rollout.engine=transformers"
    )


def partial_routes_problem(cfg: AsyncConfig, routing_replay: str) -> str:
    """Why ``async.partial_rollout`` with ``async.partial_kv=recompute`` cannot run under
    ``moe.routing_replay=rollout`` ('' when it can).

    At a switch the recompute routes the in-flight prefix afresh under the new weights, and every later
    token is sampled on top of those routes; the tokens before the switch were sampled on the old
    weights' routes. A response carries one route per position, so whichever is recorded, the replayed
    forward is exact for only one side of the switch (today the old routes are kept, so every token
    after a switch has an inexact ratio). No recording fixes that; the combination is refused.
    """
    if not (cfg.partial_rollout and cfg.partial_kv == "recompute" and routing_replay == "rollout"):
        return ""
    return (
        "async.partial_rollout=true with async.partial_kv=recompute cannot be combined with "
        "moe.routing_replay=rollout: the recompute at a weight switch routes the in-flight prefix again under the "
        "new weights, so the tokens after the switch were sampled on routes that differ from the ones recorded "
        "for the tokens before it, and one replayed route per position cannot reproduce both. Set "
        "moe.routing_replay=none or async.partial_rollout=false"
    )
