"""Rollout engine protocol: what phase 1 of a stage needs from an inference engine.

An engine holds the frozen behaviour policy β of a stage. It loads a Hugging Face directory (or
receives ``(name, tensor)`` weights from the trainer), samples ``n`` responses per prompt and
returns, for every sampled token, its behaviour log-prob

    b_t = log_softmax(raw_logits_t / T)[a_t]

with top_p = 1 and top_k off: the same distribution the trainer scores, so that the importance
ratio ρ_t = exp(log π_θ(a_t | s_t) − b_t) is exactly 1 at the first update of a stage. ``release()``
frees the engine's memory before the optimizer phase.

Engines are built by name through a small registry (``build_engine``); the heavy modules
(transformers, SGLang, vLLM) are imported only when their engine is built.

    engine = build_engine("transformers", "runs/demo/hf", batch_size=64)
    groups = engine.generate(prompt_ids, n=8, params=SamplingParams(max_new_tokens=32, seed=3))
    engine.release()
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

from megatron_mugrpo.errors import InputError

if TYPE_CHECKING:
    import torch

    from megatron_mugrpo.rollout.placement import EnginePlacement

FINISH_REASONS = ("stop", "length")
"""'stop': the response ends with a sampled EOS token; 'length': it hit max_new_tokens."""

ProgressCallback = Callable[[int], None]
"""Called with the number of sequences finished since the previous call (tqdm.update style)."""

MIN_TEMPERATURE = 1e-2
"""Lowest sampling temperature accepted for training data. Below it the tempered distribution is
all but greedy: stored log-probs sit at 0 or far below, and the importance ratio carries no signal.
Engines also change meaning there: SGLang decodes greedily below 1e-6 and then returns T = 1
log-probs, which would bias every ratio silently."""


class EngineOutputError(InputError, ValueError):
    """An engine returned something the rollout dataset must not store (NaN log-prob, bad id, ...)."""


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """Sampling settings of one generation call. top_p = 1 and top_k off are not knobs on purpose:
    truncated sampling would make the stored log-probs differ from log_softmax(logits / T)."""

    max_new_tokens: int
    """Response length cap; a response that reaches it finishes with reason 'length'."""
    temperature: float = 1.0
    """T: logits are divided by T before the softmax, for sampling and for the stored log-probs."""
    seed: int = 0
    """Seed of the sampling RNG (bitwise reproducible with the transformers engine on CPU)."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens={self.max_new_tokens} must be >= 1")
        if not (self.temperature >= MIN_TEMPERATURE and math.isfinite(self.temperature)):
            raise ValueError(
                f"SamplingParams.temperature={self.temperature} must be a finite number >= {MIN_TEMPERATURE} "
                "(lower temperatures are near-greedy: see rollout.engine.MIN_TEMPERATURE)"
            )


def derive_seed(*parts: int) -> int:
    """A 31-bit seed that depends on every part (stable across runs, platforms and Python versions)."""
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(1)[0] & 0x7FFFFFFF)


@dataclass
class Generation:
    """One sampled response."""

    response_ids: list[int]
    """Generated token ids; the EOS token is included (and scored) when finish_reason == 'stop'."""
    logprobs: list[float]
    """Behaviour log-prob of each generated token at temperature T; same length as response_ids."""
    finish_reason: str
    """'stop' or 'length' (see FINISH_REASONS)."""
    versions: list[int] | None = field(default=None, kw_only=True)
    """Policy version of the weights that sampled each token, when the engine was given an ``Interrupt``
    (partial rollouts: weights may change between two tokens); None otherwise. Keyword-only, so that
    subclasses (``RoutedGeneration``) add fields without defaults after it."""


KV_MODES = ("recompute", "keep")
"""What a partial rollout does with a sequence's KV cache when the weights change mid-sequence:
recompute it under the new weights (the tokens after the switch are sampled from exactly the new
policy) or keep the old weights' keys and values (no extra forward; those tokens' log-probs are then
the engine's, not the new policy's: the trainer's first ratio is off by the gap)."""


@dataclass(frozen=True, kw_only=True)
class Interrupt:
    """Partial rollouts: what an engine does between two decode steps (``async.partial_rollout``).

    The engine calls ``between_steps()`` before every decode forward; it applies newly published weights
    when there are some (``load_weights``) and returns True when it did. In-flight sequences then go on
    under the new weights, their KV cache recomputed or kept (``kv``), and every token records
    ``version()``, the version of the weights that sampled it (``Generation.versions``).
    """

    between_steps: Callable[[], bool]
    version: Callable[[], int]
    kv: str = "recompute"

    def __post_init__(self) -> None:
        if self.kv not in KV_MODES:
            raise ValueError(f"Interrupt.kv={self.kv!r} is not one of {KV_MODES}")


