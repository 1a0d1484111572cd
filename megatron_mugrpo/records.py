"""Typed records that cross stage boundaries: rollout → store → trainer.

Token positions: a response of length T has token ids ``response_ids[t]`` and behaviour
log-probs ``behaviour_logprobs[t] = log β(response_ids[t] | prompt, response_ids[:t])`` computed as
log_softmax(logits / T_rollout), the same distribution the trainer scores.

A multi-turn response (a trajectory, ``envs/trajectory.py``) holds the policy's turns with the
environment's observation tokens between them, and a policy mask saying which is which. Behaviour
log-probs exist for policy tokens only; the list stays aligned with ``response_ids`` and holds 0.0 at
observation positions, which ``collate`` leaves out of the response mask, so no loss reads them:

    response_ids        t t t o o o t t        (t: sampled, o: the environment's observation)
    policy_mask         1 1 1 0 0 0 1 1
    behaviour_logprobs  b b b 0 0 0 b b
    turns               [(0, 3), (6, 8)]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass(kw_only=True)
class RolloutSample:
    """One sampled response to one prompt."""

    response_ids: list[int]
    """Generated token ids, EOS included when the response stopped on it."""
    behaviour_logprobs: list[float]
    """Per-token log β(a_t | s_t) at the rollout temperature; same length as response_ids."""
    finish_reason: str
    """'stop' (EOS) or 'length' (hit max_new_tokens)."""
    reward: float = 0.0
    """Verifier reward (1.0 correct, 0.0 not)."""
    reward_reason: str = ""
    """Why the reward is what it is ('correct', 'no_box', 'unparsable', 'wrong', 'timeout')."""
    advantage: float = 0.0
    """Group-normalised advantage; every token of the response shares it."""
    pass_fraction: float | None = None
    """Fraction of the tests passed, from rewards that run tests (code); in memory only, summed into the
    shard's statistics (``rollout/test_pass_rate``) when the shard is written, never stored per sample."""
    old_logprobs: list[float] | None = None
    """Per-token log π_train(θ_old): the trainer's own log-prob at the stage's starting weights. Only
    attached (never stored in the rollout shards) when the loss uses the rollout correction."""
    routes: np.ndarray | None = None
    """[len(prompt) + len(response) - 1, moe_layers, k] uint8 / int16: the experts the rollout engine routed
    each input token to (``rollout.routes``), recorded under ``moe.routing_replay=rollout``; None for dense
    models. The row count needs the prompt, so it is checked where samples are built and stored."""
    versions: list[int] | None = None
    """Per-token policy version (trainer updates behind the weights that sampled each token), for a
    response sampled across weight publications (async.partial_rollout); None: every token has the
    group's ``policy_version``. Same length as response_ids."""

    policy_mask: list[int] | None = None
    """Per-token 1 where the policy sampled the token, 0 where the environment wrote it (a multi-turn
    trajectory); None: a single-turn response, every token the policy's. Same length as response_ids."""
    turns: list[tuple[int, int]] | None = None
    """[start, end) of each policy turn in response_ids (multi-turn only)."""
    env_seconds: list[float] | None = None
    """Wall-clock seconds of each environment call of the trajectory (multi-turn only)."""

    def __post_init__(self) -> None:
        if self.policy_mask is not None:
            self._check_trajectory()
        if len(self.response_ids) != len(self.behaviour_logprobs):
            raise ValueError(
                f"response has {len(self.response_ids)} tokens but {len(self.behaviour_logprobs)} behaviour log-probs"
            )
        if self.old_logprobs is not None and len(self.old_logprobs) != len(self.response_ids):
            raise ValueError(f"response has {len(self.response_ids)} tokens but {len(self.old_logprobs)} old log-probs")
        if self.versions is not None and len(self.versions) != len(self.response_ids):
            raise ValueError(f"response has {len(self.response_ids)} tokens but {len(self.versions)} token versions")
        if self.routes is not None and self.routes.ndim != 3:
            raise ValueError(f"routes of shape {self.routes.shape} must be [tokens, moe_layers, k]")

    def _check_trajectory(self) -> None:
        """The policy mask, turns and environment seconds of a multi-turn response agree with its tokens."""
        mask, length = self.policy_mask or [], len(self.response_ids)
        if len(mask) != length or any(m not in (0, 1) for m in mask):
            raise ValueError(f"policy_mask must be {length} values of 0 or 1, one per response token")
        turns = self.turns or []
        covered = [0] * length
        for start, end in turns:
            if not 0 <= start < end <= length:
                raise ValueError(f"turn [{start}, {end}) is outside the {length}-token response")
            covered[start:end] = [1] * (end - start)
        if covered != list(mask):
            raise ValueError("the turns must cover exactly the policy tokens (policy_mask == 1)")
        if any(not s >= 0.0 for s in self.env_seconds or []):
            raise ValueError("env_seconds must be non-negative seconds")


