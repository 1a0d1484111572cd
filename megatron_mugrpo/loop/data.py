"""The data of one stage's updates: the rollout store D_k, log π_old, and the groups HDR replays.

``StageData.minibatch(u, ...)`` is update u's list of groups: its share of the replayed groups first
(``algorithms.replay.replay_slots``: none at update 0, where π_θ = β must hold exactly, then spread
evenly over updates 1 … μ−1), then its B_mini fresh groups of D_k, with log π_old attached when the
rollout correction is on. Without replay the replayed list is empty and this is D_k alone. A
replayed group enters the batch exactly as stored: its generation-time log-probs are the ratio's
denominator and its advantages the ones computed when it was generated. Before it does, ``recheck``
(``loop.hdr.recheck_slot``) may drop it from its slot when its drift, checked again many updates
after the stage's decision, no longer passes the gate.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from megatron_mugrpo.algorithms.replay import replay_slots
from megatron_mugrpo.records import RolloutGroup
from megatron_mugrpo.rollout.store import RolloutStore
from megatron_mugrpo.training.stage_reference import OldLogprobs
from megatron_mugrpo.training.stage_reference import minibatch as fresh_minibatch


@dataclass(kw_only=True)
class StageData:
    """The data of one stage's updates: fresh D_k plus the accepted replayed groups (none without replay)."""

    store: RolloutStore
    replayed: list[RolloutGroup]
    """Accepted groups, as stored (generation-time log-probs and advantages)."""
    updates: int
    """μ: the stage's updates, over which the replayed groups are spread."""
    old_logprobs: OldLogprobs | None = None
    """log π_old of D_k (training.stage_reference), when a rollout correction is on."""
    recheck: Callable[[Sequence[int]], list[int]] | None = None
    """Which of a slot's replayed groups (positions in ``replayed``) to keep; collective (HDR's drift re-check)."""

    def minibatch(self, update_index: int, mini_groups: int, seed: int) -> list[RolloutGroup]:
        """Update ``update_index``'s groups: its share of replayed groups first, then its fresh ones."""
        share = replay_slots(len(self.replayed), self.updates)[update_index] if update_index < self.updates else []
        if self.recheck is not None:
            share = self.recheck(list(share))
        fresh = fresh_minibatch(self.store, update_index, mini_groups, seed, self.old_logprobs)
        return [self.replayed[i] for i in share] + fresh
