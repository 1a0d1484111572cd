"""The run the loops operate on: one rank's view, built by the composition root (``loop/setup.py``).

A ``Run`` keeps at its top what every loop module reads on almost every line (the configuration, the
run directory, the process groups, the policy, the trainer state, the rollout engine and its
placement) and groups the rest by side, so a new component adds one field to one group:

    run.origin      where the policy came from: the Hugging Face directory and config, the checkpoint
    run.inputs      what the run reads before any model exists: tokenizer, prompts, benchmarks, rewards
    run.trainer     the trainer's parts: scoring settings, cadence, checkpoint writer, replay state
    run.telemetry   the metrics logger, the phase timer and the time of earlier processes
    run.hosts       the engine side: this rank's place among the rollout engine groups (``run.placement``)

The loops type the configuration as ``RunSections``: the sections, each typed by the component that
owns it. ``config.RunConfig`` is one (``tests/loop/test_run.py`` checks them field by field); only
the composition root names that type, so the loops sit below it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from megatron_mugrpo.algorithms.config import AlgoConfig
from megatron_mugrpo.algorithms.replay import ReplayConfig
from megatron_mugrpo.algorithms.schedule import StagesConfig
from megatron_mugrpo.asynchronous.config import AsyncConfig
from megatron_mugrpo.envs.registry import EnvConfig
from megatron_mugrpo.errors import InputError
from megatron_mugrpo.evaluation import Benchmark, EvalConfig
from megatron_mugrpo.kernels.config import KernelConfig
from megatron_mugrpo.loop.cadence import Cadence
from megatron_mugrpo.loop.hdr import ReplayState
from megatron_mugrpo.metrics import LoggingConfig, MetricsLogger, Timer
from megatron_mugrpo.rewards.registry import RewardConfig, RewardSet
from megatron_mugrpo.rollout.config import RolloutConfig
from megatron_mugrpo.rollout.engine import RolloutEngine, shutdown_engine
from megatron_mugrpo.rollout.placement import EnginePlacement, HostGroup
from megatron_mugrpo.rollout.prompts import DataConfig, PromptRecord
from megatron_mugrpo.rundir import RunLock
from megatron_mugrpo.state import TrainerState
from megatron_mugrpo.training.checkpoint import CheckpointSaver
from megatron_mugrpo.training.checkpoint_config import CheckpointConfig
from megatron_mugrpo.training.moe import MoeConfig
from megatron_mugrpo.training.optimizer import OptimConfig
from megatron_mugrpo.training.parallel import ParallelConfig, ParallelGroups
from megatron_mugrpo.training.setup import Policy
from megatron_mugrpo.training.stage_reference import ScoreSettings
from megatron_mugrpo.warmstart import ModelConfig, WarmStartConfig


class RunError(InputError, RuntimeError):
    """A run directory cannot be used as asked; the message says why and what to do."""


class RunSections(Protocol):
    """The run's configuration as the loops read it (``config.RunConfig`` is one)."""

    mode: str
    seed: int
    deterministic: bool
    model: ModelConfig
    warmstart: WarmStartConfig
    parallel: ParallelConfig
    data: DataConfig
    rollout: RolloutConfig
    reward: RewardConfig
    algo: AlgoConfig
    optim: OptimConfig
    stages: StagesConfig
    eval: EvalConfig
    kernels: KernelConfig
    moe: MoeConfig
    logging: LoggingConfig
    checkpoint: CheckpointConfig
    replay: ReplayConfig
    env: EnvConfig
    async_: AsyncConfig

    def to_dict(self) -> dict[str, Any]: ...


@dataclass(kw_only=True)
class Origin:
    """Where the run's policy came from."""

    hf_dir: Path
    """Hugging Face directory of the starting policy (architecture, tokenizer)."""
    hf_config: dict[str, Any]
    resumed_from: Path | None = None
    """The checkpoint step directory the weights were loaded from (None: the Hugging Face weights)."""


@dataclass(kw_only=True)
class Inputs:
    """What a run reads before it builds any model: seconds of work, where a typo in the data shows."""

    tokenizer: Any
    prompts: list[PromptRecord]
    benchmarks: list[Benchmark]
    reward_fn: RewardSet
    """The training data's reward (``score``) and every benchmark's, started and closed together."""


@dataclass(kw_only=True)
class TrainerParts:
    """The trainer's side of a run, besides the policy and its state."""

    scoring: ScoreSettings
    """How every trainer pass scores responses (the update, the stage reference, HDR's re-scoring)."""
    cadence: Cadence
    """When both loops evaluate and checkpoint."""
    checkpoints: CheckpointSaver
    """Writes RUN_DIR/checkpoints (in the background with checkpoint.async_save)."""
    replay: ReplayState | None = None
    """Headroom-Drift Replay buffer and the current stage's decision (None: replay is off)."""


@dataclass(kw_only=True)
class Telemetry:
    """Where the run's measurements go, and the time already spent by earlier processes of it."""

    logger: MetricsLogger
    timer: Timer
    extra_timers: dict[str, float] = field(default_factory=dict)
    """perf/ seconds accumulated by earlier processes of this run (restored from the checkpoint)."""
    started: float = field(default_factory=time.monotonic)
    """When this process opened the run (for perf/t_total_s)."""


@dataclass(kw_only=True)
class Run:
    """One rank's view of a run."""

    cfg: RunSections
    run_dir: Path
    groups: ParallelGroups
    hosts: HostGroup
    """This rank's place among the rollout engine groups, and the group every rank coordinates on."""
    policy: Policy
    state: TrainerState
    origin: Origin
    inputs: Inputs
    trainer: TrainerParts
    telemetry: Telemetry
    engine: RolloutEngine | None = None
    """This rank's rollout engine when it hosts one (None elsewhere, and before the first weight sync)."""
    lock: RunLock | None = None
    """Rank 0's exclusive lock on the run directory, held until close()."""

    @property
    def is_writer(self) -> bool:
        """Rank 0 seals the rollout stores, writes metrics and checkpoints' metadata, owns the console."""
        return self.groups.rank == 0

    @property
    def placement(self) -> EnginePlacement:
        return self.hosts.placement

    def rollout_dir(self, stage: int) -> Path:
        return self.run_dir / "rollouts" / f"stage_{stage:03d}"

    @property
    def checkpoint_root(self) -> Path:
        return self.run_dir / "checkpoints"

    def close(self) -> None:
        self.trainer.checkpoints.close()  # publish a checkpoint still being written
        # The reward pool first: SGLang's engine shutdown kills every child process of this one.
        self.inputs.reward_fn.close()
        if self.engine is not None:
            shutdown_engine(self.engine)
        self.telemetry.logger.close()
        if self.lock is not None:
            self.lock.release()