@dataclass(kw_only=True)
class RolloutGroup:
    """All responses to one prompt: the unit of B_train / B_mini and of advantage normalisation."""

    prompt_id: str
    """Stable id of the prompt in its dataset."""
    prompt_ids: list[int]
    """Prompt token ids (chat template applied)."""
    answer: str
    """Reference answer the verifier checks against."""
    samples: list[RolloutSample] = field(default_factory=list)
    stage: int = 0
    """Stage k that generated the group."""
    policy_version: int = 0
    """Optimizer updates the behaviour policy had seen when it generated the group."""

    @property
    def rewards(self) -> list[float]:
        return [s.reward for s in self.samples]


@dataclass(kw_only=True)
class TrainBatch:
    """Padded tensors for one micro-batch (or mini-batch) of responses.

    Layout: ``tokens[b] = prompt + response + padding`` (right padded); position t's logits predict
    ``targets[b, t] = tokens[b, t + 1]``. Per-token tensors are aligned with ``targets``.
    """

    tokens: torch.Tensor
    """[B, L] int64 input ids."""
    targets: torch.Tensor
    """[B, L] int64: tokens shifted left by one (padding at the end)."""
    response_mask: torch.Tensor
    """[B, L] float32: 1 where targets[b, t] is a response token, else 0."""
    behaviour_logprobs: torch.Tensor
    """[B, L] float32 aligned with targets; 0 outside the response."""
    advantages: torch.Tensor
    """[B] float32, one advantage per response."""
    group_index: torch.Tensor
    """[B] int64: which prompt group (within the mini-batch) each response belongs to."""
    loss_inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    """Extra keyword inputs of the loss computed once per optimizer update by its update pass
    (``algorithms.losses.update_inputs``): [B, L] tensors travel with their rows, 0-d ones are shared."""
    old_logprobs: torch.Tensor | None = None
    """[B, L] float32 log π_train(θ_old) aligned with targets, 0 outside the response; present only
    when every response carries it (the rollout correction, ``algorithms.rollout_correction``)."""
    routes: torch.Tensor | None = None
    """[B, L, moe_layers, k] uint8 / int16: the experts the rollout engine routed each input token
    (``tokens[b, t]``) to in each MoE layer, present when every response carries them
    (``rollout.routes``; replayed under ``moe.routing_replay=rollout``). Padding positions hold any ids."""

    @property
    def num_sequences(self) -> int:
        return int(self.tokens.shape[0])

    def slice(self, start: int, stop: int) -> TrainBatch:
        """Rows [start, stop): a micro-batch."""
        return self.map_rows(lambda tensor: tensor[start:stop])

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> TrainBatch:
        """A batch whose per-row tensors (every field, and the [B, ...] loss inputs) are ``fn(tensor)``."""
        rows = {k: fn(getattr(self, k)) for k in _BATCH_FIELDS}
        inputs = {k: (fn(v) if v.dim() > 0 else v) for k, v in self.loss_inputs.items()}
        old = fn(self.old_logprobs) if self.old_logprobs is not None else None
        routes = fn(self.routes) if self.routes is not None else None
        return TrainBatch(**rows, loss_inputs=inputs, old_logprobs=old, routes=routes)

    def to(self, device: torch.device | str) -> TrainBatch:
        moved = self.map_rows(lambda tensor: tensor.to(device))
        moved.loss_inputs = {k: v.to(device) for k, v in moved.loss_inputs.items()}
        return moved


