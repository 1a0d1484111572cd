"""The reward registry and the ``reward.*`` config section: which verifier scores which responses.

A reward kind is one class registered here with the dataclass of its options; the ``reward``
section gets one subsection per kind (``reward.math.*``, ``reward.code.*``), checked like any other
section, so a new reward is one module plus one ``register_reward`` line:

    math   rewards/math_reward.py   the last answer (boxed, last number, gsm8k, <answer>) vs the reference
    code   rewards/code.py          the last fenced program run on the problem's tests in the sandbox
    qa     rewards/qa.py            the last <answer> vs the accepted answers, exact match after SQuAD normalisation

The training data's responses are scored by ``reward.kind``; each evaluation benchmark by its own
``reward`` (default: ``reward.kind``). ``RewardSet`` builds each kind a run needs once.

    rewards = RewardSet(cfg.reward, kinds=("code", "math"))
    rewards.score(responses, answers)        # the training kind's scores: [(1.0, "correct"), ...]
    rewards.for_kind("math").score(...)      # a benchmark's
    rewards.close()

Every score is ``Score(reward, reason)``, a pair; rewards that run tests add the tests passed and run
(``pass_fraction``), so both the full-pass rate and the test pass rate are logged whichever one is
the reward.
"""

from __future__ import annotations

import importlib
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from megatron_mugrpo.errors import InputError, require, with_registry_sections
from megatron_mugrpo.metric_names import REWARD, ROLLOUT_PREFIX, stat_name


class RewardError(InputError, RuntimeError):
    """The reward function cannot run (unknown name, bad arguments, verifier pool cannot start)."""


class RewardFn(Protocol):
    """Scores decoded responses against reference answers."""

    def score(self, responses: list[str], answers: list[str]) -> list[tuple[float, str]]:
        """One (reward, reason) per response; ``answers[i]`` is the reference for ``responses[i]``."""
        ...

    def start(self) -> None:
        """Start what the first ``score`` would start (worker processes) without waiting for it."""
        ...

    def close(self) -> None:
        """Free the reward's resources (worker processes)."""
        ...


_FACTORIES: dict[str, Callable[..., RewardFn] | str] = {}
_OPTIONS: dict[str, type | str] = {}


def register_reward(name: str, factory: Callable[..., RewardFn] | str, options: type | str) -> None:
    """Add a reward kind: ``factory(*, workers, timeout_s, options)`` returns a ``RewardFn`` and
    ``options`` is the dataclass of its ``reward.<name>.*`` knobs (either may be 'module:attr', imported
    on first use). Register before ``megatron_mugrpo.config`` is imported: the section is built then."""
    if name in _FACTORIES:
        raise RewardError(f"reward {name!r} is already registered")
    _FACTORIES[name] = factory
    _OPTIONS[name] = options


def available_rewards() -> tuple[str, ...]:
    return tuple(sorted(_FACTORIES))


def reward_options() -> dict[str, type]:
    """Reward kind → the dataclass of its ``reward.<kind>.*`` options."""
    for name, options in list(_OPTIONS.items()):
        if isinstance(options, str):
            _OPTIONS[name] = _resolve(options)
    return {name: options for name, options in sorted(_OPTIONS.items()) if not isinstance(options, str)}


def build_reward(kind: str, *, workers: int, timeout_s: float, options: Any = None) -> RewardFn:
    """Instantiate reward ``kind`` (``options``: its options dataclass; None: the defaults)."""
    if kind not in _FACTORIES:
        raise RewardError(f"unknown reward {kind!r}; registered: {available_rewards()} (reward.kind)")
    factory = _FACTORIES[kind]
    if isinstance(factory, str):
        factory = _FACTORIES[kind] = _resolve(factory)
    return factory(workers=workers, timeout_s=timeout_s, options=options or reward_options()[kind]())


def _resolve(target: str) -> Any:
    module_name, attr = target.split(":")
    return getattr(importlib.import_module(module_name), attr)


register_reward("math", "megatron_mugrpo.rewards.math_reward:MathReward", "megatron_mugrpo.rewards.answers:MathOptions")
register_reward("code", "megatron_mugrpo.rewards.code:CodeReward", "megatron_mugrpo.rewards.code:CodeRewardConfig")
register_reward("qa", "megatron_mugrpo.rewards.qa:QaReward", "megatron_mugrpo.rewards.qa:QaOptions")


