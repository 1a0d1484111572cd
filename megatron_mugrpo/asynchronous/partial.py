"""Partial rollouts on the worker side (``async.partial_rollout``): every token's policy version, from the
engine's generations to the groups a worker writes.

The engine tags each token with the version that sampled it (``Generation.versions``, through the
``engine.Interrupt`` the worker gives it) and ``rollout.generate`` copies them onto each
``RolloutSample``. ``group_versions`` then gives every group the version of its oldest token:

    groups = generate_groups(engine=worker.engine, ...)
    group_versions(groups, engine=worker.engine.name, updates_per_stage=mu)   # policy_version = the oldest
"""

from __future__ import annotations

from collections.abc import Sequence

from megatron_mugrpo.records import RolloutGroup


def group_versions(groups: Sequence[RolloutGroup], *, engine: str, updates_per_stage: int) -> None:
    """Each group's ``policy_version`` becomes its oldest token's (what ``async.max_lag`` is checked
    against) and its ``stage`` that version's stage; RuntimeError when a sample carries no versions."""
    for group in groups:
        if any(sample.versions is None for sample in group.samples):
            raise RuntimeError(
                f"the {engine} engine returned a response without per-token versions under "
                "async.partial_rollout=true: was its interrupt (engine.interrupt) not set?"
            )
        versions = [v for sample in group.samples for v in sample.versions]
        if versions:
            group.policy_version = min(versions)
            group.stage = group.policy_version // updates_per_stage
