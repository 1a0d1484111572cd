"""``rollout.*``: phase 1 of a stage, the frozen behaviour policy generating the stage's dataset.

The section's own knobs are listed here; each registered engine adds its knobs as a subsection of
its name (``rollout.transformers.*``, ``rollout.sglang.*``; the engine registry in
``rollout.engine``), so a new engine brings its config with its own module. VIGOR's knobs
(``rollout.vigor.*``) belong to ``algorithms.allocation``, the quantizer's (``rollout.modelopt.*``)
to ``rollout.quantization``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_mugrpo.algorithms.allocation import ALLOCATIONS, VigorConfig
from megatron_mugrpo.errors import require, with_registry_sections
from megatron_mugrpo.rollout.engine import MIN_TEMPERATURE, available_engines, engine_configs
from megatron_mugrpo.rollout.quantization import ModelOptConfig, available_schemes, scheme_engine_problem


@dataclass(kw_only=True)
class _RolloutSettings:
    """Phase 1: the frozen behaviour policy generates the stage's static dataset."""

    engine: str = "transformers"
    """'transformers' (CPU default, also GPU) or 'sglang' (GPU, optional extra); its knobs are the
    section of the same name (one per registered engine)."""
    group_size: int = 8
    """G: responses per prompt (fixed allocation)."""
    temperature: float = 1.0
    """Sampling temperature T; the trainer scores log_softmax(logits / T) with the same T."""
    top_p: float = 1.0
    """Must stay 1.0: truncated sampling would bias the importance ratio."""
    top_k: int = 0
    """Must stay 0 (off) for the same reason."""
    max_new_tokens: int = 512
    """Response length cap; longer responses finish with reason 'length'."""
    max_prompt_tokens: int = 512
    """Prompts longer than this are rejected at load time."""
    shard_groups: int = 64
    """Prompt groups per on-disk shard of the rollout store (the unit of resume)."""
    allocation: str = "fixed"
    """'fixed' (G per prompt) or 'vigor'."""
    vigor: VigorConfig = field(default_factory=VigorConfig)
    """VIGOR's knobs (rollout.allocation == 'vigor')."""
    tensor_parallel: int = 1
    """Ranks per rollout engine group. The group's first rank hosts one engine (SGLang ``tp_size``), so
    the world runs world_size / tensor_parallel engines; it must divide the world size and the ranks
    per node (checked at start-up, see rollout/placement.py)."""
    cpu_threads: int = 0
    """torch threads of each engine host on CPU while it generates or evaluates; 0 splits the node's
    cores evenly among the hosts on it."""
    quantization: str = "none"
    """Behaviour policy precision: 'none' (the trainer's weights as they are), 'fp8', 'fp8_per_channel'
    or 'nvfp4' (GPU only), quantized with NVIDIA Model Optimizer each stage (rollout.quantization module)."""
    modelopt: ModelOptConfig = field(default_factory=ModelOptConfig)
    """Calibration of the quantized behaviour policy (used when quantization != 'none')."""
    progress_timeout_s: float = 600.0
    """The engine watchdog (rollout.watchdog), while an engine host generates (a stage's rollout,
    evaluation): an engine that finishes no row for this many seconds counts as hung, is shut down and
    rebuilt. Must exceed the slowest progress step: one batch
    of ``rollout.transformers.batch_size`` rows, or one SGLang call (a shard's round, up to 4096 rows),
    generated to ``max_new_tokens``; and stay well below ``parallel.timeout_s``, which the other ranks
    wait at the stage's end while an engine is restarted."""
    max_restarts: int = 2
    """Restarts of a failed (raised or hung) engine allowed per engine host and weight sync, i.e. within
    one stage's rollout phase. Past them the run stops with an error naming the engine, the stage and
    the last error. 0: a failure stops the run at once (and no host copy of the weights is kept; above
    0 each engine host keeps one copy of the stage's weights in host memory to rebuild from)."""

    def __post_init__(self) -> None:
        require(
            self.engine in available_engines(), f"rollout.engine={self.engine!r} is not one of {available_engines()}"
        )
        require(self.allocation in ALLOCATIONS, f"rollout.allocation={self.allocation!r} is not one of {ALLOCATIONS}")
        require(self.group_size >= 2, f"rollout.group_size={self.group_size} must be >= 2 for group advantages")
        require(
            self.temperature >= MIN_TEMPERATURE,
            f"rollout.temperature={self.temperature} must be >= {MIN_TEMPERATURE}: lower temperatures are near-greedy "
            "(the stored log-probs carry no signal, and SGLang decodes greedily below 1e-6 with T = 1 log-probs)",
        )
        require(
            self.top_p == 1.0 and self.top_k == 0,
            "rollout.top_p must be 1.0 and rollout.top_k 0: truncated sampling makes the stored behaviour "
            "log-probs differ from log_softmax(logits / T) and biases the importance ratio",
        )
        for name in ("max_new_tokens", "max_prompt_tokens", "shard_groups"):
            require(getattr(self, name) >= 1, f"rollout.{name} must be >= 1, got {getattr(self, name)}")
        require(
            self.quantization in available_schemes(),
            f"rollout.quantization={self.quantization!r} is unknown; choose one of {available_schemes()}",
        )
        problem = scheme_engine_problem(self.quantization, self.engine)
        require(not problem, problem)
        require(
            self.tensor_parallel >= 1,
            f"rollout.tensor_parallel={self.tensor_parallel} must be >= 1 (ranks per rollout engine group)",
        )
        require(self.cpu_threads >= 0, f"rollout.cpu_threads={self.cpu_threads} must be >= 0 (0: share the cores)")
        require(
            self.progress_timeout_s > 0,
            f"rollout.progress_timeout_s={self.progress_timeout_s} must be > 0 seconds (how long an engine may "
            "finish no row before it is restarted; raise it for long responses rather than turning it off)",
        )
        require(
            self.max_restarts >= 0,
            f"rollout.max_restarts={self.max_restarts} must be >= 0 (0: the first engine failure stops the run)",
        )


RolloutConfig = with_registry_sections(_RolloutSettings, engine_configs())
"""The ``rollout`` section: the settings above plus one knob section per registered engine."""
