"""Typed run configuration: nested dataclasses, YAML loading and dotted command-line overrides.

A run is a YAML file in ``configs/`` plus overrides such as ``algo.mu_grpo.clip_high=5``. OmegaConf merges
the YAML and the overrides against the dataclass schema (so a misspelt key or a wrong type is an
error naming the key); each section then validates itself in ``__post_init__`` with a message that
says what to change. Components own their sections and this module only composes them, loads
YAML and overrides, and saves:

    model, warmstart     warmstart.py (the model the run starts from)
    parallel             training/parallel.py          optim       training/optimizer.py
    checkpoint           training/checkpoint_config.py logging     metrics.py
    data                 rollout/prompts.py            eval        evaluation.py
    reward               rewards/registry.py, with reward.<kind>.* from each reward of the registry
                         (reward.math.* in rewards/answers.py, reward.code.* in rewards/code.py)
    rollout              rollout/config.py, with rollout.<engine>.* from each engine module of the
                         engine registry (rollout/engine.py), rollout.vigor.* from
                         algorithms/allocation.py and rollout.modelopt.* from rollout/quantization.py
    algo                 algorithms/config.py, with algo.<loss>.* from the loss registry
                         (algorithms/losses.py) and algo.rollout_correction.*
    replay               algorithms/replay.py          kernels     kernels/config.py
    env                  envs/registry.py, with env.<kind>.* from each environment (env.search.* in envs/search.py)
    moe                  training/moe.py (router losses and token dispatch of mixture-of-experts models)
    async                asynchronous/config.py        stages      algorithms/schedule.py (μ per stage)

    cfg = load_config("configs/demo_cpu.yaml", ["algo.mu_grpo.clip_high=5", "stages.num_stages=2"])
    cfg.stages.updates_per_stage      # μ = B_train / B_mini, derived, never typed twice
"""

from __future__ import annotations

import dataclasses
import keyword
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

# Each section lives with the component that reads it (import it from there); this module composes them.
from megatron_mugrpo.algorithms.config import AlgoConfig
from megatron_mugrpo.algorithms.replay import ReplayConfig
from megatron_mugrpo.algorithms.schedule import StagesConfig
from megatron_mugrpo.asynchronous.config import AsyncConfig, partial_routes_problem
from megatron_mugrpo.envs.registry import EnvConfig, run_env_problem
from megatron_mugrpo.errors import ConfigError, require
from megatron_mugrpo.evaluation import BenchmarkConfig, EvalConfig
from megatron_mugrpo.kernels.config import KernelConfig
from megatron_mugrpo.metrics import LoggingConfig
from megatron_mugrpo.rewards.registry import RewardConfig
from megatron_mugrpo.rollout.config import RolloutConfig
from megatron_mugrpo.rollout.prompts import DataConfig, format_reward_kind
from megatron_mugrpo.rollout.routes import routing_replay_problem
from megatron_mugrpo.training.checkpoint_config import CheckpointConfig
from megatron_mugrpo.training.moe import MoeConfig
from megatron_mugrpo.training.optimizer import OptimConfig
from megatron_mugrpo.training.parallel import ParallelConfig, check_model_parallelism
from megatron_mugrpo.warmstart import ModelConfig, WarmStartConfig

MODES = ("staged", "async")
"""mode choices: the staged loop (loop/staged.py) or asynchronous rollout workers (loop/asynchronous.py)."""

__all__ = [
    "MODES",
    "RunConfig",
    "config_from_dict",
    "config_values",
    "field_name",
    "load_config",
    "save_config",
    "user_key",
]


