"""Setting up (or resuming) a run: everything the staged loop in ``stages.py`` operates on.

``open_run`` builds, in order: the process groups, the base Hugging Face model (the user's, or the
demo's locally built and warm-started one), the Megatron policy with its optimizer, the weights
(from the latest checkpoint when resuming, else from the Hugging Face directory), the prompts,
benchmarks, verifier and metrics logger, and places the rollout engines: every rank belongs to an
engine group of ``rollout.tensor_parallel`` ranks whose first rank hosts one engine (see
``rollout/placement.py``). Each host's engine is created at the first weight sync and lives for the
whole run, released between phases; every host generates, evaluates and scores rewards with its
own verifier pool.

Run directory layout (its guarantees, lock and config written last, are in ``rundir.py``)::

    RUN_DIR/config.yaml          the run's configuration (what `train --resume` continues with);
                                 written last in set-up, so a directory is a run once set-up succeeded
    RUN_DIR/config_history.json  creation and every accepted change on resume (see resume.py)
    RUN_DIR/.lock                held by the process writing the run
    RUN_DIR/base_model/          the demo's built model (absent with model.hf_dir)
    RUN_DIR/rollouts/stage_K/    rollout dataset D_k (sharded, checksummed manifest)
    RUN_DIR/checkpoints/         step_XXXXXXXX/ directories and the `latest` pointer
    RUN_DIR/behaviour_policy/    engine_E/: engine E's quantized checkpoint (rollout.quantization with SGLang only)
    RUN_DIR/metrics.jsonl, RUN_DIR/tensorboard/, RUN_DIR/report/
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_mugrpo.config import RunConfig, check_hf_model_parallelism, load_config
from megatron_mugrpo.errors import InputError
from megatron_mugrpo.evaluation import Benchmark
from megatron_mugrpo.metrics import TENSORBOARD_DIR, MetricsLogger, Timer
from megatron_mugrpo.replay import ReplayState, open_replay
from megatron_mugrpo.rollout.engine import RolloutEngine, build_engine_from_config, shutdown_engine
from megatron_mugrpo.rollout.placement import EnginePlacement, HostGroup
from megatron_mugrpo.rollout.prompts import PromptRecord, load_benchmark, load_prompts
from megatron_mugrpo.rollout.prompts import stage_prompts as stage_prompts  # re-exported: it moved to the prompts
from megatron_mugrpo.rollout.quantization import behaviour_quantizer, load_behaviour_policy
from megatron_mugrpo.rollout.rewards import RewardFn, build_reward
from megatron_mugrpo.rundir import CONFIG_FILE, RunLock, claim, record_config
from megatron_mugrpo.state import TrainerState
from megatron_mugrpo.training.checkpoint import (
    CheckpointSaver,
    latest_checkpoint,
    load_checkpoint,
    load_latest_intact,
    read_metadata,
    step_dir_name,
)
from megatron_mugrpo.training.parallel import ParallelGroups, initialize_parallel
from megatron_mugrpo.training.setup import Policy, build_policy, resolve_dtype

log = logging.getLogger(__name__)


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
    hosts: HostGroup
    """This rank's place among the rollout engine groups, and the group the hosts coordinate on."""
    policy: Policy
    state: TrainerState
    prompts: list[PromptRecord]
    benchmarks: list[Benchmark]
    reward_fn: RewardFn
    logger: MetricsLogger
    timer: Timer
    checkpoints: CheckpointSaver
    """Writes RUN_DIR/checkpoints (in the background with checkpoint.async_save)."""
    engine: RolloutEngine | None = None
    """This rank's rollout engine when it hosts one (None elsewhere, and before the first weight sync)."""
    replay: ReplayState | None = None
    """Headroom-Drift Replay buffer and the current stage's decision (None: replay is off)."""
    resumed_from: Path | None = None
    extra_timers: dict[str, float] = field(default_factory=dict)
    """perf/ seconds accumulated by earlier processes of this run (restored from the checkpoint)."""
    started: float = field(default_factory=time.monotonic)
    """When this process opened the run (for perf/t_total_s)."""
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
        self.checkpoints.close()  # publish a checkpoint still being written
        # The reward pool first: SGLang's engine shutdown kills every child process of this one.
        self.reward_fn.close()
        if self.engine is not None:
            shutdown_engine(self.engine)
        self.logger.close()
        if self.lock is not None:
            self.lock.release()


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
    cfg: RunConfig,
    run_dir: Path,
    *,
    resume: bool,
    checkpoint: Path | None = None,
    record: str | None = None,
    redo_after_checkpoint: bool = False,
    standalone: str | None = None,
    replace_failed_start: bool = False,
    world_size: int | None = None,
) -> Run:
    """Build this rank's Run. ``resume`` loads the latest checkpoint (or ``checkpoint``) when one exists.

    Rank 0 locks the run directory first and keeps the lock until ``Run.close()``. Once everything
    is set up it writes config.yaml with the history entry ``record`` (None: the stored config is
    unchanged), so a directory becomes a run only when set-up succeeded; a failed set-up removes the
    directory it created. ``redo_after_checkpoint``: this verb redoes the work logged after the
    checkpoint (train --resume, optimize), whose metrics records are dropped first. ``standalone``
    (e.g. 'eval') marks every metrics record as that command's, never dropped by a later resume.
    ``world_size``: the trainer ranks when they are fewer than the launch's processes (async mode).
    """
    set_determinism(cfg)
    parallel = cfg.parallel
    groups = initialize_parallel(parallel.tensor_parallel, parallel.pipeline_parallel, cfg.seed, world_size=world_size)
    claimed = claim(run_dir, replace_failed_start=replace_failed_start) if groups.rank == 0 else None
    try:
        run = _set_up(
            cfg,
            run_dir,
            groups,
            resume=resume,
            checkpoint=checkpoint,
            redo_after_checkpoint=redo_after_checkpoint,
            standalone=standalone,
        )
        if claimed is not None and record is not None:
            record_config(cfg, run_dir, event=record)  # last: from here on the directory is a run
    except BaseException:
        if claimed is not None:
            claimed.abandon()
        raise
    run.lock = claimed.lock if claimed is not None else None
    barrier()
    return run