@runtime_checkable
class RolloutEngine(Protocol):
    """What the staged loop needs from an inference engine."""

    vocab_size: int
    """Ids the model can emit (rows of its output layer, unpadded): valid ids are [0, vocab_size)."""

    def load_hf_dir(self, path: str) -> None:
        """(Re)load all weights from a local Hugging Face directory with the same architecture."""

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace the weights with full, Hugging Face-named tensors (e.g. ``conversion.export_hf``)."""

    def generate(
        self,
        prompts: list[list[int]],
        n: int | list[int],
        params: SamplingParams,
        progress: ProgressCallback | None = None,
    ) -> list[list[Generation]]:
        """Sample ``n`` (or ``n[i]`` for prompt i) responses per prompt; result[i] lists prompt i's."""

    def release(self) -> None:
        """Free the engine's memory before the optimizer phase. The weights are gone afterwards:
        ``load_hf_dir`` or ``load_weights`` (the next stage's policy) must come before ``generate``."""


def shutdown_engine(engine: RolloutEngine) -> None:
    """Stop ``engine`` for good: its ``shutdown()`` where it has one (SGLang's processes), else ``release()``.

    SGLang's ``Engine.shutdown()`` kills every child process of the caller, so call it after the
    caller's own pools have closed, or restart them afterwards (``rewards.VerifierPool`` replaces
    workers it finds dead).
    """
    stop = getattr(engine, "shutdown", None)
    if callable(stop):
        stop()
    else:
        engine.release()


def responses_per_prompt(n: int | Sequence[int], num_prompts: int) -> list[int]:
    """Normalise ``n`` (one count for all prompts, or one per prompt as VIGOR allocates) to a list."""
    if isinstance(n, int):
        if n < 1:
            raise ValueError(f"n={n} responses per prompt must be >= 1")
        return [n] * num_prompts
    counts = [int(c) for c in n]
    if len(counts) != num_prompts:
        raise ValueError(f"n has {len(counts)} per-prompt counts but {num_prompts} prompts were given")
    negative = [i for i, c in enumerate(counts) if c < 0]
    if negative:
        raise ValueError(f"n must be >= 0 for every prompt; prompts {negative[:5]} have negative counts")
    return counts


def check_prompt_ids(prompts: Sequence[Sequence[int]], vocab_size: int) -> None:
    """Raise ValueError when a prompt is empty or holds an id outside [0, vocab_size)."""
    for i, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise ValueError(f"prompt {i} is empty: every prompt needs at least one token")
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(
                f"prompt {i} holds token ids {bad[:5]} outside the model vocabulary [0, {vocab_size}): "
                "was it tokenized with another model's tokenizer?"
            )


def validate_generations(
    generations: Sequence[Sequence[Generation]],
    counts: Sequence[int],
    *,
    vocab_size: int,
    max_new_tokens: int,
    engine: str,
) -> None:
    """Reject engine output that the rollout dataset must not store.

    Checks per response: as many log-probs as tokens, every id in [0, vocab_size), every log-prob
    finite and <= 0, a known finish reason, at most max_new_tokens tokens; and the per-prompt counts.
    """
    if len(generations) != len(counts):
        raise EngineOutputError(f"{engine} engine returned {len(generations)} prompt groups for {len(counts)} prompts")
    for i, (group, expected) in enumerate(zip(generations, counts)):
        if len(group) != expected:
            raise EngineOutputError(
                f"{engine} engine returned {len(group)} responses for prompt {i}, expected {expected}"
            )
        for j, gen in enumerate(group):
            problem = _generation_problem(gen, vocab_size, max_new_tokens)
            if problem:
                raise EngineOutputError(f"{engine} engine, prompt {i} response {j}: {problem}")


def _generation_problem(gen: Generation, vocab_size: int, max_new_tokens: int) -> str:
    """Describe what is wrong with one response, or return '' when it is valid."""
    if len(gen.response_ids) != len(gen.logprobs):
        return f"{len(gen.response_ids)} token ids but {len(gen.logprobs)} log-probs"
    if gen.versions is not None and len(gen.versions) != len(gen.response_ids):
        return f"{len(gen.response_ids)} token ids but {len(gen.versions)} token versions"
    if gen.finish_reason not in FINISH_REASONS:
        return f"finish_reason {gen.finish_reason!r} is not one of {FINISH_REASONS}"
    if len(gen.response_ids) > max_new_tokens:
        return f"{len(gen.response_ids)} tokens exceed max_new_tokens={max_new_tokens}"
    bad_ids = [t for t in gen.response_ids if not 0 <= t < vocab_size]
    if bad_ids:
        return f"token ids {bad_ids[:5]} are outside the vocabulary [0, {vocab_size})"
    bad_lp = [(t, lp) for t, lp in enumerate(gen.logprobs) if not (math.isfinite(lp) and lp <= 0.0)]
    if bad_lp:
        return f"log-probs at positions {bad_lp[:5]} are not finite numbers <= 0"
    return ""


# --------------------------------------------------------------------------------------------------
# Registry. Values are "module:attribute" strings until first use so that importing this module
# never imports transformers or SGLang; register_engine() also accepts ready objects. Each engine
# module defines its engine class and the dataclass of its knobs (the ``rollout.<name>.*`` section,
# whose fields are the engine's constructor keywords): a new engine is one file and one entry here.
# --------------------------------------------------------------------------------------------------

EngineFactory = Callable[..., RolloutEngine]

