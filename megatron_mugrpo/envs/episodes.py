"""Groups of multi-turn episodes: the step a rollout stage takes with an environment instead of ``generate``.

For each prompt, ``n`` episodes start from its problem; the engine decodes them all as trajectories
(``TransformersEngine.generate_trajectories``), and the reward scores each trajectory's policy text
with its end reason, so that a trajectory cut short by the environment or a limit scores 0 with that
reason (env_error, env_timeout, max_turns), whatever its text holds.

    groups = run_episodes(engine, env, problems, prompt_ids, n=8, params=params, limits=limits, decode=decode)
    scores = score_episodes(reward, groups, answers, decode)
    metrics = trajectory_metrics([t for group in groups for t in group])

A rollout stage (``rollout/generate.py``) holds the run's environment for the stage in a ``StageEnv``:
the loopback search server starts with it and stops when the stage's generation ends; each shard's
episodes become ``RolloutSample`` records (policy mask, turns, environment seconds) through
``episode_samples``, which also checks the error budget before the shard is written and adds the
shard's trajectories to the stage's tally (``rollout/turns_mean`` and the other ``ENV_METRICS``):

    with stage_env(cfg.env, tokenizer) as env:          # None when env.enabled is off
        samples = episode_samples(engine, env, records, group_size=8, params=params, decode=decode,
                                  reward_fn=reward)     # one list of G samples per record
    env_metrics([env.tally.counts(sampling_s)])
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

from megatron_mugrpo.envs.base import (
    ENV_ERROR,
    ENV_TIMEOUT,
    MAX_TOTAL_TOKENS,
    MAX_TURNS,
    Environment,
    EnvLimits,
    Episode,
    Problem,
    StepResult,
    Turn,
)
from megatron_mugrpo.envs.registry import build_env, env_limits
from megatron_mugrpo.envs.trajectory import Trajectory, check_error_budget
from megatron_mugrpo.metric_names import ROLLOUT_PREFIX
from megatron_mugrpo.records import RolloutSample
from megatron_mugrpo.rewards.score import Score

FAILED_REASONS = (ENV_ERROR, ENV_TIMEOUT, MAX_TURNS)
"""End reasons that score 0 whatever the trajectory's text: the environment failed, or the policy used its
last turn without ending the episode."""


class MultiTurnEngine(Protocol):
    """What ``run_episodes`` needs from a rollout engine; those of ``registry.OVERLAP_ENGINES`` also take
    ``overlap=True`` (``env.overlap``)."""

    def generate_trajectories(
        self,
        prompts: list[list[int]],
        episodes: list[Episode],
        params: Any,
        *,
        limits: EnvLimits,
        decode: Callable[[list[int]], str],
        stop_strings: Sequence[str] = (),
    ) -> list[Trajectory]: ...


def run_episodes(
    engine: MultiTurnEngine,
    env: Environment,
    problems: Sequence[Problem],
    prompt_ids: Sequence[list[int]],
    *,
    n: int,
    params: Any,
    limits: EnvLimits,
    decode: Callable[[list[int]], str],
    overlap: bool = False,
) -> list[list[Trajectory]]:
    """``n`` trajectories per problem, grouped by problem in order (``params``: the engine's SamplingParams).
    ``overlap``: environment calls overlap decoding (``env.overlap``; an engine of ``OVERLAP_ENGINES``)."""
    if len(problems) != len(prompt_ids):
        raise ValueError(f"{len(problems)} problems but {len(prompt_ids)} prompts")
    if n < 1:
        raise ValueError(f"n={n} must be >= 1 (trajectories per problem)")
    episodes = [env.start(problem) for problem in problems for _ in range(n)]
    prompts = [list(ids) for ids in prompt_ids for _ in range(n)]
    # Only engines that can overlap take the keyword (the config refuses env.overlap=on for the others).
    extra = {"overlap": True} if overlap else {}
    flat = engine.generate_trajectories(
        prompts, episodes, params, limits=limits, decode=decode, stop_strings=env.stop_strings, **extra
    )
    return [flat[i * n : (i + 1) * n] for i in range(len(problems))]


def policy_text(trajectory: Trajectory, decode: Callable[[list[int]], str]) -> str:
    """The policy's turns as text, observations left out: the answer a reward reads is the policy's own,
    never one a retrieved document happens to contain."""
    return "".join(decode(trajectory.token_ids[start:end]) for start, end in trajectory.turns)


def score_trajectories(
    reward: Any, trajectories: Sequence[Trajectory], answers: Sequence[str], decode: Callable[[list[int]], str]
) -> list[Any]:
    """Each trajectory's score: (0.0, end reason) for a failed one (``FAILED_REASONS``), else the reward's
    score of its policy text (``reward.score``, any reward of the registry); ``answers[i]`` is trajectory
    i's reference."""
    scored = [i for i, t in enumerate(trajectories) if t.end_reason not in FAILED_REASONS]
    texts = [policy_text(trajectories[i], decode) for i in scored]
    scores: list[Any] = [Score(0.0, t.end_reason) for t in trajectories]
    for i, score in zip(scored, reward.score(texts, [answers[i] for i in scored]) if scored else []):
        scores[i] = score
    return scores


def score_episodes(
    reward: Any, groups: Sequence[Sequence[Trajectory]], answers: Sequence[str], decode: Callable[[list[int]], str]
) -> list[list[Any]]:
    """``score_trajectories`` of grouped trajectories, grouped like ``groups``; ``answers[i]`` is problem i's
    reference."""
    if len(groups) != len(answers):
        raise ValueError(f"{len(groups)} groups but {len(answers)} answers")
    references = [answer for group, answer in zip(groups, answers) for _ in group]
    flat = score_trajectories(reward, [t for group in groups for t in group], references, decode)
    out, start = [], 0
    for group in groups:
        out.append(flat[start : start + len(group)])
        start += len(group)
    return out


def trajectory_sample(trajectory: Trajectory, score: Any) -> RolloutSample:
    """A trajectory as the store and the trainer take a response: its tokens with the policy mask, behaviour
    log-probs aligned (0.0 at observation tokens), turns and environment seconds. The end reason is the
    reward's reason when it failed; finish_reason is 'length' when the token budget cut it, else 'stop'."""
    reward, reason = score
    return RolloutSample(
        response_ids=list(trajectory.token_ids),
        behaviour_logprobs=trajectory.aligned_logprobs(),
        finish_reason="length" if trajectory.end_reason == MAX_TOTAL_TOKENS else "stop",
        reward=reward,
        reward_reason=reason,
        policy_mask=list(trajectory.policy_mask),
        turns=list(trajectory.turns),
        env_seconds=list(trajectory.env_seconds),
        routes=trajectory.routes,  # every position's experts, observations included (moe.routing_replay=rollout)
    )


class EnvClock:
    """Wall-clock seconds during which at least one environment call was running (the union of the calls'
    intervals): calls of one decode step run at once, so their summed seconds overstate the time the
    stage spent waiting on the environment."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running = 0
        self._since = 0.0
        self.seconds = 0.0

    def enter(self) -> None:
        with self._lock:
            if self._running == 0:
                self._since = time.perf_counter()
            self._running += 1

    def exit(self) -> None:
        with self._lock:
            self._running -= 1
            if self._running == 0:
                self.seconds += time.perf_counter() - self._since


class _TimedEpisode:
    """An episode whose calls the stage's ``EnvClock`` times."""

    def __init__(self, episode: Episode, clock: EnvClock) -> None:
        self.episode, self.clock = episode, clock

    def step(self, turn: Turn) -> StepResult:
        self.clock.enter()
        try:
            return self.episode.step(turn)
        finally:
            self.clock.exit()


@dataclass
class EnvTally:
    """A stage's multi-turn counts, summed over the shards one host generated (``env_metrics`` turns every
    host's counts into the ``rollout/`` env metrics)."""

    trajectories: int = 0
    turns: int = 0
    tool_calls: int = 0
    env_seconds: float = 0.0
    env_errors: int = 0
    policy_tokens: int = 0
    observation_tokens: int = 0
    clock: EnvClock = field(default_factory=EnvClock)

    def add(self, trajectories: Sequence[Trajectory]) -> None:
        for t in trajectories:
            self.trajectories += 1
            self.turns += len(t.turns)
            self.tool_calls += t.tool_calls
            self.env_seconds += sum(t.env_seconds)
            self.env_errors += t.end_reason in (ENV_ERROR, ENV_TIMEOUT)
            self.policy_tokens += sum(t.policy_mask)
            self.observation_tokens += len(t.policy_mask) - sum(t.policy_mask)

    def counts(self, sampling_s: float) -> dict[str, float]:
        """The tally as plain sums (what one host sends rank 0), with ``sampling_s``, the seconds this host
        spent decoding its trajectories, environment calls included."""
        sums = {k: float(getattr(self, k)) for k in _COUNTS}
        return sums | {"env_wall_s": self.clock.seconds, "sampling_s": sampling_s}


_COUNTS = ("trajectories", "turns", "tool_calls", "env_seconds", "env_errors", "policy_tokens", "observation_tokens")
ENV_METRICS = tuple(
    f"{ROLLOUT_PREFIX}{name}"
    for name in (
        "turns_mean",
        "tool_calls_mean",
        "env_seconds",
        "env_errors",
        "env_wall_s",
        "env_share",
        "policy_tokens_mean",
        "observation_tokens_mean",
    )
)
"""The multi-turn metrics of a rollout phase (``env_metrics``)."""


def env_metrics(tallies: Sequence[dict[str, float]]) -> dict[str, float]:
    """A rollout phase's ``ENV_METRICS`` from every host's ``EnvTally.counts``: per trajectory, policy turns,
    tool calls and tokens by who wrote them; environment seconds summed over calls; failed trajectories
    (env_error, env_timeout); the environment's wall clock and its share of the decoding time (both summed
    over hosts). Empty without tallies (no environment, or nothing generated)."""
    if not tallies:
        return {}
    total = {k: sum(t[k] for t in tallies) for k in tallies[0]}
    n = max(total["trajectories"], 1.0)
    values = (
        total["turns"] / n,
        total["tool_calls"] / n,
        total["env_seconds"],
        total["env_errors"],
        total["env_wall_s"],
        total["env_wall_s"] / total["sampling_s"] if total["sampling_s"] > 0 else 0.0,
        total["policy_tokens"] / n,
        total["observation_tokens"] / n,
    )
    return dict(zip(ENV_METRICS, values, strict=True))


@dataclass(kw_only=True)
class StageEnv:
    """The environment a rollout stage talks to, its limits and failure budget, and the stage's tally."""

    env: Environment
    name: str
    """``env.kind``, for errors."""
    limits: EnvLimits
    max_error_frac: float
    overlap: bool = False
    """Environment calls overlap decoding (``registry.env_overlap``)."""
    tally: EnvTally = field(default_factory=EnvTally)


@contextmanager
def stage_env(settings: Any, tokenizer: Any, *, overlap: bool = False) -> Iterator[StageEnv | None]:
    """The run's environment for one stage's generation or evaluation, closed after it (None without an
    ``env`` section or when it is off): a search environment without ``env.search.url`` serves its corpus on
    loopback until then. ``overlap``: its calls overlap decoding (``registry.env_overlap`` decides)."""
    if settings is None or not settings.enabled:
        yield None
        return
    env = build_env(settings, tokenizer)
    try:
        yield StageEnv(
            env=env,
            name=settings.kind,
            limits=env_limits(settings),
            max_error_frac=settings.max_error_frac,
            overlap=overlap,
        )
    finally:
        env.close()


def episode_samples(
    engine: MultiTurnEngine,
    stage: StageEnv,
    records: Sequence[Any],
    *,
    group_size: int,
    params: Any,
    decode: Callable[[list[int]], str],
    reward_fn: Any,
) -> list[list[RolloutSample]]:
    """``group_size`` scored trajectories per record (a ``PromptRecord``: prompt_ids, answer, text), as
    samples. Raises ``EnvError`` naming the environment and its last error when more than
    ``env.max_error_frac`` of them failed: before the caller writes the shard, so a broken environment
    never puts a shard of zero rewards in the store."""
    problems = [Problem(prompt=r.text, answer=r.answer) for r in records]
    timed = _TimedEnvironment(stage.env, stage.tally.clock)
    groups = run_episodes(
        engine,
        timed,
        problems,
        [list(r.prompt_ids) for r in records],
        n=group_size,
        params=params,
        limits=stage.limits,
        decode=decode,
        overlap=stage.overlap,
    )
    flat = [t for group in groups for t in group]
    check_error_budget(flat, stage.max_error_frac, stage.name)
    stage.tally.add(flat)
    scores = score_episodes(reward_fn, groups, [r.answer for r in records], decode)
    return [
        [trajectory_sample(t, s) for t, s in zip(group, group_scores)] for group, group_scores in zip(groups, scores)
    ]


class _TimedEnvironment:
    """An environment whose episodes' calls run on the stage's ``EnvClock``."""

    def __init__(self, env: Environment, clock: EnvClock) -> None:
        self.env, self.clock = env, clock
        self.stop_strings = env.stop_strings

    def start(self, problem: Problem) -> Episode:
        return _TimedEpisode(self.env.start(problem), self.clock)

    def close(self) -> None:
        self.env.close()
