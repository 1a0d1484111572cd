"""Where the rollout engines live: engine groups, their host ranks, local GPUs and CPU cores.

Every rank belongs to one rollout engine group of ``rollout.tensor_parallel`` consecutive ranks.
The group's first rank, its host, runs one rollout engine; the other ranks of the group lend it
their GPUs (SGLang's ``tp_size`` workers run on the host's local GPU and the next ones) and wait
while it generates. With the default ``rollout.tensor_parallel = 1`` every rank hosts an engine, so
a node with 8 GPUs runs 8 engines and 4 such nodes run 32.

    world 8, rollout.tensor_parallel 2, 8 ranks per node:
        groups {0,1} {2,3} {4,5} {6,7}; hosts 0 2 4 6; host 2's SGLang engine: base_gpu_id 2, tp_size 2

Ranks are numbered node by node (torchrun's layout), so a group lies inside one node exactly when
its size divides the ranks per node; that is required, because SGLang's tensor parallelism stays
within a node here. On CPU, an engine's torch threads share the node's cores with the other hosts
on it: N engines on N cores must not oversubscribe them (spinning OpenMP threads multiply CPU time).

``EnginePlacement`` is pure arithmetic (plus ``from_env`` reading torchrun's variables), unit-tested
without any process group. ``HostGroup`` gives the hosts the package's object collectives
(``collectives.ObjectGroup``: barrier, broadcast, gather, ...) on a gloo group whose timeout outlasts a
long generation.

    hosts = HostGroup.create(EnginePlacement.from_env(tensor_parallel=cfg.rollout.tensor_parallel))
    if hosts.placement.is_host:
        with engine_threads(hosts.placement.cpu_threads):
            ...generate...
    hosts.barrier()
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from megatron_mugrpo.collectives import ObjectGroup
from megatron_mugrpo.errors import InputError


class PlacementError(InputError, ValueError):
    """The rollout engine groups cannot be laid out on this world; the message says what to change."""


@dataclass(frozen=True, kw_only=True)
class EnginePlacement:
    """This rank's place among the rollout engine groups."""

    rank: int
    """Global rank."""
    world_size: int
    local_rank: int
    """Rank within this node (its GPU index under torchrun)."""
    local_world_size: int
    """Ranks on this node."""
    tensor_parallel: int
    """rollout.tensor_parallel: ranks per engine group."""
    cores: int
    """CPU cores the ranks of this node share."""
    cpu_threads_override: int = 0
    """rollout.cpu_threads: torch threads per CPU engine host (0: share ``cores`` evenly)."""

    def __post_init__(self) -> None:
        tp, world, local = self.tensor_parallel, self.world_size, self.local_world_size
        if tp < 1:
            raise PlacementError(f"rollout.tensor_parallel={tp} must be >= 1")
        if world % tp:
            raise PlacementError(
                f"rollout.tensor_parallel={tp} does not divide the world size {world}: every rank belongs to one "
                f"rollout engine group of rollout.tensor_parallel ranks. Choose a divisor of {world} "
                "(1 puts one engine on every rank) or launch a multiple of it"
            )
        if local % tp:
            raise PlacementError(
                f"rollout.tensor_parallel={tp} does not divide the {local} ranks per node: an engine group must "
                "lie inside one node (its tensor-parallel workers share the node's GPUs). Choose a divisor of "
                f"{local}"
            )
        if not (0 <= self.rank < world and 0 <= self.local_rank < local):
            raise PlacementError(
                f"rank {self.rank} / local rank {self.local_rank} are outside world {world} / node {local}"
            )
        if self.cores < 1 or self.cpu_threads_override < 0:
            raise PlacementError(f"cores={self.cores} must be >= 1 and rollout.cpu_threads >= 0")

    @classmethod
    def single(cls, cores: int = 1) -> EnginePlacement:
        """One process, one engine (tests, benchmarks, ``generate_stage`` without a process group)."""
        return cls(rank=0, world_size=1, local_rank=0, local_world_size=1, tensor_parallel=1, cores=cores)

    @classmethod
    def from_env(
        cls, *, tensor_parallel: int, cpu_threads: int = 0, cores: int | None = None, world_size: int | None = None
    ) -> EnginePlacement:
        """The placement of this process from torchrun's RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE.

        Without LOCAL_WORLD_SIZE every rank is taken to be on one node. ``cores`` defaults to the CPUs
        this process may run on. ``world_size`` overrides WORLD_SIZE when only the launch's first ranks
        train (async mode: its rollout workers host no engine of the trainer's).
        """
        world = world_size or int(os.environ.get("WORLD_SIZE", "1"))
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
        return cls(
            rank=int(os.environ.get("RANK", "0")),
            world_size=world,
            local_rank=int(os.environ.get("LOCAL_RANK", "0")),
            local_world_size=local_world,
            tensor_parallel=tensor_parallel,
            cores=cores if cores is not None else available_cores(local_world),
            cpu_threads_override=cpu_threads,
        )

    @property
    def num_engines(self) -> int:
        """Engine groups in the world (one engine each)."""
        return self.world_size // self.tensor_parallel

    @property
    def engine_index(self) -> int:
        """Index of this rank's engine group."""
        return self.rank // self.tensor_parallel

    @property
    def host_rank(self) -> int:
        """Global rank of the host of this rank's group."""
        return self.engine_index * self.tensor_parallel

    @property
    def is_host(self) -> bool:
        return self.rank == self.host_rank

    @property
    def host_ranks(self) -> range:
        """Global ranks that host an engine."""
        return range(0, self.world_size, self.tensor_parallel)

    @property
    def base_gpu_id(self) -> int:
        """Local GPU of the group's host: SGLang's ``base_gpu_id`` (its workers use the next ``tp_size`` GPUs)."""
        return self.local_rank - (self.rank - self.host_rank)

    @property
    def hosts_on_node(self) -> int:
        return self.local_world_size // self.tensor_parallel

    @property
    def cpu_threads(self) -> int:
        """torch threads a CPU engine on this host may use: rollout.cpu_threads, else the node's cores
        split evenly among the node's hosts (at least 1)."""
        if self.cpu_threads_override:
            return self.cpu_threads_override
        return max(1, self.cores // self.hosts_on_node)


def available_cores(processes_on_node: int = 1) -> int:
    """CPUs the engines of this node's ``processes_on_node`` processes may use together.

    The process's affinity mask (which a scheduler's cgroup narrows), capped at OMP_NUM_THREADS per
    process when that is set: whoever set it has shared the machine out (a sweep running several jobs
    side by side, torchrun's default of one thread per process), and an engine that took every core
    of the mask would oversubscribe them; oversubscribed threads spin, and a 2-core machine running
    two one-thread jobs ran each about three times slower.
    """
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    budget = os.environ.get("OMP_NUM_THREADS", "").strip()
    if budget.isdigit() and int(budget) >= 1:
        cores = min(cores, int(budget) * max(1, processes_on_node))
    return cores


@contextmanager
def engine_threads(threads: int) -> Iterator[None]:
    """Run the block with ``threads`` torch threads, then restore the trainer's setting."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


HOST_WAIT_TIMEOUT = timedelta(hours=48)
"""How long a rank may wait for the others at a host barrier: a host that finished its shards waits for
the slowest one, which at paper scale is hours (the training collectives keep their shorter timeout)."""


@dataclass(frozen=True)
class HostGroup(ObjectGroup):
    """The placement plus the process group on which all ranks coordinate around generation, with
    ``ObjectGroup``'s collectives (``barrier``, ``broadcast``, ``gather``, ...) on it.

    ``group`` is None in a single process; every collective is then a no-op.
    """

    placement: EnginePlacement
    group: Any = field(default=None, compare=False)
    """A gloo ``ProcessGroup`` over every rank (CPU objects only: claims, plans, eval results)."""

    @classmethod
    def create(cls, placement: EnginePlacement) -> HostGroup:
        """Collective when distributed: every rank calls it at the same point."""
        if placement.world_size == 1:
            return cls(placement)
        if not dist.is_initialized():
            raise RuntimeError(
                f"{placement.world_size} ranks need torch.distributed initialised before HostGroup.create"
            )
        return cls(placement, dist.new_group(backend="gloo", timeout=HOST_WAIT_TIMEOUT))

    @property
    def rank(self) -> int:  # type: ignore[override]
        return self.placement.rank

    @property
    def world_size(self) -> int:  # type: ignore[override]
        return self.placement.world_size

    @property
    def collective_group(self) -> Any:
        return self.group

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device("cpu")  # a gloo group
