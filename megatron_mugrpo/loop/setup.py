"""Setting up (or resuming) a run, the composition root: everything the loops in ``loop/`` operate on.

``open_run`` builds, in order (the verb has locked the run directory before judging it, see
``cli.locked_run_dir``): the cheap inputs that a typo breaks (the tokenizer, the prompts, the
benchmarks, the reward), so that bad data fails in seconds; the process groups; only then the base
Hugging Face model (the user's, or the demo's locally built and warm-started one), the Megatron
policy with its optimizer and the weights (from the latest checkpoint when resuming, else from the
Hugging Face directory), the metrics logger, the scoring settings every trainer pass shares, and
the rollout engines' placement: every rank belongs to an engine group of
``rollout.tensor_parallel`` ranks whose first rank hosts one engine (see ``rollout/placement.py``).
Each host's engine is created at the first weight sync and lives for the whole run, released
between phases; every host generates, evaluates and scores rewards with its own verifier pool.

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

import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from megatron_mugrpo.config import RunConfig
from megatron_mugrpo.errors import InputError
from megatron_mugrpo.evaluation import Benchmark
from megatron_mugrpo.loop.cadence import Cadence
from megatron_mugrpo.loop.hdr import ReplayState, open_replay
from megatron_mugrpo.metrics import TENSORBOARD_DIR, MetricsLogger, Timer
from megatron_mugrpo.rewards.registry import RewardSet
from megatron_mugrpo.rollout.engine import RolloutEngine, shutdown_engine
from megatron_mugrpo.rollout.placement import EnginePlacement, HostGroup
from megatron_mugrpo.rollout.prompts import PromptRecord, load_benchmark, load_prompts
from megatron_mugrpo.rundir import Claim, RunLock, claim, record_config
from megatron_mugrpo.state import TrainerState
from megatron_mugrpo.training.checkpoint import (
    CheckpointSaver,
    latest_checkpoint,
    load_checkpoint,
    load_latest_intact,
    read_metadata,
)
from megatron_mugrpo.training.parallel import ParallelGroups, check_hf_model_parallelism, initialize_parallel
from megatron_mugrpo.training.setup import Policy, build_policy
from megatron_mugrpo.training.stage_reference import ScoreSettings


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
    """This rank's place among the rollout engine groups, and the group every rank coordinates on."""
    policy: Policy
    scoring: ScoreSettings
    """How every trainer pass scores responses (the update, the stage reference, HDR's re-scoring)."""
    cadence: Cadence
    """When both loops evaluate and checkpoint."""
    state: TrainerState
    prompts: list[PromptRecord]
    benchmarks: list[Benchmark]
    reward_fn: RewardSet
    """The training data's reward (``score``) and every benchmark's, started and closed together."""
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


@dataclass(kw_only=True)
class Inputs:
    """What a run reads before it builds any model: seconds of work, where a typo in the data shows."""

    tokenizer: Any
    prompts: list[PromptRecord]
    benchmarks: list[Benchmark]
    reward_fn: RewardSet


def set_determinism(cfg: RunConfig) -> None:
    """Deterministic kernels, so a resumed CPU run equals an uninterrupted one (seeds: initialize_parallel)."""
    torch.use_deterministic_algorithms(cfg.deterministic, warn_only=True)


