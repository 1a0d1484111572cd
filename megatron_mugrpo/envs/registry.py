"""The environment registry and the ``env.*`` config section: which environment a multi-turn rollout talks to.

Like the rewards' registry: an environment kind is one class registered here with the dataclass of its
options, and the ``env`` section gets one subsection per kind (``env.search.*``), so a new environment
is one module plus one ``register_env`` line:

    search   envs/search.py   Search-R1: <search>q</search> → <information>top-k documents</information>,
                              ends on <answer>…</answer>; BM25 over HTTP (``mugrpo serve-search``)

    env = build_env(cfg_env, tokenizer)      # cfg_env: an EnvConfig; tokenizer encodes observations
    episode = env.start(Problem(prompt=..., answer=...))
    env.close()
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from megatron_mugrpo.envs.base import EnvError, Environment, EnvLimits
from megatron_mugrpo.errors import require, with_registry_sections

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


_FACTORIES: dict[str, Callable[..., Environment] | str] = {}
_OPTIONS: dict[str, type | str] = {}


def register_env(name: str, factory: Callable[..., Environment] | str, options: type | str) -> None:
    """Add an environment kind: ``factory(*, tokenizer, limits, options)`` returns an ``Environment`` and
    ``options`` is the dataclass of its ``env.<name>.*`` knobs (either may be 'module:attr', imported on
    first use). Register before the ``env`` section is built (this module's import)."""
    if name in _FACTORIES:
        raise EnvError(f"environment {name!r} is already registered")
    _FACTORIES[name] = factory
    _OPTIONS[name] = options


def available_envs() -> tuple[str, ...]:
    return tuple(sorted(_FACTORIES))


def env_options() -> dict[str, type]:
    """Environment kind → the dataclass of its ``env.<kind>.*`` options."""
    for name, options in list(_OPTIONS.items()):
        if isinstance(options, str):
            _OPTIONS[name] = _resolve(options)
    return {name: options for name, options in sorted(_OPTIONS.items()) if not isinstance(options, str)}


def _resolve(target: str) -> Any:
    module_name, attr = target.split(":")
    return getattr(importlib.import_module(module_name), attr)


register_env("search", "megatron_mugrpo.envs.search:SearchEnvironment", "megatron_mugrpo.envs.search:SearchOptions")


@dataclass(kw_only=True)
class _EnvSettings(EnvLimits):
    """``env.*``: the environment of multi-turn rollouts (``kind``), its limits and its failure budget."""

    enabled: bool = False
    """Roll out multi-turn trajectories against the environment ``kind`` (off: single-turn responses)."""
    kind: str = "search"
    """The environment: 'search'; its options are the subsection of that name."""
    max_error_frac: float = 0.1
    """Largest fraction of a stage's trajectories that may end in env_error / env_timeout before the run
    stops with an error naming the environment and its last error."""
    overlap: str = "auto"
    """Whether environment calls overlap decoding (``env_overlap``): 'always', 'never', or 'auto' (overlap in the
    async loop's rollout workers, not in staged rollout phases). Overlapping, a row whose turn ended waits for its
    observation in the background while the batch's other rows go on decoding, instead of every row waiting
    for the step's calls. Trajectories then depend on when answers arrive, so a run is no longer reproducible
    bitwise (tokens, masks, log-probs, limits and end reasons keep every other guarantee). Transformers
    engine only (``OVERLAP_ENGINES``); evaluation never overlaps."""

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.kind in available_envs(), f"env.kind={self.kind!r} is not one of {available_envs()}")
        require(0.0 <= self.max_error_frac <= 1.0, f"env.max_error_frac={self.max_error_frac} must be in [0, 1]")
        # The loader turns a YAML boolean into the string 'True' / 'False' for this str key.
        yaml_bool = " (YAML reads on/off/true/false as booleans)" if str(self.overlap) in ("True", "False") else ""
        require(
            isinstance(self.overlap, str) and self.overlap in OVERLAP_MODES,
            f"env.overlap={self.overlap!r}{yaml_bool} is not one of {OVERLAP_MODES}: 'always' overlaps environment "
            "calls with decoding, 'never' waits for them, 'auto' overlaps in async runs only",
        )


