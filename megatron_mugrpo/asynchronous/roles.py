"""Which rank does what in a launch: pure arithmetic on (rank, world size, mode), unit-tested.

In ``mode: async`` the last ``async.rollout_ranks`` ranks of the launch are rollout workers and the
ranks before them train. Only trainer ranks join torch.distributed and Megatron's parallel state
(megatron-core builds its TP × PP × DP grid over the whole default process group, so the workers must
not be in it): they initialise it among themselves with world size ``trainer_world``. Rank 0 is
always a trainer, so it still hosts the rendezvous store. Workers talk to the trainer through the run
directory and, for weights in memory, a publication group of their own (``transport``).

    role = split_roles(rank=3, world_size=4, mode="async", rollout_ranks=2, model_parallel=1)
    role.is_worker, role.worker_index, role.trainer_world     # True, 1, 2
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from megatron_mugrpo.errors import InputError


class LaunchError(InputError, ValueError):
    """The launch's processes cannot be split as the config asks; the message says what to change."""


@dataclass(frozen=True, kw_only=True)
class ProcessRole:
    """This process's part in the launch."""

    rank: int
    """Global rank in the launch (torchrun's RANK)."""
    world_size: int
    """Processes in the launch (torchrun's WORLD_SIZE)."""
    trainer_world: int
    """Ranks that train: [0, trainer_world). All of them in staged mode."""

    @property
    def is_trainer(self) -> bool:
        return self.rank < self.trainer_world

    @property
    def is_worker(self) -> bool:
        return not self.is_trainer

    @property
    def worker_index(self) -> int:
        """Index among the rollout workers (0 for the first worker rank)."""
        if not self.is_worker:
            raise ValueError(f"rank {self.rank} is a trainer rank, not a rollout worker")
        return self.rank - self.trainer_world

    @property
    def num_workers(self) -> int:
        return self.world_size - self.trainer_world

    def describe(self) -> str:
        if self.is_worker:
            return f"rollout worker {self.worker_index} (rank {self.rank})"
        return f"trainer rank {self.rank}"


def split_roles(*, rank: int, world_size: int, mode: str, rollout_ranks: int, model_parallel: int) -> ProcessRole:
    """The role of ``rank`` among ``world_size`` processes.

    ``model_parallel`` = TP × PP: the trainer ranks must be a multiple of it (data parallelism takes
    the rest). Raises LaunchError for an async launch without enough processes.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside the world of {world_size} processes")
    if mode != "async":
        return ProcessRole(rank=rank, world_size=world_size, trainer_world=world_size)
    if world_size < 2:
        raise LaunchError(
            "mode: async runs rollout workers and trainers on separate ranks, but this launch has a single "
            "process: start it with `torchrun --nproc_per_node N -m megatron_mugrpo.cli train ...` (or "
            f"launch/torchrun.sh) with N >= async.rollout_ranks + 1 = {rollout_ranks + 1}, or use mode: staged"
        )
    trainers = world_size - rollout_ranks
    if trainers < 1:
        raise LaunchError(
            f"async.rollout_ranks={rollout_ranks} leaves no trainer among the {world_size} processes of this "
            f"launch; lower async.rollout_ranks below {world_size} or launch more processes"
        )
    if trainers % model_parallel:
        raise LaunchError(
            f"{trainers} trainer ranks ({world_size} processes - async.rollout_ranks={rollout_ranks}) are not a "
            f"multiple of parallel.tensor_parallel × parallel.pipeline_parallel = {model_parallel}; change the "
            "number of processes or async.rollout_ranks"
        )
    return ProcessRole(rank=rank, world_size=world_size, trainer_world=trainers)


def role_from_env(*, mode: str, rollout_ranks: int, model_parallel: int) -> ProcessRole:
    """``split_roles`` for this process, from torchrun's RANK / WORLD_SIZE (a single process without them)."""
    return split_roles(
        rank=int(os.environ.get("RANK", "0")),
        world_size=int(os.environ.get("WORLD_SIZE", "1")),
        mode=mode,
        rollout_ranks=rollout_ranks,
        model_parallel=model_parallel,
    )
