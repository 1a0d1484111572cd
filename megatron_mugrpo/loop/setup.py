"""Setting up (or resuming) a run, the composition root: everything the loops in ``loop/`` operate on.

``open_run`` builds, in order (the verb has locked the run directory before judging it, see
``cli.locked_run_dir``): the cheap inputs that a typo breaks (the tokenizer, the prompts, the
benchmarks, the reward), so that bad data fails in seconds; the process groups; only then the base
Hugging Face model (the user's, or the demo's locally built and warm-started one), the Megatron
policy with its optimizer and the weights (from where the verb's ``Opening`` says: ``loop/opening.py``),
the trainer's parts (scoring settings every trainer pass shares, cadence, checkpoint writer, replay),
the metrics logger, and the rollout engines' placement: every rank belongs to an engine group of
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
from pathlib import Path
from typing import Any

import torch

from megatron_mugrpo.config import RunConfig
from megatron_mugrpo.errors import InputError
from megatron_mugrpo.evaluation import Benchmark
from megatron_mugrpo.loop.cadence import Cadence
from megatron_mugrpo.loop.hdr import open_replay
from megatron_mugrpo.loop.opening import Opening
from megatron_mugrpo.loop.run import Inputs, Origin, Run, Telemetry, TrainerParts
from megatron_mugrpo.metrics import MetricsLogger, Timer
from megatron_mugrpo.rewards.registry import RewardSet
from megatron_mugrpo.rollout.placement import EnginePlacement, HostGroup
from megatron_mugrpo.rollout.prompts import load_benchmark, load_prompts
from megatron_mugrpo.rundir import Claim, claim, record_config
from megatron_mugrpo.state import TrainerState
from megatron_mugrpo.training.checkpoint import (
    CheckpointSaver,
    read_metadata,
)
from megatron_mugrpo.training.parallel import ParallelGroups, check_hf_model_parallelism, initialize_parallel
from megatron_mugrpo.training.setup import build_policy
from megatron_mugrpo.training.stage_reference import ScoreSettings


def set_determinism(cfg: RunConfig) -> None:
    """Deterministic kernels, so a resumed CPU run equals an uninterrupted one (seeds: initialize_parallel)."""
    torch.use_deterministic_algorithms(cfg.deterministic, warn_only=True)


def open_run(
    cfg: RunConfig, run_dir: Path, opening: Opening, *, claimed: Claim | None = None, world_size: int | None = None
) -> Run:
    """Build this rank's Run, opened as ``opening`` says (its weights, its metrics, its history entry).

    Rank 0 holds the run directory's lock (``claimed``: the verb took it before judging the
    directory, see ``cli.locked_run_dir``; taken here when None) until ``Run.close()``. Once
    everything is set up it writes config.yaml with the history entry ``opening.record``, so a
    directory becomes a run only when set-up succeeded; a failed set-up removes the directory it
    created. ``world_size``: the trainer ranks when they are fewer than the launch's processes (async
    mode).
    """
    set_determinism(cfg)
    inputs: Inputs | None = None
    try:
        inputs = read_inputs(cfg)  # seconds: bad data fails here, on every rank alike, before any model exists
        groups = _process_groups(cfg, world_size)
        if claimed is None and groups.rank == 0:
            claimed = claim(run_dir)
        rollout = cfg.rollout
        placement = EnginePlacement.from_env(
            tensor_parallel=rollout.tensor_parallel, cpu_threads=rollout.cpu_threads, world_size=groups.world_size
        )
        hosts = HostGroup.create(placement)  # collective: every rank, before anything can fail on one rank only
        run = _set_up(cfg, run_dir, groups, hosts, inputs, opening)
        if claimed is not None and opening.record is not None:
            record_config(cfg, run_dir, event=opening.record)  # last: from here on the directory is a run
    except BaseException:
        if inputs is not None:
            inputs.reward_fn.close()
        if claimed is not None:
            claimed.abandon()
        raise
    run.lock = claimed.lock if claimed is not None else None
    hosts.barrier()
    return run


def _process_groups(cfg: RunConfig, world_size: int | None) -> ParallelGroups:
    parallel = cfg.parallel
    return initialize_parallel(
        parallel.tensor_parallel,
        parallel.pipeline_parallel,
        cfg.seed,
        world_size=world_size,
        ep=parallel.expert_parallel,
        etp=parallel.expert_tensor_parallel,
        timeout_s=parallel.timeout_s,
    )


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
    from megatron_mugrpo.char_tokenizer import build_char_tokenizer, load_tokenizer_dir

    if cfg.model.hf_dir:
        return load_tokenizer_dir(cfg.model.hf_dir)  # the demos' character tokenizer kept as built
    with tempfile.TemporaryDirectory() as tmp:
        build_char_tokenizer(tmp)
        return load_tokenizer_dir(tmp)


def _set_up(
    cfg: RunConfig, run_dir: Path, groups: ParallelGroups, hosts: HostGroup, inputs: Inputs, opening: Opening
) -> Run:
    """Base model, policy, weights and the trainer's parts of one rank (the inputs are already checked)."""
    hf_dir = _base_model(cfg, run_dir, hosts)
    check_hf_model_parallelism(hf_dir, cfg.parallel)
    from megatron_mugrpo.conversion.hf_io import load_hf_config

    hf_config = load_hf_config(hf_dir)
    checkpoint_root = run_dir / "checkpoints"
    _check_checkpoint_model(hf_config, opening.start_from(checkpoint_root))
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
    state, resumed_from = opening.load_weights(policy, hf_dir, checkpoint_root)
    return Run(
        cfg=cfg,
        run_dir=run_dir,
        groups=groups,
        hosts=hosts,
        policy=policy,
        state=state,
        origin=Origin(hf_dir=hf_dir, hf_config=hf_config, resumed_from=resumed_from),
        inputs=inputs,
        trainer=trainer_parts(cfg, checkpoint_root, groups, inputs.tokenizer, resumed_from),
        telemetry=_telemetry(cfg, run_dir, groups.rank, state, resumed_from, opening),
    )


