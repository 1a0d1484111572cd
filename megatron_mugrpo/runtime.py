"""Setting up (or resuming) a run: everything the staged loop in ``stages.py`` operates on.

``open_run`` builds, in order: the process groups, the base Hugging Face model (the user's, or the
demo's locally built and warm-started one), the Megatron policy with its optimizer, the weights
(from the latest checkpoint when resuming, else from the Hugging Face directory), the prompts,
benchmarks, verifier and metrics logger. The rollout engine is created lazily on rank 0 at the
first weight sync and lives for the whole run (released between phases).

Run directory layout::

    RUN_DIR/config.yaml          resolved configuration (the snapshot `train --resume` reads)
    RUN_DIR/base_model/          the demo's built model (absent with model.hf_dir)
    RUN_DIR/rollouts/stage_K/    rollout dataset D_k (sharded, checksummed manifest)
    RUN_DIR/checkpoints/         step_XXXXXXXX/ directories and the `latest` pointer
    RUN_DIR/behaviour_policy/    the stage's quantized checkpoint (rollout.quantization with SGLang only)
    RUN_DIR/metrics.jsonl, RUN_DIR/tensorboard/, RUN_DIR/report/
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_mugrpo.config import RunConfig, check_hf_model_parallelism, load_config, save_config
from megatron_mugrpo.errors import InputError
from megatron_mugrpo.evaluation import Benchmark
from megatron_mugrpo.metrics import MetricsLogger, Timer
from megatron_mugrpo.rollout.engine import RolloutEngine, build_engine_from_config
from megatron_mugrpo.rollout.prompts import PromptRecord, load_benchmark, load_prompts
from megatron_mugrpo.rollout.prompts import stage_prompts as stage_prompts  # re-exported: it moved to the prompts
from megatron_mugrpo.rollout.quantization import behaviour_quantizer, load_behaviour_policy
from megatron_mugrpo.rollout.rewards import RewardFn, build_reward
from megatron_mugrpo.state import TrainerState
from megatron_mugrpo.training.checkpoint import latest_checkpoint, load_checkpoint
from megatron_mugrpo.training.parallel import ParallelGroups, initialize_parallel
from megatron_mugrpo.training.setup import Policy, build_policy, resolve_dtype

CONFIG_FILE = "config.yaml"


class RunError(InputError, RuntimeError):
    """A run directory cannot be used as asked; the message says why and what to do."""


@dataclass(kw_only=True)
class Run:
    """One rank's view of a run."""

    cfg: RunConfig
    run_dir: Path
    hf_dir: Path
    """Hugging Face directory of the starting policy (architecture, tokenizer)."""
    hf_config: dict[str, Any]
    tokenizer: Any
    groups: ParallelGroups
    policy: Policy
    state: TrainerState
    prompts: list[PromptRecord]
    benchmarks: list[Benchmark]
    reward_fn: RewardFn
    logger: MetricsLogger
    timer: Timer
    engine: RolloutEngine | None = None
    """Rank 0's rollout engine (None elsewhere, and before the first weight sync)."""
    resumed_from: Path | None = None
    extra_timers: dict[str, float] = field(default_factory=dict)
    """perf/ seconds accumulated by earlier processes of this run (restored from the checkpoint)."""
    started: float = field(default_factory=time.monotonic)
    """When this process opened the run (for perf/t_total_s)."""

    @property
    def is_writer(self) -> bool:
        """Rank 0 owns the rollout engine, the rollout store and the console."""
        return self.groups.rank == 0

    def rollout_dir(self, stage: int) -> Path:
        return self.run_dir / "rollouts" / f"stage_{stage:03d}"

    @property
    def checkpoint_root(self) -> Path:
        return self.run_dir / "checkpoints"

    def close(self) -> None:
        if self.engine is not None:
            self.engine.release()
        self.reward_fn.close()
        self.logger.close()


def load_run_config(run_dir: Path) -> RunConfig:
    """The configuration snapshot of an existing run directory (for ``--resume`` and the phase verbs)."""
    path = run_dir / CONFIG_FILE
    if not path.is_file():
        raise RunError(
            f"{run_dir} is not a run directory ({CONFIG_FILE} is missing); start one with "
            "`mugrpo train --config C --run-dir DIR`"
        )
    return load_config(path)


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def set_determinism(cfg: RunConfig) -> None:
    """Deterministic kernels, so a resumed CPU run equals an uninterrupted one (seeds: initialize_parallel)."""
    torch.use_deterministic_algorithms(cfg.deterministic, warn_only=True)