EnvConfig = with_registry_sections(_EnvSettings, env_options())
"""The ``env`` section: the settings above plus one options section per registered environment."""

OVERLAP_MODES = ("auto", "always", "never")
"""Values of ``env.overlap`` (not on/off: YAML reads those as booleans)."""
OVERLAP_ENGINES = ("transformers",)
"""Engines whose decode loop goes on with the other rows while a row waits for its observation
(``generate_trajectories(overlap=True)``); vLLM and SGLang send each turn as one request per row."""


def env_overlap(settings: Any, *, asynchronous: bool, engine: str) -> bool:
    """Whether a rollout phase overlaps environment calls with decoding (``env.overlap``). 'auto' is on in the
    async loop's workers: their batches already depend on timing (which policy version a batch is sampled
    by depends on when weights arrive), so overlap costs them no reproducibility, and rollout throughput is
    what a worker is for. It is off in staged runs, whose stages are reproducible bitwise from the seed (a
    killed stage regenerates its missing shards identically). False without an environment."""
    if settings is None or not settings.enabled or engine not in OVERLAP_ENGINES:
        return False
    return settings.overlap == "always" or (settings.overlap == "auto" and asynchronous)


MULTI_TURN_ENGINES = ("transformers", "vllm", "sglang")
"""Rollout engines that decode trajectories (``generate_trajectories``)."""
MULTI_TURN_ROUTE_ENGINES = ("transformers",)
"""Engines that record MoE routes of multi-turn trajectories (prompt, policy and observation tokens) for
``moe.routing_replay=rollout``: the transformers engine files every forward's routes per row."""


def run_env_problem(
    settings: Any,
    *,
    reward_kind: str,
    engine: str,
    allocation: str,
    mode: str,
    routing_replay: str,
    partial_rollout: bool = False,
    max_prompt_tokens: int = 0,
    positions: int | None = None,
) -> str | None:
    """Why a run cannot roll out against the environment ``settings`` describes, or None (also when it is off).

    The search environment's episodes are scored by the qa reward (the answer tag, the end reasons); the
    engines of ``MULTI_TURN_ENGINES`` decode trajectories, and env.overlap=always needs one of ``OVERLAP_ENGINES``;
    VIGOR's rounds, async.partial_rollout
    (``partial_rollout``: weights switched between two decode steps) and route recording on engines outside
    ``MULTI_TURN_ROUTE_ENGINES`` do not carry trajectories yet; the asynchronous loop does (its workers hold
    the environment). A trajectory needs
    room after its prompt (``max_prompt_tokens``) within ``env.max_total_tokens``, and that within the
    model's ``positions`` (max_position_embeddings, when known before the model is loaded: the locally
    built tiny model)."""
    if not settings.enabled:
        return None
    return (
        _combination_problem(reward_kind, engine, allocation, mode, routing_replay, partial_rollout)
        or _overlap_problem(settings, engine)
        or _source_problem(settings)
        or _budget_problem(settings, max_prompt_tokens, positions)
    )