def _set_up(
    cfg: RunConfig,
    run_dir: Path,
    groups: ParallelGroups,
    *,
    resume: bool,
    checkpoint: Path | None,
    redo_after_checkpoint: bool,
    standalone: str | None,
) -> Run:
    """Base model, policy, weights, prompts, benchmarks, verifier and metrics logger of one rank."""
    placement = EnginePlacement.from_env(
        tensor_parallel=cfg.rollout.tensor_parallel, cpu_threads=cfg.rollout.cpu_threads, world_size=groups.world_size
    )
    hosts = HostGroup.create(placement)
    hf_dir = _base_model(cfg, run_dir, is_writer=groups.rank == 0)
    check_hf_model_parallelism(hf_dir, cfg.parallel)
    from transformers import AutoTokenizer

    from conversion.hf_io import load_hf_config

    tokenizer = AutoTokenizer.from_pretrained(str(hf_dir))
    hf_config = load_hf_config(hf_dir)
    _check_checkpoint_model(hf_config, checkpoint or (latest_checkpoint(run_dir / "checkpoints") if resume else None))
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
    checkpoints = CheckpointSaver(
        run_dir / "checkpoints",
        groups=groups,
        async_save=cfg.checkpoint.async_save,
        fsync=cfg.checkpoint.fsync,
        keep_last=cfg.checkpoint.keep_last,
    )
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
    logger = _metrics_logger(cfg, run_dir, groups.rank, state, resumed_from, redo_after_checkpoint, standalone)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else None
    return Run(
        cfg=cfg,
        run_dir=run_dir,
        hf_dir=hf_dir,
        hf_config=hf_config,
        tokenizer=tokenizer,
        groups=groups,
        hosts=hosts,
        policy=policy,
        state=state,
        checkpoints=checkpoints,
        prompts=prompts,
        benchmarks=benchmarks,
        reward_fn=reward_fn,
        logger=logger,
        timer=Timer(sync=sync),
        resumed_from=resumed_from,
        replay=open_replay(cfg, resumed_from),
        extra_timers=dict(state.timers),
    )


def _check_checkpoint_model(hf_config: dict[str, Any], step_dir: Path | None) -> None:
    """Before building anything: the model must have the checkpoint's shape (else a clear error, not a
    tensor-shape failure deep inside the loader). A checkpoint whose metadata is unreadable is left to
    the loader, which reports it."""
    from megatron_mugrpo.resume import check_same_model

    if step_dir is None:
        return
    try:
        saved = read_metadata(step_dir)["hf_config"]
    except InputError:
        return
    check_same_model(hf_config, saved, step_dir)