@dataclass(kw_only=True)
class RunConfig:
    """A whole run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    stages: StagesConfig = field(default_factory=StagesConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    kernels: KernelConfig = field(default_factory=KernelConfig)
    moe: MoeConfig = field(default_factory=MoeConfig)
    warmstart: WarmStartConfig = field(default_factory=WarmStartConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    """Headroom-Drift Replay (owned by algorithms/replay.py); off by default."""
    env: EnvConfig = field(default_factory=EnvConfig)
    """Multi-turn rollouts against an environment (owned by envs/registry.py); off by default."""
    mode: str = "staged"
    """'staged': generate D_k, then μ updates on it, stage after stage (every rank does both).
    'async': the last async.rollout_ranks ranks generate continuously while the others train; the
    run makes stages.num_stages × μ updates and evaluates / checkpoints at every stage end."""
    async_: AsyncConfig = field(default_factory=AsyncConfig)
    """The ``async`` section: written ``async`` in YAML and overrides, ``async_`` in Python (see ``user_key``)."""
    seed: int = 0
    """Seed of the run: model initialisation, warm start and evaluation sampling (the stages and the
    data have seeds of their own, stages.seed and data.seed)."""
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
        self._check_micro_batch_tokens()
        if not self.model.hf_dir:
            tiny = self.model.tiny
            check_model_parallelism(tiny.num_attention_heads, tiny.num_key_value_heads, tiny.num_layers, self.parallel)
        self._check_rewards()
        problem = run_env_problem(
            self.env,
            reward_kind=self.reward.kind,
            engine=self.rollout.engine,
            allocation=self.rollout.allocation,
            mode=self.mode,
            routing_replay=self.moe.routing_replay,
            partial_rollout=self.async_.partial_rollout,
            max_prompt_tokens=self.rollout.max_prompt_tokens,
            positions=None if self.model.hf_dir else self.model.tiny.max_position_embeddings,
        )
        require(not problem, problem)
        tiny_arch = None if self.model.hf_dir else self.model.tiny.arch
        problem = routing_replay_problem(self.moe.routing_replay, engine=self.rollout.engine, tiny_arch=tiny_arch)
        require(not problem, problem)
        require(
            not (self.replay.enabled and self.algo.rollout_correction.enabled),
            "replay.enabled cannot be combined with algo.rollout_correction: replayed groups do not carry the "
            "log π_old of the stage that generated them; turn one of the two off",
        )
        require(
            not (self.replay.enabled and self.algo.needs_old_logprobs),
            f"replay.enabled cannot be combined with algo.loss={self.algo.loss}: it masks on π_old / β, and "
            "replayed groups do not carry the log π_old of the stage that generated them; use "
            "algo.loss=icepop_current (masks on π_θ / β) or turn replay off",
        )

    def _check_rewards(self) -> None:
        """Each data source is scored by a reward that can read its reference answers."""
        data = self.data
        source = f"data.format={data.format!r}" if data.train_path else f"data.builtin_task={data.builtin_task!r}"
        require(self.reward.kind == data.reward_kind, reward_mismatch(self.reward.kind, data, source))
        for bench in self.eval.benchmarks:
            builtin = bench.path == "builtin"
            needed = data.reward_kind if builtin else format_reward_kind(bench.format)
            problems = f"the built-in task {data.builtin_task!r}" if builtin else f"format={bench.format!r}"
            require(
                self.benchmark_reward(bench) == needed,
                f"eval benchmark {bench.name!r} is scored by reward {self.benchmark_reward(bench)!r} but its "
                f"problems ({problems}) need {needed!r}; set its reward: {needed}",
            )

    def benchmark_reward(self, bench: BenchmarkConfig) -> str:
        """The reward kind that scores an evaluation benchmark."""
        return bench.reward or self.reward.kind

    def _check_micro_batch_tokens(self) -> None:
        """A token budget must hold the longest row an update can have, and every expert-parallel rank
        must be able to receive a different number of tokens (the allgather dispatcher cannot)."""
        budget, rollout = self.parallel.micro_batch_tokens, self.rollout
        if budget is None:
            return
        longest = rollout.max_prompt_tokens + rollout.max_new_tokens
        require(
            budget >= longest,
            f"parallel.micro_batch_tokens={budget} is below the longest row an update can hold "
            f"(rollout.max_prompt_tokens + rollout.max_new_tokens = {longest}); raise it to at least {longest}",
        )
        require(
            self.parallel.expert_parallel == 1 or self.moe.token_dispatcher != "allgather",
            "parallel.micro_batch_tokens gives expert-parallel ranks micro-batches of different sizes, which "
            "moe.token_dispatcher=allgather cannot exchange; use moe.token_dispatcher=alltoall",
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
            not self.algo.needs_old_logprobs,
            f"algo.loss={self.algo.loss} masks on π_old / β, the trainer's log-probs at the stage's start, which "
            "the staged loop computes once per stage; mode: async has no such pass. Use algo.loss=icepop_current "
            "(masks on π_θ / β) or mode: staged",
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
            not (self.async_.verify_weights and self.rollout.engine == "vllm"),
            "async.verify_weights=true cannot be checked with rollout.engine=vllm: vLLM holds fused (QKV, gate/up) "
            "and, on the CPU, repacked weights, not the published tensors. Set async.verify_weights=false (the "
            "first update's trainer-vs-engine log-prob gap checks the weights), or verify with the transformers engine",
        )
        problem = partial_routes_problem(self.async_, self.moe.routing_replay)
        require(not problem, problem)
        require(
            self.rollout.quantization == "none",
            f"rollout.quantization={self.rollout.quantization!r} is not supported in mode: async (the rollout "
            "workers load the published weights as they are); set rollout.quantization=none or use mode: staged",
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain values with the user's key spellings (``async``, not the field name ``async_``)."""
        return {user_key(name): value for name, value in dataclasses.asdict(self).items()}


