"""Multi-turn trajectories, token in / token out: what a rollout engine returns for an episode.

A trajectory is the exact token ids the policy sampled with the environment's observation ids
appended between its turns, nothing decoded and re-encoded. Every token carries a policy mask (1: the
policy sampled it, 0: the environment wrote it); behaviour log-probs exist for policy tokens only.

    prompt  | t t t t o o o o o t t t o o t t t      token_ids (after the prompt)
            | 1 1 1 1 0 0 0 0 0 1 1 1 0 0 1 1 1      policy_mask
            | turn 0   obs 0     turn 1 obs1 turn 2   turns: [start, end) of each policy turn

``TrajectoryBuilder`` is one row's bookkeeping while an engine decodes (pure Python, no tensors): the
engine adds each sampled token, asks whether the turn is over, hands the turn to the environment
through ``guarded_step`` and appends the observation it returns. End reasons:

    stop              the policy sampled EOS
    <the env's>       the environment ended the episode (search: 'answered', 'no_action')
    max_turns, max_total_tokens, env_error, env_timeout     a limit or a failure (envs/base.py)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from megatron_mugrpo.envs.base import (
    ENV_ERROR,
    ENV_TIMEOUT,
    MAX_TOTAL_TOKENS,
    EnvError,
    EnvLimits,
    Episode,
    StepResult,
    Turn,
    guarded_step,
)
from megatron_mugrpo.metric_names import ROLLOUT_PREFIX

if TYPE_CHECKING:
    import numpy as np

STOP = "stop"
"""End reason of a trajectory whose policy sampled EOS."""


@dataclass(kw_only=True)
class Trajectory:
    """One episode's tokens after the prompt, with who wrote each one."""

    token_ids: list[int]
    """Sampled ids and observation ids, in order."""
    policy_mask: list[int]
    """[len(token_ids)] 1 where the policy sampled the token, 0 where the environment wrote it."""
    logprobs: list[float]
    """Behaviour log-probs log_softmax(logits / T)[token] of the policy tokens only, in order."""
    turns: list[tuple[int, int]]
    """[start, end) of each policy turn in ``token_ids``."""
    end_reason: str
    """Why the episode ended (module docstring)."""
    env_seconds: list[float] = field(default_factory=list)
    """Wall-clock seconds of each environment call."""
    tool_calls: int = 0
    """Environment calls that reported a tool call (``info['tool_calls']``)."""
    error: str | None = None
    """The environment's error when the episode ended with env_error / env_timeout."""
    routes: np.ndarray | None = None
    """[prompt + len(token_ids) - 1, moe_layers, k] expert ids (``rollout.routes``) of every position the
    trainer forwards, observation tokens included, when the engine records routes (moe.routing_replay=rollout);
    None otherwise."""

    def aligned_logprobs(self, fill: float = 0.0) -> list[float]:
        """[len(token_ids)]: the behaviour log-probs at policy tokens, ``fill`` at observation tokens."""
        policy = iter(self.logprobs)
        return [next(policy) if m else fill for m in self.policy_mask]

    def text(self, decode: Callable[[list[int]], str]) -> str:
        """The whole trajectory as text (for a reward that reads it), decoded once at the end."""
        return decode(self.token_ids)


class TrajectoryBuilder:
    """One row's trajectory while it is decoded (see the module docstring)."""

    def __init__(self, *, prompt_length: int, episode: Episode, limits: EnvLimits, max_turn_tokens: int) -> None:
        self.prompt_length, self.episode, self.limits = prompt_length, episode, limits
        self.max_turn_tokens = max_turn_tokens
        self.token_ids: list[int] = []
        self.policy_mask: list[int] = []
        self.logprobs: list[float] = []
        self.turns: list[tuple[int, int]] = []
        self.turn_start = 0
        self.env_seconds: list[float] = []
        self.tool_calls = 0
        self.end_reason: str | None = None
        self.error: str | None = None

    @property
    def done(self) -> bool:
        return self.end_reason is not None

    @property
    def total_tokens(self) -> int:
        return self.prompt_length + len(self.token_ids)

    def add_sampled(self, token: int, logprob: float) -> None:
        self.token_ids.append(token)
        self.policy_mask.append(1)
        self.logprobs.append(logprob)

    def turn_ids(self) -> list[int]:
        return self.token_ids[self.turn_start :]

    def turn_over(self, *, eos: bool, stopped: bool) -> bool:
        """Whether the turn just sampled into goes to the environment (a stop string, or the turn's token
        cap). EOS, and the token budget reached mid-turn, end the trajectory without an environment call."""
        if eos:
            self._end_turn()
            self.end_reason = STOP
            return False
        if stopped or len(self.token_ids) - self.turn_start >= self.max_turn_tokens:
            return True  # a turn that also fills the budget still goes: its answer may be complete
        if self.total_tokens >= self.limits.max_total_tokens:
            self._end_turn()
            self.end_reason = MAX_TOTAL_TOKENS
        return False

    def turn(self, decode: Callable[[list[int]], str]) -> Turn:
        ids = self.turn_ids()
        return Turn(token_ids=tuple(ids), text=decode(ids))

    def apply(self, result: StepResult) -> list[int]:
        """Record the environment's answer to the turn just ended; returns the observation ids to feed."""
        self._end_turn()
        self.env_seconds.append(result.seconds)
        calls = result.info.get("tool_calls", 0)
        self.tool_calls += calls if isinstance(calls, int) else 0
        if result.done:
            self.end_reason, self.error = result.reason, result.info.get("error")
            return []
        observation = list(result.observation_ids)
        self.token_ids += observation
        self.policy_mask += [0] * len(observation)
        self.turn_start = len(self.token_ids)
        return observation

    def _end_turn(self) -> None:
        if len(self.token_ids) > self.turn_start:
            self.turns.append((self.turn_start, len(self.token_ids)))

    def build(self) -> Trajectory:
        if self.end_reason is None:
            raise RuntimeError("a trajectory is built once its episode has ended")
        return Trajectory(
            token_ids=list(self.token_ids),
            policy_mask=list(self.policy_mask),
            logprobs=list(self.logprobs),
            turns=list(self.turns),
            end_reason=self.end_reason,
            env_seconds=list(self.env_seconds),
            tool_calls=self.tool_calls,
            error=self.error,
        )