def open_run(
    cfg: RunConfig,
    run_dir: Path,
    *,
    resume: bool,
    claimed: Claim | None = None,
    checkpoint: Path | None = None,
    record: str | None = None,
    redo_after_checkpoint: bool = False,
    standalone: str | None = None,
    replace_failed_start: bool = False,
    world_size: int | None = None,
) -> Run:
    """Build this rank's Run. ``resume`` loads the latest checkpoint (or ``checkpoint``) when one exists.

    Rank 0 holds the run directory's lock (``claimed``: the verb took it before judging the
    directory, see ``cli.locked_run_dir``; taken here when None) until ``Run.close()``. Once
    everything is set up it writes config.yaml with the history entry ``record`` (None: the stored
    config is unchanged), so a directory becomes a run only when set-up succeeded; a failed set-up
    removes the directory it created. ``redo_after_checkpoint``: this verb redoes the work logged
    after the checkpoint (train --resume, optimize), whose metrics records are dropped first.
    ``standalone`` (e.g. 'eval') marks every metrics record as that command's, never dropped by a
    later resume. ``world_size``: the trainer ranks when they are fewer than the launch's processes
    (async mode).
    """
    set_determinism(cfg)
    inputs: Inputs | None = None
    try:
        inputs = read_inputs(cfg)  # seconds: bad data fails here, on every rank alike, before any model exists
        parallel = cfg.parallel
        groups = initialize_parallel(
            parallel.tensor_parallel,
            parallel.pipeline_parallel,
            cfg.seed,
            world_size=world_size,
            ep=parallel.expert_parallel,
            etp=parallel.expert_tensor_parallel,
            timeout_s=parallel.timeout_s,
        )
        if claimed is None and groups.rank == 0:
            claimed = claim(run_dir, replace_failed_start=replace_failed_start)
        rollout = cfg.rollout
        placement = EnginePlacement.from_env(
            tensor_parallel=rollout.tensor_parallel, cpu_threads=rollout.cpu_threads, world_size=groups.world_size
        )
        hosts = HostGroup.create(placement)  # collective: every rank, before anything can fail on one rank only
        run = _set_up(
            cfg,
            run_dir,
            groups,
            hosts,
            inputs,
            resume=resume,
            checkpoint=checkpoint,
            redo_after_checkpoint=redo_after_checkpoint,
            standalone=standalone,
        )
        if claimed is not None and record is not None:
            record_config(cfg, run_dir, event=record)  # last: from here on the directory is a run
    except BaseException:
        if inputs is not None:
            inputs.reward_fn.close()
        if claimed is not None:
            claimed.abandon()
        raise
    run.lock = claimed.lock if claimed is not None else None
    hosts.barrier()
    return run


def read_inputs(cfg: RunConfig) -> Inputs:
    """Tokenizer, prompts, benchmarks and rewards: read and checked before any model is built. The
    rewards come last: building the code reward checks its sandbox."""
    tokenizer = load_tokenizer(cfg)
    prompts = load_prompts(cfg.data, tokenizer, cfg.rollout.max_prompt_tokens)
    problems = [
        load_benchmark(
            bench,
            tokenizer,
            cfg.rollout.max_prompt_tokens,
            builtin_task=cfg.data.builtin_task,
            seed=cfg.data.seed,
            use_chat_template=cfg.data.use_chat_template,
        )
        for bench in cfg.eval.benchmarks
    ]
    rewards = RewardSet(cfg.reward, kinds=[cfg.benchmark_reward(bench) for bench in cfg.eval.benchmarks])
    benchmarks = [
        Benchmark(config=bench, problems=loaded, reward_fn=rewards.for_kind(cfg.benchmark_reward(bench)))
        for bench, loaded in zip(cfg.eval.benchmarks, problems)
    ]
    return Inputs(tokenizer=tokenizer, prompts=prompts, benchmarks=benchmarks, reward_fn=rewards)


def load_tokenizer(cfg: RunConfig) -> Any:
    """The run's tokenizer without its model: ``model.hf_dir``'s, or the demo's character tokenizer.

    The demo's is written and read back exactly as the built base model's is (``warmstart``), so it
    is the same tokenizer, available before the warm start has run.
    """
    from transformers import AutoTokenizer

    if cfg.model.hf_dir:
        return AutoTokenizer.from_pretrained(str(cfg.model.hf_dir))
    from megatron_mugrpo.rollout.tasks import build_char_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        build_char_tokenizer(tmp)
        return AutoTokenizer.from_pretrained(tmp)