def open_run(
    cfg: RunConfig, run_dir: Path, *, resume: bool, checkpoint: Path | None = None, world_size: int | None = None
) -> Run:
    """Build this rank's Run. ``resume`` loads the latest checkpoint (or ``checkpoint``) when one exists.

    ``world_size``: the trainer ranks when they are fewer than the launch's processes (async mode).
    """
    set_determinism(cfg)
    parallel = cfg.parallel
    groups = initialize_parallel(parallel.tensor_parallel, parallel.pipeline_parallel, cfg.seed, world_size=world_size)
    if groups.rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        if not (run_dir / CONFIG_FILE).exists():
            save_config(cfg, run_dir / CONFIG_FILE)
    hf_dir = _base_model(cfg, run_dir, is_writer=groups.rank == 0)
    check_hf_model_parallelism(hf_dir, cfg.parallel)
    from transformers import AutoTokenizer

    from conversion.hf_io import load_hf_config

    tokenizer = AutoTokenizer.from_pretrained(str(hf_dir))
    hf_config = load_hf_config(hf_dir)
    policy = build_policy(
        hf_config,
        groups=groups,
        dtype=resolve_dtype(cfg.model.dtype),
        optim=cfg.optim,
        use_distributed_optimizer=cfg.parallel.use_distributed_optimizer,
        fp8=cfg.kernels.fp8,
        sequence_parallel=cfg.parallel.sequence_parallel,
    )
    state, resumed_from = _initial_weights(policy, hf_dir, run_dir, resume=resume, checkpoint=checkpoint)
    prompts = load_prompts(cfg.data, tokenizer, cfg.rollout.max_prompt_tokens)
    benchmarks = [
        Benchmark(
            config=bench,
            problems=load_benchmark(
                bench,
                tokenizer,
                cfg.rollout.max_prompt_tokens,
                builtin_task=cfg.data.builtin_task,
                seed=cfg.data.seed,
                use_chat_template=cfg.data.use_chat_template,
            ),
        )
        for bench in cfg.eval.benchmarks
    ]
    reward_fn = build_reward(
        cfg.rollout.reward, workers=cfg.rollout.reward_workers, timeout_s=cfg.rollout.reward_timeout_s
    )
    logger = MetricsLogger(
        run_dir,
        tensorboard=cfg.logging.tensorboard,
        console=cfg.logging.progress_bars,
        rank=groups.rank,
        # Records past the restored state are redone (and re-logged) by this process.
        purge_step=state.global_update + 1 if resumed_from is not None else (0 if resume else None),
    )
    sync = torch.cuda.synchronize if torch.cuda.is_available() else None
    return Run(
        cfg=cfg,
        run_dir=run_dir,
        hf_dir=hf_dir,
        hf_config=hf_config,
        tokenizer=tokenizer,
        groups=groups,
        policy=policy,
        state=state,
        prompts=prompts,
        benchmarks=benchmarks,
        reward_fn=reward_fn,
        logger=logger,
        timer=Timer(sync=sync),
        resumed_from=resumed_from,
        extra_timers=dict(state.timers),
    )


def _base_model(cfg: RunConfig, run_dir: Path, *, is_writer: bool) -> Path:
    """Rank 0 builds (or finds cached) the starting Hugging Face directory; the others wait for it."""
    from megatron_mugrpo.warmstart import prepare_base_model

    target = run_dir / "base_model"
    if is_writer:
        hf_dir = prepare_base_model(cfg, target)
    barrier()
    return hf_dir if is_writer else (Path(cfg.model.hf_dir) if cfg.model.hf_dir else target)


def _initial_weights(
    policy: Policy, hf_dir: Path, run_dir: Path, *, resume: bool, checkpoint: Path | None
) -> tuple[TrainerState, Path | None]:
    """Load the latest checkpoint when resuming (or a given one); otherwise the base HF weights."""
    step_dir = checkpoint or (latest_checkpoint(run_dir / "checkpoints") if resume else None)
    if step_dir is not None:
        loaded = load_checkpoint(step_dir, policy.model_chunks, policy.optimizer, policy.scheduler)
        return loaded.trainer_state, step_dir
    from conversion import load_hf_into_model

    load_hf_into_model(policy.unwrapped(), hf_dir)
    policy.weights_loaded()  # optimizers holding fp32 main copies re-read the loaded weights
    return TrainerState(), None


def sync_engine(run: Run) -> None:
    """Push the current policy weights to rank 0's rollout engine (built on first use).

    Every model-parallel rank iterates ``export_hf`` (its tensors are gathered collectively); only
    rank 0 hands them to the engine. Weights travel in memory, never through disk, unless
    ``rollout.quantization`` needs a quantized checkpoint (SGLang; see ``rollout.quantization``).
    """
    from conversion import export_hf

    tensors = export_hf(run.policy.unwrapped(), run.hf_config)
    if not run.is_writer:
        for _ in tensors:
            pass
        return
    cfg = run.cfg
    calibration = stage_prompts(run.prompts, run.state.stage, cfg.stages.train_groups, cfg.data.seed)
    run.engine = load_behaviour_policy(
        run.engine,
        tensors,
        engine_name=cfg.rollout.engine,
        hf_dir=run.hf_dir,
        build=lambda hf_dir: build_engine_from_config(cfg.rollout, hf_dir, seed=cfg.seed),
        quantizer=behaviour_quantizer(cfg.rollout, calibration, run.run_dir / "behaviour_policy"),
    )