def stop_hit(text: str, stop_strings: Sequence[str]) -> bool:
    """Whether the turn's text holds a stop string. The turn ends at the first one, so one found now came
    with the token just sampled (a stop string inside one token counts too)."""
    return any(stop in text for stop in stop_strings)


def trajectory_metrics(trajectories: Sequence[Trajectory], prefix: str = ROLLOUT_PREFIX) -> dict[str, float]:
    """A stage's multi-turn metrics: policy turns and tool calls per trajectory, environment seconds (summed
    over calls: with calls at once this exceeds their wall clock), failed trajectories, and tokens per
    trajectory by who wrote them."""
    n = len(trajectories)
    if n == 0:
        return {}
    policy = sum(sum(t.policy_mask) for t in trajectories)
    return {
        f"{prefix}turns_mean": sum(len(t.turns) for t in trajectories) / n,
        f"{prefix}tool_calls_mean": sum(t.tool_calls for t in trajectories) / n,
        f"{prefix}env_seconds": sum(sum(t.env_seconds) for t in trajectories),
        f"{prefix}env_errors": float(sum(t.end_reason in (ENV_ERROR, ENV_TIMEOUT) for t in trajectories)),
        f"{prefix}policy_tokens_mean": policy / n,
        f"{prefix}observation_tokens_mean": (sum(len(t.token_ids) for t in trajectories) - policy) / n,
    }


def check_error_budget(trajectories: Sequence[Trajectory], max_error_frac: float, env_name: str) -> None:
    """Raise ``EnvError`` naming the environment and its last error when more than ``max_error_frac`` of a
    stage's trajectories ended in env_error / env_timeout (a broken environment must stop the run, not
    train it on zero rewards)."""
    failed = [t for t in trajectories if t.end_reason in (ENV_ERROR, ENV_TIMEOUT)]
    if trajectories and len(failed) > max_error_frac * len(trajectories):
        last = failed[-1]
        raise EnvError(
            f"{len(failed)} of {len(trajectories)} trajectories failed in environment {env_name!r}, more than "
            f"env.max_error_frac={max_error_frac}; last: {last.end_reason}: {last.error}"
        )


def replay_sampled(
    row: TrajectoryBuilder,
    response_ids: Sequence[int],
    logprobs: Sequence[float],
    *,
    eos: set[int],
    decode: Callable[[list[int]], str],
    stop_strings: Sequence[str],
    eos_at_last: bool = False,
) -> bool | None:
    """Feed a turn an engine sampled in one request (vLLM, SGLang: they know no stop strings of ours) to
    ``row`` token by token, through the rules the transformers engine applies as it decodes (EOS: a token
    of ``eos``, or the last one when ``eos_at_last``; a stop string; the turn cap; the budget). True: the
    turn goes to the environment; False: the trajectory ended. What was sampled past the end is dropped
    (it does not change the kept tokens' log-probs). None: the tokens ran out before the turn ended, which
    the engine's own contract forbids (it raises its contract error)."""
    last = len(response_ids) - 1
    for k, (token, logprob) in enumerate(zip(response_ids, logprobs)):
        row.add_sampled(token, logprob)
        stopped = bool(stop_strings) and stop_hit(decode(row.turn_ids()), stop_strings)
        if row.turn_over(eos=token in eos or (eos_at_last and k == last), stopped=stopped):
            return True
        if row.done:
            return False
    return None


def env_step(row: TrajectoryBuilder, decode: Callable[[list[int]], str], vocab_size: int) -> StepResult:
    """The environment's answer to the turn ``row`` just ended, bounded by its timeout (``guarded_step``). An
    observation id the model cannot embed is the environment's error. Reads ``row`` only: safe in a thread
    while the engine leaves the row alone until the answer is applied."""
    result = guarded_step(
        row.episode, row.turn(decode), row.limits, turn_index=len(row.turns), total_tokens=row.total_tokens
    )
    bad = [t for t in result.observation_ids if t >= vocab_size]
    if bad:
        message = f"observation id {bad[0]} is outside the model's vocabulary ({vocab_size} ids)"
        return StepResult(done=True, reason=ENV_ERROR, seconds=result.seconds, info={"error": message})
    return result


def env_steps(rows: list[TrajectoryBuilder], decode: Callable[[list[int]], str], vocab_size: int) -> list[StepResult]:
    """The environment's answers to the turns that just ended, called at once (``env_step`` each)."""
    if len(rows) <= 1:
        return [env_step(row, decode, vocab_size) for row in rows]
    with ThreadPoolExecutor(max_workers=len(rows), thread_name_prefix="env-step") as pool:
        return list(pool.map(lambda row: env_step(row, decode, vocab_size), rows))
