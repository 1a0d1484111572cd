"""The environment protocol of multi-turn rollouts, and the guard that holds every environment to its limits.

An environment starts an episode from a problem; the rollout engine then alternates the policy's turn
(the exact token ids it sampled, and their text) and the environment's observation (token ids it
appends). The engine never decodes and re-encodes sampled tokens: only the text handed to the
environment is decoded, and what goes back into the trajectory is the environment's own token ids.

    env = build_env(cfg.env, tokenizer)                 # envs/registry.py
    episode = env.start(Problem(prompt=record.text, answer=record.answer))
    outcome = guarded_step(episode, turn, limits, turn_index=0, total_tokens=len(prompt) + len(turn.token_ids))
    outcome.observation_ids, outcome.done, outcome.reason

``guarded_step`` is where the limits hold, whatever the environment does: a call that raises or
returns something that is not a ``StepResult`` ends the trajectory with ``env_error``; a call that
runs past ``env.timeout_s`` ends it with ``env_timeout`` (the call's thread is abandoned, a daemon, so
a hung environment never hangs the run); an observation longer than ``env.max_observation_tokens`` is
cut to that many tokens; the turn ``env.max_turns`` ends the trajectory with ``max_turns`` and an
observation that would take it past ``env.max_total_tokens`` ends it with ``max_total_tokens``.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from megatron_mugrpo.errors import InputError, require

ENV_ERROR, ENV_TIMEOUT = "env_error", "env_timeout"
"""Reasons of a trajectory the environment failed: it raised or returned garbage / it ran past its timeout."""
MAX_TURNS, MAX_TOTAL_TOKENS = "max_turns", "max_total_tokens"
"""Reasons of a trajectory stopped by a limit: the policy's last allowed turn / the token budget."""
CONTINUE = "continue"
"""The reason of a step that does not end the episode."""
LIMIT_REASONS = (ENV_ERROR, ENV_TIMEOUT, MAX_TURNS, MAX_TOTAL_TOKENS)


class EnvError(InputError, RuntimeError):
    """An environment cannot be built or reached (unknown kind, bad options, its server cannot start)."""


@dataclass(frozen=True, kw_only=True)
class Problem:
    """What an episode starts from: the prompt the policy sees and the reference answer (never shown)."""

    prompt: str
    answer: str


@dataclass(frozen=True, kw_only=True)
class Turn:
    """One policy turn: the exact ids it sampled, and their decoded text (for the environment to read)."""

    token_ids: tuple[int, ...]
    text: str


@dataclass(frozen=True, kw_only=True)
class StepResult:
    """What an environment answers to a policy turn."""

    observation_ids: tuple[int, ...] = ()
    """Token ids to append after the turn (empty when the episode is done)."""
    done: bool
    """The episode ends after this turn."""
    reason: str = CONTINUE
    """Why it ended (e.g. 'answered', 'no_action', 'env_error'); 'continue' while it goes on."""
    seconds: float = 0.0
    """Wall-clock time of the call (filled by ``guarded_step``)."""
    info: dict[str, Any] = field(default_factory=dict)
    """Counters for metrics (e.g. ``{"tool_calls": 1}``); the error text when the environment failed."""


class Episode(Protocol):
    """One problem's interaction; ``step`` is called once per policy turn until it says done."""

    def step(self, turn: Turn) -> StepResult: ...


class Environment(Protocol):
    """A kind of environment (``env.kind``), built once per run by ``envs.registry.build_env``."""

    stop_strings: tuple[str, ...]
    """Text that ends a policy turn besides EOS (e.g. '</search>'): the engine hands the turn over
    as soon as the turn's text ends with one of them."""

    def start(self, problem: Problem) -> Episode: ...

    def close(self) -> None: ...


