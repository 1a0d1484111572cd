"""Typed run configuration: nested dataclasses, YAML loading and dotted command-line overrides.

A run is a YAML file in ``configs/`` plus overrides such as ``algo.mu_grpo.clip_high=5``. OmegaConf merges
the YAML and the overrides against the dataclass schema (so a misspelt key or a wrong type is an
error naming the key); each section then validates itself in ``__post_init__`` with a message that
says what to change. Components own their sections and this module composes them: each loss's
options (``algo.<loss>.*``, ``algorithms.losses``), each engine's knobs (``rollout.<engine>.*``,
``rollout/*_engine.py``), VIGOR (``rollout.vigor.*``, ``algorithms.allocation``) and the kernels
(``kernels.*``, ``kernels.config``).

    cfg = load_config("configs/demo_cpu.yaml", ["algo.mu_grpo.clip_high=5", "stages.num_stages=2"])
    cfg.stages.updates_per_stage      # μ = B_train / B_mini, derived, never typed twice
"""

from __future__ import annotations

import dataclasses
import json
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from megatron_mugrpo.algorithms.allocation import ALLOCATIONS, VigorConfig
from megatron_mugrpo.algorithms.losses import (
    AGGREGATIONS,
    GrpoOptions,
    M2poOptions,
    MuGrpoOptions,
    available_losses,
)
from megatron_mugrpo.algorithms.replay import ReplayConfig
from megatron_mugrpo.algorithms.rollout_correction import RolloutCorrectionConfig
from megatron_mugrpo.asynchronous.config import AsyncConfig
from megatron_mugrpo.errors import ConfigError, require
from megatron_mugrpo.kernels.config import KernelConfig
from megatron_mugrpo.rollout.engine import MIN_TEMPERATURE, available_engines
from megatron_mugrpo.rollout.quantization import ModelOptConfig, available_schemes, scheme_engine_problem
from megatron_mugrpo.rollout.sglang_engine import SGLangEngineConfig
from megatron_mugrpo.rollout.transformers_engine import TransformersEngineConfig

DTYPES = ("float32", "bfloat16", "float16")
"""model.dtype choices (training.setup maps them to torch dtypes)."""
MODES = ("staged", "async")
"""mode choices: the staged loop (stages.py) or asynchronous rollout workers (asynchronous/)."""

__all__ = ["ConfigError", "RunConfig", "load_config", "save_config"]


@dataclass(kw_only=True)
class TinyModelConfig:
    """Shape of the small Qwen2-architecture model built locally for the CPU demo and tests."""

    hidden_size: int = 64
    num_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 128
    max_position_embeddings: int = 256
    tie_word_embeddings: bool = True
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        require(
            self.num_attention_heads % self.num_key_value_heads == 0,
            f"model.tiny.num_attention_heads={self.num_attention_heads} must be a multiple of "
            f"model.tiny.num_key_value_heads={self.num_key_value_heads}",
        )
        require(
            self.hidden_size % self.num_attention_heads == 0,
            f"model.tiny.hidden_size={self.hidden_size} must be divisible by "
            f"model.tiny.num_attention_heads={self.num_attention_heads}",
        )


@dataclass(kw_only=True)
class ModelConfig:
    """Which policy to train."""

    hf_dir: str = ""
    """Local Hugging Face directory (config.json + safetensors + tokenizer). Empty: build the tiny
    model described by ``tiny`` (the CPU demo)."""
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    """Shape of the locally built model when ``hf_dir`` is empty."""
    dtype: str = "float32"
    """Parameter / compute dtype of the trainer: float32 (CPU), bfloat16 (GPU)."""

    def __post_init__(self) -> None:
        require(self.dtype in DTYPES, f"model.dtype={self.dtype!r} is not one of {DTYPES}")
        if self.hf_dir:
            require(
                Path(self.hf_dir).is_dir(),
                f"model.hf_dir={self.hf_dir!r} is not a directory; point it at a local Hugging Face "
                "checkpoint (nothing is downloaded at run time) or leave it empty for the tiny model",
            )