_ENGINES: dict[str, EngineFactory | str] = {
    "transformers": "megatron_mugrpo.rollout.transformers_engine:TransformersEngine",
    "sglang": "megatron_mugrpo.rollout.sglang_engine:SGLangEngine",
    "vllm": "megatron_mugrpo.rollout.vllm_engine:VLLMEngine",
}
_ENGINE_CONFIGS: dict[str, type | str] = {
    "transformers": "megatron_mugrpo.rollout.transformers_engine:TransformersEngineConfig",
    "sglang": "megatron_mugrpo.rollout.sglang_engine:SGLangEngineConfig",
    "vllm": "megatron_mugrpo.rollout.vllm_engine:VLLMEngineConfig",
}
"""Each engine's config dataclass. Importing it imports the engine's module, which must therefore
import its heavy library (transformers' models, SGLang) only when the engine is built."""


def register_engine(name: str, factory: EngineFactory | str, config: type | str | None = None) -> None:
    """Add an engine: ``factory(hf_dir, **kwargs)`` returns a RolloutEngine (or 'module:attr').

    ``config`` is the dataclass of its knobs (or 'module:attr'); the ``rollout`` section of the run
    config gets it as ``rollout.<name>`` when ``rollout.config`` is first imported, so register before that.
    """
    if name in _ENGINES:
        raise ValueError(f"rollout engine {name!r} is already registered")
    _ENGINES[name] = factory
    if config is not None:
        _ENGINE_CONFIGS[name] = config


def available_engines() -> tuple[str, ...]:
    return tuple(sorted(_ENGINES))


def build_engine(name: str, hf_dir: str, **kwargs: Any) -> RolloutEngine:
    """Build the engine registered as ``name`` on the Hugging Face directory ``hf_dir``."""
    return engine_factory(name)(hf_dir, **kwargs)


def engine_factory(name: str) -> EngineFactory:
    """The factory registered as ``name`` (imported on first use)."""
    if name not in _ENGINES:
        raise ValueError(f"unknown rollout engine {name!r}; choose one of {available_engines()} (rollout.engine)")
    factory = _ENGINES[name]
    if isinstance(factory, str):
        factory = _resolve(factory)
        _ENGINES[name] = factory
    return factory


def interruptible(name: str) -> bool:
    """Whether the engine registered as ``name`` takes an ``Interrupt`` (applies new weights between two
    decode steps: partial rollouts): its class says so with ``interruptible = True``."""
    return bool(getattr(engine_factory(name), "interruptible", False))


def engine_configs() -> dict[str, type]:
    """Engine name → the dataclass of its ``rollout.<name>.*`` knobs, for the engines that have knobs."""
    for name, config in list(_ENGINE_CONFIGS.items()):
        if isinstance(config, str):
            _ENGINE_CONFIGS[name] = _resolve(config)
    return {name: config for name, config in sorted(_ENGINE_CONFIGS.items()) if not isinstance(config, str)}


def _resolve(target: str) -> Any:
    module_name, attr = target.split(":")
    return getattr(importlib.import_module(module_name), attr)


class EngineSettings(Protocol):
    """What building and sampling read of the ``rollout`` section (``rollout.config.RolloutConfig``)."""

    engine: str
    """The registered engine; its knobs are the section's attribute of the same name."""
    temperature: float
    max_new_tokens: int


def engine_kwargs(
    rollout: EngineSettings, *, seed: int = 0, placement: EnginePlacement | None = None
) -> dict[str, Any]:
    """Constructor keywords of the configured engine: its own section ``rollout.<engine>.*``, plus the
    run seed for an engine that seeds its sampler at construction (SGLang's ``random_seed``; the
    transformers engine takes a seed with every call instead).

    With a ``placement`` (this rank hosts an engine group), an engine that takes them gets the group's
    layout: ``tp_size`` workers from the host's local GPU ``base_gpu_id`` (SGLang), and a seed of its
    own per engine so that engines do not draw the same random stream.
    """
    knobs = getattr(rollout, rollout.engine, None)
    kwargs = dataclasses.asdict(knobs) if knobs is not None else {}
    accepted = inspect.signature(engine_factory(rollout.engine)).parameters
    if "seed" in accepted:
        kwargs["seed"] = seed + (placement.engine_index if placement is not None else 0)
    if placement is not None:
        layout = {"tp_size": placement.tensor_parallel, "base_gpu_id": placement.base_gpu_id}
        kwargs |= {key: value for key, value in layout.items() if key in accepted}
    return kwargs


def build_engine_from_config(
    rollout: EngineSettings,
    hf_dir: str,
    *,
    seed: int = 0,
    placement: EnginePlacement | None = None,
    **overrides: Any,
) -> RolloutEngine:
    """``build_engine(rollout.engine, hf_dir, ...)`` with the config's knobs (overrides win)."""
    return build_engine(rollout.engine, hf_dir, **(engine_kwargs(rollout, seed=seed, placement=placement) | overrides))


def sampling_params(rollout: EngineSettings, *, seed: int) -> SamplingParams:
    """The stage's SamplingParams from the rollout config."""
    return SamplingParams(temperature=rollout.temperature, max_new_tokens=rollout.max_new_tokens, seed=seed)