@dataclass(kw_only=True)
class EnvLimits:
    """The limits ``guarded_step`` holds any environment to (from the ``env`` section)."""

    max_turns: int = 4
    """Policy turns per trajectory; the last one ends it with 'max_turns' unless it ends it itself."""
    max_observation_tokens: int = 512
    """Tokens of one observation; a longer one is cut to this many."""
    max_total_tokens: int = 4096
    """Prompt + every turn + every observation; an observation that would pass it ends the trajectory."""
    timeout_s: float = 30.0
    """Wall-clock bound of one environment call; past it the trajectory ends with 'env_timeout'."""

    def __post_init__(self) -> None:
        require(self.max_turns >= 1, f"env.max_turns={self.max_turns} must be >= 1")
        require(
            self.max_observation_tokens >= 1, f"env.max_observation_tokens={self.max_observation_tokens} must be >= 1"
        )
        require(self.max_total_tokens >= 2, f"env.max_total_tokens={self.max_total_tokens} must be >= 2")
        require(self.timeout_s > 0, f"env.timeout_s={self.timeout_s} must be > 0 (seconds)")


def guarded_step(episode: Episode, turn: Turn, limits: EnvLimits, *, turn_index: int, total_tokens: int) -> StepResult:
    """``episode.step(turn)`` under the limits (see the module docstring).

    Args:
        turn_index: 0-based index of ``turn`` among the policy's turns.
        total_tokens: tokens of the trajectory so far, the prompt and ``turn`` included.
    """
    start = time.perf_counter()
    try:
        result = call_with_timeout(episode.step, (turn,), limits.timeout_s)
    except TimeoutError:
        return _failed(ENV_TIMEOUT, f"no answer within env.timeout_s={limits.timeout_s}", start)
    except Exception as error:  # any failure of the environment is this trajectory's, never the run's
        return _failed(ENV_ERROR, f"{type(error).__name__}: {error}", start)
    seconds = time.perf_counter() - start
    problem = _garbage(result)
    if problem is not None:
        return _failed(ENV_ERROR, problem, start)
    info = dict(result.info)
    if result.done:
        return StepResult(done=True, reason=result.reason, seconds=seconds, info=info)
    if turn_index + 1 >= limits.max_turns:
        return StepResult(done=True, reason=MAX_TURNS, seconds=seconds, info=info)
    observation = tuple(result.observation_ids[: limits.max_observation_tokens])
    if len(observation) < len(result.observation_ids):
        info["observation_truncated"] = 1
    # The policy needs room for at least one more token after the observation.
    if total_tokens + len(observation) + 1 > limits.max_total_tokens:
        return StepResult(done=True, reason=MAX_TOTAL_TOKENS, seconds=seconds, info=info)
    return StepResult(observation_ids=observation, done=False, seconds=seconds, info=info)


def _garbage(result: object) -> str | None:
    """What is wrong with an environment's answer, or None when it is a usable ``StepResult``."""
    if not isinstance(result, StepResult):
        return f"step() returned {type(result).__name__}, not a StepResult"
    if not isinstance(result.reason, str) or not result.reason:
        return f"step() returned reason {result.reason!r}, not a non-empty string"
    if result.done and result.reason == CONTINUE:
        return "step() returned done with reason 'continue'"
    if not isinstance(result.info, dict):
        return f"step() returned info of type {type(result.info).__name__}, not a dict"
    ids = result.observation_ids
    if not isinstance(ids, Sequence) or not all(isinstance(t, int) and t >= 0 for t in ids):
        return "step() returned observation ids that are not non-negative integers"
    if not result.done and not ids:
        return "step() returned no observation and did not end the episode"
    return None


def _failed(reason: str, message: str, start: float) -> StepResult:
    return StepResult(done=True, reason=reason, seconds=time.perf_counter() - start, info={"error": message})


T = TypeVar("T")


def call_with_timeout(fn: Callable[..., T], args: tuple[Any, ...], timeout_s: float) -> T:
    """``fn(*args)`` in a daemon thread; TimeoutError when it has not returned within ``timeout_s``.

    A Python thread cannot be killed: one past its timeout is abandoned, and being a daemon it does not
    keep the process alive at exit. Its result, if it ever comes, is dropped."""
    box: queue.Queue[tuple[bool, Any]] = queue.Queue(maxsize=1)

    def run() -> None:
        try:
            box.put((True, fn(*args)))
        except BaseException as error:  # handed to the caller, raised there
            box.put((False, error))

    threading.Thread(target=run, name="env-call", daemon=True).start()
    try:
        ok, value = box.get(timeout=timeout_s)
    except queue.Empty:
        raise TimeoutError(f"the call did not return within {timeout_s} s") from None
    if not ok:
        raise value
    return value