@dataclass(kw_only=True)
class ParallelConfig:
    """Megatron model parallelism; data parallelism is what the world size leaves."""

    tensor_parallel: int = 1
    """TP degree; must divide the attention heads and KV heads."""
    pipeline_parallel: int = 1
    """PP degree; must divide the number of layers."""
    micro_batch_size: int = 4
    """Sequences per micro-batch; micro-batches accumulate into one optimizer update."""
    use_distributed_optimizer: bool = False
    """Shard optimizer state across data-parallel ranks (Megatron's distributed optimizer)."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism: activations outside attention/MLP split along the sequence over
    the TP group (less activation memory). Needs CUDA and tensor_parallel > 1."""

    def __post_init__(self) -> None:
        for name in ("tensor_parallel", "pipeline_parallel", "micro_batch_size"):
            require(getattr(self, name) >= 1, f"parallel.{name} must be >= 1, got {getattr(self, name)}")
        require(
            not self.sequence_parallel or self.tensor_parallel > 1,
            "parallel.sequence_parallel=true needs parallel.tensor_parallel > 1 (it splits the sequence over "
            "the tensor-parallel group); set it to false",
        )


@dataclass(kw_only=True)
class RolloutConfig:
    """Phase 1: the frozen behaviour policy generates the stage's static dataset."""

    engine: str = "transformers"
    """'transformers' (CPU default, also GPU) or 'sglang' (GPU, optional extra); its knobs are the
    section of the same name below."""
    transformers: TransformersEngineConfig = field(default_factory=TransformersEngineConfig)
    """Knobs of the transformers engine."""
    sglang: SGLangEngineConfig = field(default_factory=SGLangEngineConfig)
    """Knobs of the SGLang engine."""
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
    reward: str = "math"
    """Reward function from the reward registry."""
    reward_timeout_s: float = 5.0
    """Wall-clock bound on verifying one answer; a timeout scores 0 with reason 'timeout'."""
    reward_workers: int = 2
    """Processes in the verification pool."""
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
        for name in ("max_new_tokens", "max_prompt_tokens", "shard_groups", "reward_workers"):
            require(getattr(self, name) >= 1, f"rollout.{name} must be >= 1, got {getattr(self, name)}")
        require(self.reward_timeout_s > 0, f"rollout.reward_timeout_s={self.reward_timeout_s} must be > 0")
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


@dataclass(kw_only=True)
class DataConfig:
    """Training prompts: a local JSONL/Parquet file, or the built-in procedural math task."""

    train_path: str = ""
    """Local JSONL or Parquet file of problems; empty uses the built-in task."""
    prompt_field: str = "problem"
    """Column holding the problem text (DeepScaleR: 'problem')."""
    answer_field: str = "answer"
    """Column holding the reference answer."""
    use_chat_template: bool = True
    """Wrap prompts with the tokenizer's chat template when it has one."""
    builtin_task: str = "arithmetic"
    """Built-in procedural task used when train_path is empty."""
    builtin_size: int = 4096
    """Problems generated for the built-in task."""
    seed: int = 0
    """Seed of the prompt order and of the built-in task generator."""

    def __post_init__(self) -> None:
        if self.train_path:
            path = Path(self.train_path)
            require(
                path.is_file(), f"data.train_path={self.train_path!r} does not exist; give a local JSONL/Parquet file"
            )
            require(
                path.suffix in (".jsonl", ".json", ".parquet"),
                f"data.train_path={self.train_path!r}: expected a .jsonl, .json or .parquet file",
            )
        require(self.builtin_size >= 1, f"data.builtin_size={self.builtin_size} must be >= 1")