@dataclass(kw_only=True)
class _RewardSettings:
    """``reward.*``: the verifier of the training data (``kind``) and the pool that runs it."""

    kind: str = "math"
    """The training data's reward: 'math', 'code' or 'qa'; its options are the subsection of that name.
    Each evaluation benchmark may name its own (``eval.benchmarks[].reward``)."""
    workers: int = 2
    """Processes (math: math-verify workers) or sandbox slots (code) scoring at once."""
    timeout_s: float = 5.0
    """Math: wall-clock bound on verifying one answer (a timeout scores 0, reason 'timeout'). Code
    programs are bounded by reward.code's limits instead."""

    def __post_init__(self) -> None:
        require(self.kind in available_rewards(), f"reward.kind={self.kind!r} is not one of {available_rewards()}")
        require(self.workers >= 1, f"reward.workers={self.workers} must be >= 1")
        require(self.timeout_s > 0, f"reward.timeout_s={self.timeout_s} must be > 0")


RewardConfig = with_registry_sections(_RewardSettings, reward_options())
"""The ``reward`` section: the settings above plus one options section per registered reward."""


def reward_record(settings: Any) -> dict[str, Any]:
    """The training reward and its options as plain values: a rollout store records it, and a resumed
    store scored by another reward (or other options) is regenerated, not mixed."""
    return {"kind": settings.kind, "options": asdict(getattr(settings, settings.kind))}


class RewardSet:
    """The rewards a run uses, one per kind, built once: the training data's (``score``) and the
    benchmarks' (``for_kind``). Starting and closing apply to all of them."""

    def __init__(self, settings: Any, kinds: Iterable[str] = ()) -> None:
        self.kind = settings.kind
        self._rewards: dict[str, RewardFn] = {}
        try:
            for kind in dict.fromkeys((settings.kind, *kinds)):
                options = getattr(settings, kind, None)
                self._rewards[kind] = build_reward(
                    kind, workers=settings.workers, timeout_s=settings.timeout_s, options=options
                )
        except BaseException:
            self.close()
            raise

    def for_kind(self, kind: str) -> RewardFn:
        if kind not in self._rewards:
            raise RewardError(f"reward {kind!r} was not built for this run (built: {sorted(self._rewards)})")
        return self._rewards[kind]

    def score(self, responses: list[str], answers: list[str]) -> list[tuple[float, str]]:
        return self._rewards[self.kind].score(responses, answers)

    def start(self) -> None:
        for reward in self._rewards.values():
            reward.start()

    def close(self) -> None:
        for reward in self._rewards.values():
            reward.close()


def reason_counts(results: Sequence[tuple[float, str]], known: Sequence[str] = ()) -> dict[str, int]:
    """How many results carry each reason (every ``known`` reason present, zeros included)."""
    counts = Counter(reason for _, reason in results)
    return {reason: counts.get(reason, 0) for reason in (*known, *sorted(set(counts) - set(known)))}


def reward_metrics(
    results: Sequence[tuple[float, str]], prefix: str = ROLLOUT_PREFIX, known: Sequence[str] = ()
) -> dict[str, float]:
    """``{prefix}reason_<reason>`` counts, ``{prefix}reward_mean``, ``{prefix}test_pass_rate`` when the
    scores carry pass fractions and ``{prefix}answer_f1`` when they carry F1 (qa)."""
    metrics = {f"{prefix}reason_{reason}": float(n) for reason, n in reason_counts(results, known).items()}
    metrics[f"{prefix}{stat_name(REWARD)}"] = sum(r for r, _ in results) / len(results) if results else 0.0
    fractions = [f for f in (getattr(s, "pass_fraction", None) for s in results) if f is not None]
    if fractions:
        metrics[f"{prefix}test_pass_rate"] = sum(fractions) / len(fractions)
    f1 = [f for f in (getattr(s, "f1", None) for s in results) if f is not None]
    if f1:  # qa: token F1 beside the exact-match reward
        metrics[f"{prefix}answer_f1"] = sum(f1) / len(f1)
    return metrics
