"""Collectives on picklable objects (and one flag) over a process group: the one implementation that
the trainer's groups (``training.parallel.ParallelGroups``) and the engine hosts' group
(``rollout.placement.HostGroup``) share.

Every member calls each collective at the same point. In one process (world size 1, or no process
group) each is a no-op that returns what a single rank would get, so code written for many ranks runs
unchanged in one.

    groups.barrier()
    plan = hosts.broadcast(plan if hosts.rank == 0 else None)
    everyone = groups.all_gather(my_problem)     # [rank 0's, rank 1's, ...] on every rank
    at_zero = hosts.gather(my_counts)            # the list on rank 0, None elsewhere
    stop = groups.any_rank(my_flag)
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class ObjectGroup:
    """Object collectives over ``collective_group``. A subclass (a dataclass) provides the four attributes
    below, as fields or properties."""

    rank: int
    """This member's rank (rank 0 of the group is global rank 0: every group here spans ranks from 0)."""
    world_size: int
    collective_group: Any
    """The ``ProcessGroup`` the collectives run on (None: one process)."""
    device: torch.device
    """Where ``any_rank``'s flag is reduced: NCCL groups need the rank's GPU, gloo groups the CPU."""

    @property
    def distributed(self) -> bool:
        return self.world_size > 1 and self.collective_group is not None

    def barrier(self) -> None:
        """Wait for every member."""
        if self.distributed:
            dist.barrier(group=self.collective_group)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Member ``src``'s ``obj`` on every member."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self.collective_group)
        return box[0]

    def all_gather(self, obj: Any) -> list[Any]:
        """Every member's ``obj``, in rank order, on every member."""
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.collective_group)
        return out

    def gather(self, obj: Any) -> list[Any] | None:
        """Every member's ``obj``, in rank order, on rank 0 (None elsewhere)."""
        if not self.distributed:
            return [obj]
        out: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0, group=self.collective_group)
        return out

    def any_rank(self, flag: bool) -> bool:
        """True when ``flag`` is true on any member (one small all-reduce, not a pickled object)."""
        if not self.distributed:
            return flag
        tensor = torch.tensor([int(flag)], dtype=torch.int, device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.collective_group)
        return bool(tensor[0])