@dataclass(kw_only=True)
class AlgoConfig:
    """The policy loss: which registry entry, its aggregation, and one options section per loss.

    Each loss of ``algorithms.losses`` owns its section (``algo.mu_grpo.*``, ``algo.grpo.*``, ...);
    only the chosen loss's section is used. Defaults are μ-GRPO: clip [0, 5] and the veto.
    """

    loss: str = "mu_grpo"
    """Loss registry entry: grpo | mu_grpo | m2po | m2po_clip."""
    aggregation: str = "seq_mean_token_mean"
    """seq_mean_token_mean (paper Eq. 2: token mean per response, then mean over responses) or token_mean."""
    adv_eps: float = 1e-6
    """ε in A = (R - mean R) / (std R + ε)."""
    grpo: GrpoOptions = field(default_factory=GrpoOptions)
    """Standard GRPO: clip [1 - ε, 1 + ε]."""
    mu_grpo: MuGrpoOptions = field(default_factory=MuGrpoOptions)
    """μ-GRPO: relaxed clip [c_low, c_high] and the negative-advantage veto."""
    m2po: M2poOptions = field(default_factory=M2poOptions)
    """M2PO (paper): second-moment masking."""
    m2po_clip: M2poOptions = field(default_factory=M2poOptions)
    """M2PO (released code): one clip bound derived from the second-moment budget."""
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    """Mismatch metrics and the optional correction of a behaviour policy that differs from the
    trainer's (e.g. an FP8 rollout engine); off by default, for any loss (algorithms.rollout_correction)."""

    def __post_init__(self) -> None:
        require(
            self.loss in available_losses(), f"algo.loss={self.loss!r} is unknown; choose one of {available_losses()}"
        )
        require(
            self.aggregation in AGGREGATIONS,
            f"algo.aggregation={self.aggregation!r} is unknown; choose one of {AGGREGATIONS}",
        )
        require(self.adv_eps > 0, f"algo.adv_eps={self.adv_eps} must be > 0")

    def loss_options(self) -> dict[str, Any]:
        """Keyword options of the chosen registry loss: its section plus the aggregation."""
        return {"aggregation": self.aggregation} | dataclasses.asdict(getattr(self, self.loss))


@dataclass(kw_only=True)
class OptimConfig:
    """AdamW as in the paper: β = (0.9, 0.999), weight decay 0.01, constant LR 1e-6."""

    lr: float = 1e-6
    weight_decay: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    clip_grad: float = 1.0
    """Global gradient-norm clip; 0 disables it."""

    def __post_init__(self) -> None:
        require(self.lr > 0, f"optim.lr={self.lr} must be > 0")
        require(self.weight_decay >= 0, f"optim.weight_decay={self.weight_decay} must be >= 0")
        require(0 <= self.beta1 < 1 and 0 <= self.beta2 < 1, "optim.beta1 and optim.beta2 must be in [0, 1)")
        require(self.clip_grad >= 0, f"optim.clip_grad={self.clip_grad} must be >= 0 (0 disables)")


@dataclass(kw_only=True)
class StagesConfig:
    """The staged schedule: μ = train_groups / mini_groups optimizer updates per stage."""

    num_stages: int = 4
    """Generation → optimization stages (the paper's default is 4)."""
    train_groups: int = 32768
    """B_train: prompt groups generated per stage."""
    mini_groups: int = 32
    """B_mini: prompt groups per optimizer update."""
    seed: int = 0
    """Seed of the minibatch permutation and of sampling."""

    def __post_init__(self) -> None:
        require(self.num_stages >= 1, f"stages.num_stages={self.num_stages} must be >= 1")
        require(self.mini_groups >= 1, f"stages.mini_groups={self.mini_groups} must be >= 1")
        require(
            self.train_groups >= self.mini_groups and self.train_groups % self.mini_groups == 0,
            f"stages.train_groups (B_train={self.train_groups}) must be a positive multiple of "
            f"stages.mini_groups (B_mini={self.mini_groups}); μ = B_train / B_mini updates per stage",
        )

    @property
    def updates_per_stage(self) -> int:
        """μ = B_train / B_mini."""
        return self.train_groups // self.mini_groups

    @property
    def total_updates(self) -> int:
        return self.num_stages * self.updates_per_stage