def reward_mismatch(kind: str, data: DataConfig, source: str) -> str:
    """The error for a reward that cannot score the training data. A data file read as 'problems' (the
    default format) under a code reward most likely holds coding problems whose format was not named:
    that fix comes first."""
    message = f"reward.kind={kind!r} cannot score the training data ({source} needs {data.reward_kind!r}); "
    if data.train_path and data.format == "problems" and kind == "code":
        return message + (
            "if the file holds coding problems, set data.format=code_contests or data.format=livecodebench "
            "(its rows' format); if it holds math problems, set reward.kind=math"
        )
    return message + f"set reward.kind={data.reward_kind}"


def user_key(name: str) -> str:
    """A RunConfig field's YAML / command-line key. A key that is a Python keyword (``async``) cannot be an
    attribute, so its field carries PEP 8's trailing underscore (``async_``); every other field is its key.
    This rule and ``field_name`` are the only places the two spellings meet."""
    stem = name.removesuffix("_")
    return stem if stem != name and keyword.iskeyword(stem) else name


def field_name(key: str) -> str:
    """The RunConfig field a YAML / command-line key names (``async`` → ``async_``); ``user_key``'s inverse."""
    return f"{key}_" if keyword.iskeyword(key) else key


def _field_names(values: dict[str, Any], where: object) -> dict[str, Any]:
    """Top-level sections as the user writes them → the schema's field names; the field spelling is refused
    (one name per section in files and overrides)."""
    for key in values:
        require(user_key(key) == key, f"{where}: write the section as {user_key(key)!r}, not {key!r}")
    return {field_name(key): value for key, value in values.items()}


def _user_spelling(text: str) -> str:
    """Field names in an error message back to the user's keys (``async_.max_lag`` → ``async.max_lag``)."""
    for f in dataclasses.fields(RunConfig):
        if user_key(f.name) != f.name:  # whole names only: a file called async_grpo.yaml keeps its name
            text = re.sub(rf"\b{re.escape(f.name)}\b", user_key(f.name), text)
    return text


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
    return _instantiate(config_values(path, overrides))


def config_values(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    """``load_config``'s merged YAML and overrides as plain values, before any section checks itself or the
    others (``mugrpo score`` reads a config's data section this way, before it knows the data's format)."""
    merged = _schema()
    try:
        if path is not None:
            path = Path(path)
            node = OmegaConf.create(_field_names(_load_yaml_with_inherit(path, ()), path))
            _refuse_moved_keys(
                [k for k in MOVED_KEYS if OmegaConf.select(node, k, default=_MISSING) is not _MISSING], path
            )
            merged = OmegaConf.merge(merged, node)
        for item in overrides:
            require("=" in item, f"override {item!r} must look like section.key=value (e.g. algo.mu_grpo.clip_high=5)")
        _refuse_moved_keys([item.split("=", 1)[0] for item in overrides], "the command-line overrides")
        for item in overrides:
            dotted, value = item.split("=", 1)
            head, dot, rest = dotted.partition(".")
            key = field_name(head) + dot + rest
            require(
                OmegaConf.select(merged, key, default=_MISSING) is not _MISSING and user_key(head) == head,
                f"override {item!r}: {dotted!r} is not a configuration key (see configs/ and config.py)",
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
    return container


def config_from_dict(values: dict[str, Any]) -> RunConfig:
    """Rebuild a RunConfig from ``RunConfig.to_dict()`` output (e.g. a checkpoint's metadata)."""
    values = _field_names(values, "the config values")
    merged = OmegaConf.merge(_schema(), OmegaConf.create(values))
    return _instantiate(OmegaConf.to_container(merged, resolve=True))


def save_config(cfg: RunConfig, path: str | Path) -> None:
    """Write the resolved config as YAML (the run directory's snapshot; sections under their user keys)."""
    Path(path).write_text(OmegaConf.to_yaml(OmegaConf.create(cfg.to_dict())))
