"""Groups of multi-turn episodes: the step a rollout stage takes with an environment instead of ``generate``.

For each prompt, ``n`` episodes start from its problem; the engine decodes them all as trajectories
(``TransformersEngine.generate_trajectories``), and the reward scores each trajectory's policy text
with its end reason, so that a trajectory cut short by the environment or a limit scores 0 with that
reason (``QaReward.score_episodes``).

    groups = run_episodes(engine, env, problems, prompt_ids, n=8, params=params, limits=limits, decode=decode)
    scores = score_episodes(reward, groups, answers, decode)
    metrics = trajectory_metrics([t for group in groups for t in group])
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from megatron_mugrpo.envs.base import Environment, EnvLimits, Episode, Problem
from megatron_mugrpo.envs.trajectory import Trajectory


class MultiTurnEngine(Protocol):
    """What ``run_episodes`` needs from a rollout engine."""

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
) -> list[list[Trajectory]]:
    """``n`` trajectories per problem, grouped by problem in order (``params``: the engine's SamplingParams)."""
    if len(problems) != len(prompt_ids):
        raise ValueError(f"{len(problems)} problems but {len(prompt_ids)} prompts")
    if n < 1:
        raise ValueError(f"n={n} must be >= 1 (trajectories per problem)")
    episodes = [env.start(problem) for problem in problems for _ in range(n)]
    prompts = [list(ids) for ids in prompt_ids for _ in range(n)]
    flat = engine.generate_trajectories(
        prompts, episodes, params, limits=limits, decode=decode, stop_strings=env.stop_strings
    )
    return [flat[i * n : (i + 1) * n] for i in range(len(problems))]


def policy_text(trajectory: Trajectory, decode: Callable[[list[int]], str]) -> str:
    """The policy's turns as text, observations left out: the answer a reward reads is the policy's own,
    never one a retrieved document happens to contain."""
    return "".join(decode(trajectory.token_ids[start:end]) for start, end in trajectory.turns)


def score_episodes(
    reward: Any, groups: Sequence[Sequence[Trajectory]], answers: Sequence[str], decode: Callable[[list[int]], str]
) -> list[list[Any]]:
    """Each trajectory's score: ``reward.score_episodes(texts, answers, end_reasons)`` (the qa reward's),
    grouped like ``groups``; ``answers[i]`` is problem i's reference."""
    if len(groups) != len(answers):
        raise ValueError(f"{len(groups)} groups but {len(answers)} answers")
    texts = [policy_text(t, decode) for group in groups for t in group]
    references = [answer for group, answer in zip(groups, answers) for _ in group]
    reasons = [t.end_reason for group in groups for t in group]
    flat = reward.score_episodes(texts, references, reasons)
    out, start = [], 0
    for group in groups:
        out.append(flat[start : start + len(group)])
        start += len(group)
    return out