@dataclass(kw_only=True)
class BenchmarkConfig:
    """One evaluation benchmark: a local JSONL/Parquet file (or 'builtin')."""

    name: str
    path: str
    """Local file, or 'builtin' for the held-out split of the built-in task."""
    k: int = 4
    """Samples per problem; pass@1 is averaged over them (paper: 16 for AIME, 4 for AMC/MATH-500)."""
    prompt_field: str = "problem"
    answer_field: str = "answer"
    limit: int = 0
    """Evaluate at most this many problems (0: all)."""

    def __post_init__(self) -> None:
        require(self.k >= 1, f"eval benchmark {self.name!r}: k={self.k} must be >= 1")
        if self.path != "builtin":
            require(Path(self.path).is_file(), f"eval benchmark {self.name!r}: path {self.path!r} does not exist")


@dataclass(kw_only=True)
class EvalConfig:
    """Held-out evaluation: pass@1 averaged over k samples, every N updates."""

    every_updates: int = 0
    """Evaluate every N optimizer updates (0: only before training and at the end of each stage)."""
    benchmarks: list[BenchmarkConfig] = field(default_factory=list)
    temperature: float = 1.0
    max_new_tokens: int = 512
    chunk_problems: int = 32
    """Problems per unit of evaluation work (one engine call with its own derived seed). Chunks are
    spread over the engine hosts; smaller ones spread a small benchmark over more engines, larger ones
    give each engine bigger batches. Results do not depend on the engine count."""

    def __post_init__(self) -> None:
        require(self.every_updates >= 0, f"eval.every_updates={self.every_updates} must be >= 0")
        require(self.chunk_problems >= 1, f"eval.chunk_problems={self.chunk_problems} must be >= 1")
        require(self.temperature > 0, f"eval.temperature={self.temperature} must be > 0")


@dataclass(kw_only=True)
class WarmStartConfig:
    """Short supervised phase for the locally built demo model (cached in the run directory)."""

    steps: int = 0
    """SFT steps on the built-in task before RL (0: none)."""
    lr: float = 3e-3
    batch_size: int = 32
    answer_noise: float = 0.0
    """Fraction of warm-start examples whose final boxed answer has one digit miscopied (the worked
    steps stay right). The demo uses it to start RL from a policy with a systematic, verifiable flaw."""

    def __post_init__(self) -> None:
        require(self.steps >= 0, f"warmstart.steps={self.steps} must be >= 0")
        require(0.0 <= self.answer_noise < 1.0, f"warmstart.answer_noise={self.answer_noise} must be in [0, 1)")


@dataclass(kw_only=True)
class LoggingConfig:
    tensorboard: bool = True
    progress_bars: bool = True
    logprob_gap_tolerance: float = 1e-3
    """Warn when the first-update train-vs-rollout log-prob gap exceeds this (should be ~0)."""


@dataclass(kw_only=True)
class CheckpointConfig:
    keep_last: int = 2
    """Checkpoints kept on disk (>= 2 so a crash while writing leaves a good one)."""
    every_updates: int = 0
    """Also checkpoint every N updates inside a stage (0: only at stage ends)."""
    every_stages: int = 1
    """Checkpoint at the end of every N-th stage (and always after the last). Standard GRPO's many tiny
    stages want a larger N; a resume redoes at most N stages of updates (stored rollouts are reused)."""
    async_save: bool = True
    """Write checkpoints in background threads while training continues (costs host memory for one
    copy of the rank's model + optimizer state); a checkpoint becomes `latest` once complete."""
    fsync: bool = True
    """fsync every checkpoint file before publishing it (durable on power loss; off the training
    path when async_save is on)."""

    def __post_init__(self) -> None:
        require(self.keep_last >= 2, f"checkpoint.keep_last={self.keep_last} must be >= 2")
        require(self.every_stages >= 1, f"checkpoint.every_stages={self.every_stages} must be >= 1")
        require(self.every_updates >= 0, f"checkpoint.every_updates={self.every_updates} must be >= 0")