_BATCH_FIELDS = ("tokens", "targets", "response_mask", "behaviour_logprobs", "advantages", "group_index")


def pad_routes(routes: Sequence[np.ndarray], length: int) -> torch.Tensor:
    """``TrainBatch.routes`` [B, length, moe_layers, k] from each row's [T_b, moe_layers, k] (T_b <= length);
    positions past T_b (padding) get experts 0..k-1, distinct as every route must be.

    Lives beside ``collate`` (its one caller in the package) so records stay on the bottom floor."""
    if not routes:
        raise ValueError("pad_routes got no rows")
    layers, topk = routes[0].shape[1:]
    out = np.broadcast_to(np.arange(topk, dtype=routes[0].dtype), (len(routes), length, layers, topk)).copy()
    for b, row in enumerate(routes):
        if row.shape[0] > length or row.shape[1:] != (layers, topk):
            raise ValueError(f"row {b} routes {row.shape} do not fit [<= {length}, {layers}, {topk}]")
        out[b, : row.shape[0]] = row
    return torch.from_numpy(out)


def collate(groups: list[RolloutGroup], pad_id: int, pad_to_multiple: int = 1) -> TrainBatch:
    """Flatten prompt groups into one right-padded TrainBatch (one row per response).

    The response mask of a multi-turn response is its policy mask: observation tokens are inputs the
    model reads, never targets a loss scores (every loss, NAV, HDR and the rollout correction read the
    response mask). Routes (when every response carries them) line up with ``tokens``: row b's P + T - 1 routes are
    those of ``tokens[b, :P + T - 1]``, the inputs whose targets are real."""
    rows = [(g_idx, g.prompt_ids, s) for g_idx, g in enumerate(groups) for s in g.samples]
    if not rows:
        raise ValueError("collate() got no responses: every group is empty")
    routed = [s.routes is not None for _, _, s in rows]
    if any(routed) and not all(routed):
        raise ValueError(
            f"{routed.count(False)} of {len(rows)} responses carry no routes: a batch replays the engine's routes "
            "for every response or for none (were groups without routes mixed in, e.g. from the replay buffer?)"
        )
    length = max(len(p) + len(s.response_ids) for _, p, s in rows)
    length = -(-length // pad_to_multiple) * pad_to_multiple
    batch = len(rows)
    tokens = torch.full((batch, length), pad_id, dtype=torch.long)
    targets = torch.full((batch, length), pad_id, dtype=torch.long)
    mask = torch.zeros(batch, length)
    behaviour = torch.zeros(batch, length)
    with_old = all(s.old_logprobs is not None for _, _, s in rows)
    old = torch.zeros(batch, length) if with_old else None
    for b, (_, prompt, sample) in enumerate(rows):
        seq = torch.tensor(prompt + sample.response_ids, dtype=torch.long)
        tokens[b, : len(seq)] = seq
        targets[b, : len(seq) - 1] = seq[1:]
        # targets[t] for t in [P-1, P-1+T) are the response tokens.
        start, stop = len(prompt) - 1, len(prompt) - 1 + len(sample.response_ids)
        mask[b, start:stop] = 1.0 if sample.policy_mask is None else torch.tensor(sample.policy_mask)
        behaviour[b, start:stop] = torch.tensor(sample.behaviour_logprobs, dtype=torch.float32)
        if old is not None:
            old[b, start:stop] = torch.tensor(sample.old_logprobs, dtype=torch.float32)
    return TrainBatch(
        tokens=tokens,
        targets=targets,
        response_mask=mask,
        behaviour_logprobs=behaviour,
        advantages=torch.tensor([s.advantage for _, _, s in rows], dtype=torch.float32),
        group_index=torch.tensor([g for g, _, _ in rows], dtype=torch.long),
        old_logprobs=old,
        routes=pad_routes([s.routes for _, _, s in rows], length) if all(routed) else None,
    )
