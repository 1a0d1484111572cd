"""Partial rollouts on the worker side (``async.partial_rollout``): every token's policy version, from the
engine's generations to the groups a worker writes.

The engine tags each token with the version that sampled it (``Generation.versions``, through the
``engine.Interrupt`` the worker gives it). ``rollout.generate.generate_groups``, shared with staged
mode where a whole stage has one version, builds ``RolloutSample``s from the generations without that
list; ``VersionLedger`` stands between it and the engine, notes every generation's versions and hands
them to the samples afterwards, matched by what ``generate_groups`` copies unchanged (prompt, response
ids and log-probs; a response sampled twice with equal log-probs was sampled under equal weights).

    ledger = VersionLedger(worker.engine)
    groups = generate_groups(engine=ledger, ...)
    ledger.attach(groups, updates_per_stage=mu)   # sample.versions, group.policy_version = the oldest
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Sequence

from megatron_mugrpo.records import RolloutGroup
from megatron_mugrpo.rollout.engine import Generation, ProgressCallback, RolloutEngine, SamplingParams

_Key = tuple[tuple[int, ...], tuple[int, ...], tuple[float, ...]]


class VersionLedger:
    """A rollout engine's ``generate`` that remembers each generation's per-token versions (see the module
    docstring). Only ``generate`` and ``name`` are what ``generate_groups`` uses of an engine."""

    def __init__(self, engine: RolloutEngine):
        self.engine = engine
        self.name = getattr(engine, "name", type(engine).__name__)
        self._versions: dict[_Key, deque[list[int]]] = defaultdict(deque)

    def generate(
        self,
        prompts: list[list[int]],
        n: int | list[int],
        params: SamplingParams,
        progress: ProgressCallback | None = None,
    ) -> list[list[Generation]]:
        groups = self.engine.generate(prompts, n, params, progress)
        for prompt, group in zip(prompts, groups):
            for gen in group:
                if gen.versions is None:
                    raise RuntimeError(
                        f"the {self.name} engine returned a response without per-token versions under "
                        "async.partial_rollout=true: was its interrupt (engine.interrupt) not set?"
                    )
                self._versions[_key(prompt, gen.response_ids, gen.logprobs)].append(list(gen.versions))
        return groups

    def attach(self, groups: Sequence[RolloutGroup], *, updates_per_stage: int) -> None:
        """Give every sample its tokens' versions; each group's ``policy_version`` becomes its oldest
        token's (what ``async.max_lag`` is checked against) and its ``stage`` that version's stage."""
        for group in groups:
            for sample in group.samples:
                queued = self._versions.get(_key(group.prompt_ids, sample.response_ids, sample.behaviour_logprobs))
                if not queued:
                    raise RuntimeError(
                        f"prompt {group.prompt_id}: a sample matches no generation of this batch; "
                        "generate_groups changed a response between the engine and the group"
                    )
                sample.versions = queued.popleft()
            versions = [v for sample in group.samples for v in sample.versions]
            if versions:
                group.policy_version = min(versions)
                group.stage = group.policy_version // updates_per_stage


def _key(prompt: Sequence[int], response: Sequence[int], logprobs: Sequence[float]) -> _Key:
    return tuple(prompt), tuple(response), tuple(logprobs)