@dataclass(kw_only=True)
class RunConfig:
    """A whole run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    stages: StagesConfig = field(default_factory=StagesConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    kernels: KernelConfig = field(default_factory=KernelConfig)
    warmstart: WarmStartConfig = field(default_factory=WarmStartConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    """Headroom-Drift Replay (owned by algorithms/replay.py); off by default."""
    mode: str = "staged"
    """'staged': generate D_k, then μ updates on it, stage after stage (every rank does both).
    'async': the last async.rollout_ranks ranks generate continuously while the others train; the
    run makes stages.num_stages × μ updates and evaluates / checkpoints at every stage end."""
    async_: AsyncConfig = field(default_factory=AsyncConfig)
    """The ``async`` section (YAML and command-line key ``async``; the field name avoids the keyword)."""
    seed: int = 0
    deterministic: bool = True
    """Deterministic algorithms (CPU resume equals an uninterrupted run)."""

    def __post_init__(self) -> None:
        require(self.mode in MODES, f"mode={self.mode!r} is not one of {MODES}")
        if self.mode == "async":
            self._check_async()
        require(
            self.stages.mini_groups * self.rollout.group_size >= self.parallel.micro_batch_size,
            "parallel.micro_batch_size is larger than one update's responses "
            f"(stages.mini_groups × rollout.group_size = {self.stages.mini_groups * self.rollout.group_size})",
        )
        if not self.model.hf_dir:
            tiny = self.model.tiny
            check_model_parallelism(tiny.num_attention_heads, tiny.num_key_value_heads, tiny.num_layers, self.parallel)
        require(
            not (self.replay.enabled and self.algo.rollout_correction.enabled),
            "replay.enabled cannot be combined with algo.rollout_correction: replayed groups do not carry the "
            "log π_old of the stage that generated them; turn one of the two off",
        )

    def _check_async(self) -> None:
        """What mode: async cannot combine with (the staged loop's per-stage passes have no async twin)."""
        require(
            self.async_.queue_groups >= self.stages.mini_groups,
            f"async.queue_groups={self.async_.queue_groups} is smaller than stages.mini_groups="
            f"{self.stages.mini_groups}: the trainer takes B_mini groups per update from the queue, so it must "
            "hold at least that many; raise async.queue_groups",
        )
        require(
            not self.algo.rollout_correction.enabled,
            "algo.rollout_correction (tis_cap / mask_bound) needs log π_old at each group's behaviour weights, "
            "which the staged loop computes once per stage; mode: async has no such pass. Set both to 0 or use "
            "mode: staged",
        )
        require(
            not self.replay.enabled,
            "replay.enabled (Headroom-Drift Replay) chooses earlier stages' groups at each stage start; mode: async "
            "has no stages of stored data to replay from. Set replay.enabled=false or use mode: staged",
        )
        require(
            not (self.async_.verify_weights and self.rollout.engine == "sglang"),
            "async.verify_weights=true cannot be checked with rollout.engine=sglang: SGLang hands back only a "
            "truncated copy of a weight (get_weights_by_name), so the hash of what a worker applied cannot be "
            "computed. Set async.verify_weights=false, or verify with the transformers engine",
        )
        require(
            self.rollout.quantization == "none",
            f"rollout.quantization={self.rollout.quantization!r} is not supported in mode: async (the rollout "
            "workers load the published weights as they are); set rollout.quantization=none or use mode: staged",
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain values with the user's key spellings (``async``, not the field name ``async_``)."""
        return _rename_top_level(dataclasses.asdict(self), FIELD_ALIASES)


FIELD_ALIASES = {"async_": "async"}
"""RunConfig fields whose name avoids a Python keyword → their YAML / command-line key."""
KEY_ALIASES = {key: name for name, key in FIELD_ALIASES.items()}


def _rename_top_level(values: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    return {names.get(key, key): value for key, value in values.items()}


def _field_key(dotted: str) -> str:
    """A dotted key as the user writes it (``async.max_lag``) → the schema's (``async_.max_lag``)."""
    head, _, rest = dotted.partition(".")
    return KEY_ALIASES.get(head, head) + ("." + rest if rest else "")


def _user_spelling(text: str) -> str:
    """Schema names in an error message back to the user's keys (``async_.max_lag`` → ``async.max_lag``)."""
    for name, key in FIELD_ALIASES.items():
        text = text.replace(name, key)
    return text


def check_model_parallelism(num_heads: int, num_kv_heads: int, num_layers: int, parallel: ParallelConfig) -> None:
    """Raise ConfigError when TP/PP cannot split a model with these dimensions."""
    tp, pp = parallel.tensor_parallel, parallel.pipeline_parallel
    require(num_heads % tp == 0, f"parallel.tensor_parallel={tp} does not divide the {num_heads} attention heads")
    require(
        num_kv_heads % tp == 0,
        f"parallel.tensor_parallel={tp} does not divide the {num_kv_heads} key/value heads (query groups)",
    )
    require(num_layers % pp == 0, f"parallel.pipeline_parallel={pp} does not divide the {num_layers} layers")


def check_hf_model_parallelism(hf_dir: str | Path, parallel: ParallelConfig) -> None:
    """Validate TP/PP against a Hugging Face config.json."""
    path = Path(hf_dir) / "config.json"
    require(path.is_file(), f"{path} is missing: model.hf_dir must be a Hugging Face checkpoint directory")
    hf = json.loads(path.read_text())
    heads = hf["num_attention_heads"]
    check_model_parallelism(heads, hf.get("num_key_value_heads", heads), hf["num_hidden_layers"], parallel)


_MISSING = object()


def _schema() -> Any:
    return OmegaConf.structured(RunConfig)


def _instantiate(container: dict[str, Any]) -> RunConfig:
    """Build the dataclass tree from a plain dict, running every section's __post_init__."""
    return _build(RunConfig, container)


def _build(cls: type, values: dict[str, Any]) -> Any:
    """``cls(**values)`` with nested sections (and lists of them) built from their dicts first.

    Which fields are sections comes from the type hints, so a component's new section needs no
    registration here.
    """
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in values:
            continue
        value, hint = values[f.name], hints[f.name]
        if dataclasses.is_dataclass(hint):
            value = _build(hint, value)
        elif typing.get_origin(hint) is list and dataclasses.is_dataclass(typing.get_args(hint)[0]):
            value = [_build(typing.get_args(hint)[0], item) for item in value]
        kwargs[f.name] = value
    return cls(**kwargs)


def _load_yaml_with_inherit(path: Path, chain: tuple[Path, ...]) -> Any:
    """Load a YAML file; its optional ``inherit: [files]`` (relative to it) are merged first, in order."""
    require(path.is_file(), f"config file {str(path)!r} does not exist")
    require(path.resolve() not in chain, f"config file {path} inherits itself (cycle: {' -> '.join(map(str, chain))})")
    try:
        node = OmegaConf.load(path)
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {_yaml_problem(exc)}") from exc
    require(
        isinstance(node, DictConfig),
        f"config file {path}: the top level must be a mapping of sections (model:, rollout:, ...), not a list",
    )
    parents = node.pop("inherit", None) or []
    if isinstance(parents, str):
        parents = [parents]
    merged = OmegaConf.create({})
    for parent in parents:
        merged = OmegaConf.merge(merged, _load_yaml_with_inherit(path.parent / parent, (*chain, path.resolve())))
    return OmegaConf.merge(merged, node)


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """One line from a YAML parser error: what is wrong and where (1-based line and column)."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc).split("\n")[0]
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else problem


MOVED_KEYS = {
    "algo.clip_low": "algo.mu_grpo.clip_low",
    "algo.clip_high": "algo.mu_grpo.clip_high",
    "algo.veto_scope": "algo.mu_grpo.veto_scope",
    "algo.veto_threshold": "algo.mu_grpo.veto_threshold",
    "algo.clip_eps": "algo.grpo.clip_eps",
    "algo.m2_threshold": "algo.m2po.m2_threshold (or algo.m2po_clip.m2_threshold)",
    "rollout.batch_size": "rollout.transformers.batch_size",
    "rollout.sglang_mem_fraction": "rollout.sglang.mem_fraction_static",
}
"""Keys of megatron_mugrpo 0.1.0 that moved into their component's section, and where they live now."""


def _refuse_moved_keys(keys: list[str], where: object) -> None:
    moved = [f"{key} is now {MOVED_KEYS[key]}" for key in keys if key in MOVED_KEYS]
    require(not moved, f"{where}: {'; '.join(moved)} (each loss and engine owns its config section); rename them")


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Load a YAML run file (or the defaults) and apply dotted ``key=value`` overrides.

    A YAML file may start with ``inherit: [base.yaml, ...]`` (paths relative to it): those are merged
    first, so the paper configs share one file per model and one per method.
    """
    merged = _schema()
    try:
        if path is not None:
            path = Path(path)
            node = _aliased(_load_yaml_with_inherit(path, ()), path)
            _refuse_moved_keys(
                [k for k in MOVED_KEYS if OmegaConf.select(node, k, default=_MISSING) is not _MISSING], path
            )
            merged = OmegaConf.merge(merged, node)
        for item in overrides:
            require("=" in item, f"override {item!r} must look like section.key=value (e.g. algo.mu_grpo.clip_high=5)")
        _refuse_moved_keys([item.split("=", 1)[0] for item in overrides], "the command-line overrides")
        for item in overrides:
            user_key, value = item.split("=", 1)
            key = _field_key(user_key)
            require(
                OmegaConf.select(merged, key, default=_MISSING) is not _MISSING
                and user_key.partition(".")[0] not in FIELD_ALIASES,
                f"override {item!r}: {user_key!r} is not a configuration key (see configs/ and config.py)",
            )
            try:
                parsed = yaml.safe_load(value) if value else ""
            except yaml.YAMLError as exc:
                raise ConfigError(f"override {item!r}: the value is not valid YAML ({_yaml_problem(exc)})") from exc
            # update() (unlike merging a dotlist) also reaches list elements: eval.benchmarks.0.k=16
            OmegaConf.update(merged, key, parsed, merge=True)
        container = OmegaConf.to_container(merged, resolve=True, structured_config_mode=None)
    except OmegaConfBaseException as exc:
        where = f" in {path}" if path is not None else ""
        key = getattr(exc, "full_key", None)
        detail = str(exc).split("\n")[0]
        message = f"invalid configuration{where}: {key + ': ' if key else ''}{detail}"
        raise ConfigError(_user_spelling(message)) from exc
    return _instantiate(container)


def _aliased(node: Any, where: object) -> Any:
    """A loaded YAML tree with its top-level ``async:`` section under the schema's field name ``async_``."""
    for name in FIELD_ALIASES:
        require(name not in node, f"{where}: write the section as {FIELD_ALIASES[name]!r}, not {name!r}")
    for key, name in KEY_ALIASES.items():
        if key in node:
            node[name] = node.pop(key)
    return node


def config_from_dict(values: dict[str, Any]) -> RunConfig:
    """Rebuild a RunConfig from ``RunConfig.to_dict()`` output (e.g. a checkpoint's metadata)."""
    values = _rename_top_level(values, KEY_ALIASES)
    merged = OmegaConf.merge(_schema(), OmegaConf.create(values))
    return _instantiate(OmegaConf.to_container(merged, resolve=True))


def save_config(cfg: RunConfig, path: str | Path) -> None:
    """Write the resolved config as YAML (the run directory's snapshot; sections under their user keys)."""
    Path(path).write_text(OmegaConf.to_yaml(OmegaConf.create(cfg.to_dict())))