def trainer_parts(
    cfg: RunConfig, checkpoint_root: Path, groups: ParallelGroups, tokenizer: Any, resumed_from: Path | None
) -> TrainerParts:
    """The trainer's scoring settings, cadence, checkpoint writer and replay state, each from its section."""
    checkpoint = cfg.checkpoint
    return TrainerParts(
        scoring=score_settings(cfg, tokenizer),
        cadence=Cadence(
            eval_every=cfg.eval.every_updates,
            checkpoint_every=checkpoint.every_updates,
            checkpoint_every_stages=checkpoint.every_stages,
        ),
        checkpoints=CheckpointSaver(
            checkpoint_root,
            groups=groups,
            async_save=checkpoint.async_save,
            fsync=checkpoint.fsync,
            keep_last=checkpoint.keep_last,
        ),
        replay=open_replay(cfg.replay, cfg.stages.train_groups, resumed_from),
    )


def score_settings(cfg: RunConfig, tokenizer: Any) -> ScoreSettings:
    """The one set of scoring settings: the update, the stage reference and HDR's re-scoring agree by construction."""
    return ScoreSettings(
        temperature=cfg.rollout.temperature,
        micro_batch_size=cfg.parallel.micro_batch_size,
        impl=cfg.kernels.logprob_impl,
        logits_budget_mib=cfg.kernels.logits_budget_mib,
        micro_batch_tokens=cfg.parallel.micro_batch_tokens,
        pack_sequences=cfg.parallel.pack_sequences,
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


def _telemetry(
    cfg: RunConfig, run_dir: Path, rank: int, state: TrainerState, resumed_from: Path | None, opening: Opening
) -> Telemetry:
    """The run's logger (appending, or first dropping the records of work this process redoes), its
    timer, and the time earlier processes of the run spent."""
    source, tensorboard_dir = opening.metrics_source(resumed_from)
    logger = MetricsLogger(
        run_dir,
        tensorboard=cfg.logging.tensorboard,
        console=cfg.logging.progress_bars,
        rank=rank,
        keep_records=opening.keep_records(state, resumed_from),
        source=source,
        tensorboard_dir=tensorboard_dir,
    )
    sync = torch.cuda.synchronize if torch.cuda.is_available() else None
    return Telemetry(logger=logger, timer=Timer(sync=sync), extra_timers=dict(state.timers))


def _base_model(cfg: RunConfig, run_dir: Path, hosts: HostGroup) -> Path:
    """Rank 0 builds (or finds cached) the starting Hugging Face directory; the others wait for it."""
    from megatron_mugrpo.warmstart import prepare_base_model

    target = run_dir / "base_model"
    is_writer = hosts.placement.rank == 0
    if is_writer:
        hf_dir = prepare_base_model(cfg, target)
    hosts.barrier()
    return hf_dir if is_writer else (Path(cfg.model.hf_dir) if cfg.model.hf_dir else target)