def _set_up(
    cfg: RunConfig,
    run_dir: Path,
    groups: ParallelGroups,
    hosts: HostGroup,
    inputs: Inputs,
    *,
    resume: bool,
    checkpoint: Path | None,
    redo_after_checkpoint: bool,
    standalone: str | None,
) -> Run:
    """Base model, policy, weights and metrics logger of one rank (the inputs are already checked)."""
    hf_dir = _base_model(cfg, run_dir, hosts)
    check_hf_model_parallelism(hf_dir, cfg.parallel)
    from megatron_mugrpo.conversion.hf_io import load_hf_config

    hf_config = load_hf_config(hf_dir)
    resuming_from = checkpoint or (latest_checkpoint(run_dir / "checkpoints") if resume else None)
    _check_checkpoint_model(hf_config, resuming_from)
    policy = build_policy(
        hf_config,
        groups=groups,
        dtype=cfg.model.torch_dtype,
        optim=cfg.optim,
        use_distributed_optimizer=cfg.parallel.use_distributed_optimizer,
        fp8=cfg.kernels.fp8,
        sequence_parallel=cfg.parallel.sequence_parallel,
        moe=cfg.moe,
    )
    state, resumed_from = _initial_weights(policy, hf_dir, run_dir, resume=resume, checkpoint=checkpoint)
    checkpoints = CheckpointSaver(
        run_dir / "checkpoints",
        groups=groups,
        async_save=cfg.checkpoint.async_save,
        fsync=cfg.checkpoint.fsync,
        keep_last=cfg.checkpoint.keep_last,
    )
    logger = _metrics_logger(cfg, run_dir, groups.rank, state, resumed_from, redo_after_checkpoint, standalone)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else None
    return Run(
        cfg=cfg,
        run_dir=run_dir,
        hf_dir=hf_dir,
        hf_config=hf_config,
        tokenizer=inputs.tokenizer,
        groups=groups,
        hosts=hosts,
        policy=policy,
        scoring=score_settings(cfg, inputs.tokenizer),
        cadence=Cadence(
            eval_every=cfg.eval.every_updates,
            checkpoint_every=cfg.checkpoint.every_updates,
            checkpoint_every_stages=cfg.checkpoint.every_stages,
        ),
        state=state,
        checkpoints=checkpoints,
        prompts=inputs.prompts,
        benchmarks=inputs.benchmarks,
        reward_fn=inputs.reward_fn,
        logger=logger,
        timer=Timer(sync=sync),
        resumed_from=resumed_from,
        replay=open_replay(cfg.replay, cfg.stages.train_groups, resumed_from),
        extra_timers=dict(state.timers),
    )


def score_settings(cfg: RunConfig, tokenizer: Any) -> ScoreSettings:
    """The one set of scoring settings: the update, the stage reference and HDR's re-scoring agree by construction."""
    return ScoreSettings(
        temperature=cfg.rollout.temperature,
        micro_batch_size=cfg.parallel.micro_batch_size,
        impl=cfg.kernels.logprob_impl,
        logits_budget_mib=cfg.kernels.logits_budget_mib,
        pad_id=tokenizer.pad_token_id or 0,
        chunk_groups=cfg.stages.mini_groups,
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
    keep_records = None
    if redo_after_checkpoint:  # without a checkpoint everything logged so far is redone
        keep_records = state.metrics_records if resumed_from is not None else 0
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
        source=source,
        tensorboard_dir=tensorboard_dir,
    )


def _base_model(cfg: RunConfig, run_dir: Path, hosts: HostGroup) -> Path:
    """Rank 0 builds (or finds cached) the starting Hugging Face directory; the others wait for it."""
    from megatron_mugrpo.warmstart import prepare_base_model

    target = run_dir / "base_model"
    is_writer = hosts.placement.rank == 0
    if is_writer:
        hf_dir = prepare_base_model(cfg, target)
    hosts.barrier()
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
    from megatron_mugrpo.conversion import load_hf_into_model

    load_hf_into_model(policy.unwrapped(), hf_dir, policy.groups)
    policy.weights_loaded()  # optimizers holding fp32 main copies re-read the loaded weights
    return TrainerState(), None