def _combination_problem(
    reward_kind: str, engine: str, allocation: str, mode: str, routing_replay: str, partial_rollout: bool
) -> str | None:
    """What of the run's other settings cannot roll out trajectories (``run_env_problem``)."""
    if reward_kind != "qa":
        return (
            f"env.enabled needs questions scored by the qa reward (data.format: qa, reward.kind: qa); the data is "
            f"scored by {reward_kind!r}"
        )
    if engine not in MULTI_TURN_ENGINES:
        return (
            f"env.enabled: rollout.engine={engine!r} cannot decode multi-turn trajectories yet;"
            f" use one of {MULTI_TURN_ENGINES}"
        )
    if allocation != "fixed":
        return (
            f"env.enabled works with rollout.allocation=fixed only (got {allocation!r}); VIGOR's rounds sample "
            "single-turn responses"
        )
    if mode == "async" and partial_rollout:
        return (
            "env.enabled cannot be combined with async.partial_rollout=true: multi-turn trajectories are decoded "
            "without the engine's between-step weight switch, so no token would record its policy version; set "
            "async.partial_rollout=false"
        )
    if routing_replay != "none" and engine not in MULTI_TURN_ROUTE_ENGINES:
        return (
            f"env.enabled with moe.routing_replay={routing_replay!r} needs the routes of every trajectory position, "
            f"observation tokens included, and rollout.engine={engine!r} records them for single-turn responses "
            f"only (its multi-turn path sends each turn as one request and keeps no routes across turns); use "
            f"rollout.engine in {MULTI_TURN_ROUTE_ENGINES} or moe.routing_replay=none"
        )
    return None


def _overlap_problem(settings: Any, engine: str) -> str | None:
    """env.overlap=always asked of an engine that cannot go on decoding while a row waits ('auto' just stays off)."""
    if settings.overlap == "always" and engine not in OVERLAP_ENGINES:
        return (
            f"env.overlap=always: rollout.engine={engine!r} sends each turn as one request and cannot decode other "
            f"rows while one waits for its observation; use rollout.engine in {OVERLAP_ENGINES} or env.overlap=auto"
        )
    return None


def _source_problem(settings: Any) -> str | None:
    """A search environment without a server to ask or a corpus to serve."""
    options = getattr(settings, settings.kind)
    if settings.kind == "search" and not (options.url or options.corpus):
        return (
            "env.enabled with env.kind=search needs env.search.url (a running `mugrpo serve-search`) or "
            "env.search.corpus (a JSONL corpus the run serves itself on loopback)"
        )
    return None


def _budget_problem(settings: Any, max_prompt_tokens: int, positions: int | None) -> str | None:
    """A token budget with no room after the prompt, or beyond the model's positions."""
    if settings.max_total_tokens <= max_prompt_tokens:
        return (
            f"env.max_total_tokens={settings.max_total_tokens} leaves no room for a trajectory after a prompt of up "
            f"to rollout.max_prompt_tokens={max_prompt_tokens}; raise it"
        )
    if positions is not None and settings.max_total_tokens > positions:
        return (
            f"env.max_total_tokens={settings.max_total_tokens} is more than the model's "
            f"model.tiny.max_position_embeddings={positions}; lower it or raise that"
        )
    return None


def env_limits(settings: Any) -> EnvLimits:
    """The limits of an ``env`` section, as ``guarded_step`` takes them."""
    return EnvLimits(
        max_turns=settings.max_turns,
        max_observation_tokens=settings.max_observation_tokens,
        max_total_tokens=settings.max_total_tokens,
        timeout_s=settings.timeout_s,
    )


def env_record(settings: Any) -> dict[str, Any]:
    """What a rollout store records about the environment that made its trajectories (resume must match it):
    the kind, the limits and the kind's options. The error budget is left out: it stops a run, it does not
    shape a trajectory."""
    limits = dataclasses.asdict(env_limits(settings))
    return {"kind": settings.kind, **limits, settings.kind: dataclasses.asdict(getattr(settings, settings.kind))}


def build_env(settings: Any, tokenizer: PreTrainedTokenizerBase) -> Environment:
    """The environment of ``settings.kind`` with its options (``settings.<kind>``)."""
    if settings.kind not in _FACTORIES:
        raise EnvError(f"unknown environment {settings.kind!r}; registered: {available_envs()} (env.kind)")
    factory = _FACTORIES[settings.kind]
    if isinstance(factory, str):
        factory = _FACTORIES[settings.kind] = _resolve(factory)
    return factory(tokenizer=tokenizer, limits=env_limits(settings), options=getattr(settings, settings.kind))