def _metrics_logger(
    cfg: RunConfig,
    run_dir: Path,
    rank: int,
    state: TrainerState,
    resumed_from: Path | None,
    redo_after_checkpoint: bool,
    standalone: str | None,
) -> MetricsLogger:
    """The run's logger: appending, or first dropping the records of work this process redoes."""
    keep_records = purge_step = None
    if redo_after_checkpoint and resumed_from is None:
        keep_records = 0  # no checkpoint: everything logged so far is redone
    elif redo_after_checkpoint and state.metrics_records is not None:
        keep_records = state.metrics_records
    elif redo_after_checkpoint:  # a checkpoint written before record counts were stored
        purge_step = state.global_update + 1
    source, tensorboard_dir = None, TENSORBOARD_DIR
    if standalone is not None:  # its own TensorBoard run: an older step written later would hide newer points
        evaluated = resumed_from.name if resumed_from is not None else "base_model"
        source, tensorboard_dir = f"mugrpo {standalone} of {evaluated}", f"{TENSORBOARD_DIR}/{standalone}_{evaluated}"
    return MetricsLogger(
        run_dir,
        tensorboard=cfg.logging.tensorboard,
        console=cfg.logging.progress_bars,
        rank=rank,
        keep_records=keep_records,
        purge_step=purge_step,
        source=source,
        tensorboard_dir=tensorboard_dir,
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
    """Load the given checkpoint, or when resuming the newest intact one (damaged ones are skipped with
    a warning); otherwise the base HF weights."""
    if checkpoint is not None:
        loaded = load_checkpoint(
            checkpoint, policy.model_chunks, policy.optimizer, policy.scheduler, groups=policy.groups
        )
        return loaded.trainer_state, checkpoint
    if resume:
        args = (policy.model_chunks, policy.optimizer, policy.scheduler)
        intact = load_latest_intact(run_dir / "checkpoints", *args, groups=policy.groups)
        if intact is not None:
            return intact.trainer_state, intact.step_dir
    from conversion import load_hf_into_model

    load_hf_into_model(policy.unwrapped(), hf_dir, policy.groups)
    policy.weights_loaded()  # optimizers holding fp32 main copies re-read the loaded weights
    return TrainerState(), None


def sync_engine(run: Run) -> dict[str, float]:
    """Push the current policy weights to every engine host's engine (each built on first use).

    ``export_hf`` is collective within each model-parallel group and yields full Hugging Face
    tensors on every rank; each host hands them to its engine in memory (SGLang: in buckets through
    ``update_weights_from_tensor``), the other ranks drain them. Returns, and logs, rank 0's
    ``perf/weight_sync_s`` and ``perf/weight_sync_gb_per_s`` (export + load, bytes as exported).
    With ``rollout.quantization`` the hosts load the quantized behaviour policy instead (SGLang
    through a quantized checkpoint in RUN_DIR/behaviour_policy/engine_E; see ``rollout.quantization``).
    """
    from conversion import export_hf

    started = time.perf_counter()
    tensors = export_hf(run.policy.unwrapped(), run.hf_config, run.groups)
    if not run.placement.is_host:
        for _ in tensors:
            pass
        return {}
    cfg, counted = run.cfg, _CountedBytes(tensors)
    calibration = stage_prompts(run.prompts, run.state.stage, cfg.stages.train_groups, cfg.data.seed)
    export_dir = run.run_dir / "behaviour_policy" / f"engine_{run.placement.engine_index:03d}"  # one per host
    run.engine = load_behaviour_policy(
        run.engine,
        counted,
        engine_name=cfg.rollout.engine,
        hf_dir=run.hf_dir,
        build=lambda hf_dir: build_engine_from_config(cfg.rollout, hf_dir, seed=cfg.seed, placement=run.placement),
        quantizer=behaviour_quantizer(cfg.rollout, calibration, export_dir),
    )
    seconds = time.perf_counter() - started
    metrics = {"perf/weight_sync_s": seconds, "perf/weight_sync_gb_per_s": counted.bytes / 1e9 / max(seconds, 1e-9)}
    run.logger.log(metrics, step=run.state.global_update)
    return metrics


class _CountedBytes:
    """Passes (name, tensor) pairs through, adding up their bytes."""

    def __init__(self, tensors: Iterable[tuple[str, torch.Tensor]]):
        self.tensors, self.bytes = tensors, 0

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self.tensors:
            self.bytes += tensor.numel() * tensor.element_size()
            yield name, tensor


def release_engine(run: Run) -> None:
    """Free this host's engine memory for the optimizer phase (the next sync brings the weights back)."""
    if run.engine is not None:
        run.engine.release()


@contextmanager
def behaviour_policy(run: Run, version: int) -> Iterator[None]:
    """Inside the block the policy holds the weights of update ``version``.

    That is the current policy, except when a rollout store made by an older policy must be
    completed: a damaged shard of the stage a run resumed in the middle of, or ``mugrpo generate
    --stage K`` for a stage trained past. Its missing shards must come from the policy that made
    the others, so its weights are loaded from that update's checkpoint (the base model for update
    0), and the trainer's state is reloaded afterwards from the checkpoint this process resumed from.
    """
    if version == run.state.global_update:
        yield
        return
    step_dir = run.checkpoint_root / step_dir_name(version)
    if run.resumed_from is None or not (step_dir.is_dir() or version == 0):
        raise RunError(
            f"a rollout store of this run was generated by the policy of update {version}, and completing it needs "
            f"that policy, but {step_dir} does not exist (checkpoint.keep_last pruned it?). Delete the stage's "
            "directory under rollouts/ to generate the stage afresh with the current policy"
        )
    log.warning("loading the policy of update %d (%s) to complete its rollout store", version, step_dir)
    if step_dir.is_dir():
        load_checkpoint(step_dir, run.policy.model_chunks, groups=run.policy.groups, load_rng=False)
    else:
        from conversion import load_hf_into_model

        load_hf_into_model(run.policy.unwrapped(), run.hf_dir, run.policy.groups)
    try:
        yield
    finally:
        load_checkpoint(
            run.resumed_from,
            run.policy.model_chunks,
            run.policy.optimizer,
            run.policy.scheduler,
            groups=run.policy.groups,
        )
