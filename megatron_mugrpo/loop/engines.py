"""The rollout engines seen from the loops: push the policy's weights, free the memory, and the
behaviour policy context that completes a rollout store made by an older policy.

Every engine host holds one engine (``rollout/placement.py``), built at the first weight sync and
kept for the whole run, released between phases. Each sync hands the host a ``WatchedEngine``
(``rollout/watchdog.py``): an engine that dies or stops making progress while it generates is shut
down and rebuilt from the host's own copy of the sync's weights, and the call is made again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch

from megatron_mugrpo.asynchronous.liveness import doing
from megatron_mugrpo.conversion.live import NamedTensors, export_policy
from megatron_mugrpo.loop.run import Run, RunError
from megatron_mugrpo.metric_names import WEIGHT_SYNC_GB_PER_S, WEIGHT_SYNC_S
from megatron_mugrpo.rollout.engine import RolloutEngine, build_engine_from_config
from megatron_mugrpo.rollout.prompts import stage_prompts
from megatron_mugrpo.rollout.quantization import behaviour_quantizer, load_behaviour_policy
from megatron_mugrpo.rollout.watchdog import RESTARTS_METRIC, HostWeights, WatchedEngine, engine_label
from megatron_mugrpo.training.checkpoint import load_checkpoint, step_dir_name

log = logging.getLogger(__name__)


def sync_engine(run: Run) -> dict[str, float]:
    """Push the current policy weights to every engine host's engine (each built on first use).

    ``export_policy`` yields full Hugging Face tensors on every rank; each host hands them to its
    engine in memory (SGLang: in buckets through ``update_weights_from_tensor``), the other ranks
    drain them. Returns rank 0's ``perf/weight_sync_s`` and ``perf/weight_sync_gb_per_s`` (export +
    load, bytes as exported), for the caller to log with the phase's other metrics (one record). With
    ``rollout.quantization`` the hosts load the quantized behaviour policy instead (SGLang through a
    quantized checkpoint in RUN_DIR/behaviour_policy/engine_E; see ``rollout.quantization``).
    """
    started = time.perf_counter()
    counted = export_policy(
        run.policy, run.origin.hf_config, run.groups, consume=run.placement.is_host, use=lambda t: _load_engine(run, t)
    )
    if counted is None:
        return {}
    seconds = time.perf_counter() - started
    return {WEIGHT_SYNC_S: seconds, WEIGHT_SYNC_GB_PER_S: counted / 1e9 / max(seconds, 1e-9)}


def _load_engine(run: Run, tensors: NamedTensors) -> int:
    """Load the exported tensors into this host's engine (built on first use) and put it under the
    watchdog, with a host copy of the tensors to rebuild it from (``rollout.max_restarts`` > 0);
    returns their bytes."""
    cfg, counted = run.cfg, _CountedBytes(tensors)
    calibration = stage_prompts(run.inputs.prompts, run.state.stage, cfg.stages.train_groups, cfg.data.seed)
    export_dir = run.run_dir / "behaviour_policy" / f"engine_{run.placement.engine_index:03d}"  # one per host

    def load(engine: RolloutEngine | None, named: NamedTensors) -> RolloutEngine:
        return load_behaviour_policy(
            engine,
            named,
            engine_name=cfg.rollout.engine,
            hf_dir=run.origin.hf_dir,
            build=lambda hf_dir: build_engine_from_config(
                cfg.rollout,
                hf_dir,
                seed=cfg.seed,
                placement=run.placement,
                record_routes=cfg.moe.routing_replay == "rollout",  # the trainer replays them (rollout.routes)
            ),
            quantizer=behaviour_quantizer(cfg.rollout, calibration, export_dir),
        )

    kept = _host_copy(run.engine) if cfg.rollout.max_restarts > 0 else None
    current = run.engine.engine if isinstance(run.engine, WatchedEngine) else run.engine
    engine = load(current, kept.tee(counted) if kept is not None else counted)
    run.engine = WatchedEngine(
        engine,
        rebuild=(lambda: load(None, kept)) if kept is not None else None,  # a new engine, the same weights
        host_weights=kept,
        progress_timeout_s=cfg.rollout.progress_timeout_s,
        max_restarts=cfg.rollout.max_restarts,
        label=engine_label(run.placement.engine_index, run.placement.rank),
        where=lambda: doing() or f"in stage {run.state.stage}",
    )
    return counted.bytes


def _host_copy(engine: RolloutEngine | None) -> HostWeights:
    """The last sync's host copy, whose buffers the new weights refill, or a new one."""
    previous = engine.host_weights if isinstance(engine, WatchedEngine) else None
    return previous if previous is not None else HostWeights()


def restart_metrics(run: Run) -> dict[str, float]:
    """``perf/rollout_engine_restarts``: engine restarts since the last weight sync, summed over every
    engine host, on rank 0 (``{}`` elsewhere). Collective: every rank calls it after the rollout."""
    restarts = run.engine.restarts if isinstance(run.engine, WatchedEngine) else 0
    counts = run.hosts.gather(restarts)
    return {RESTARTS_METRIC: float(sum(counts))} if counts is not None else {}


class _CountedBytes:
    """Passes (name, tensor) pairs through, adding up their bytes."""

    def __init__(self, tensors: Iterable[tuple[str, torch.Tensor]]):
        self.tensors, self.bytes = tensors, 0

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self.tensors:
            self.bytes += tensor.numel() * tensor.element_size()
            yield name, tensor


def release_engine(run: Run) -> None:
    """Free this host's engine memory for the optimizer phase (the next sync brings the weights back).

    An engine whose ``release_frees_memory`` is False (the transformers engine on the CPU) keeps its
    model: releasing would free nothing the trainer needs and cost a rebuild at the next sync. Engines
    without the attribute (SGLang) always release."""
    if run.engine is not None and getattr(run.engine, "release_frees_memory", True):
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
    if run.origin.resumed_from is None or not (step_dir.is_dir() or version == 0):
        raise RunError(
            f"a rollout store of this run was generated by the policy of update {version}, and completing it needs "
            f"that policy, but {step_dir} does not exist (checkpoint.keep_last pruned it?). Delete the stage's "
            "directory under rollouts/ to generate the stage afresh with the current policy"
        )
    log.warning("loading the policy of update %d (%s) to complete its rollout store", version, step_dir)
    if step_dir.is_dir():
        load_checkpoint(step_dir, run.policy.model_chunks, groups=run.policy.groups, load_rng=False)
    else:
        from megatron_mugrpo.conversion import load_hf_into_model

        load_hf_into_model(run.policy.unwrapped(), run.origin.hf_dir, run.policy.groups)
    try:
        yield
    finally:
        load_checkpoint(
            run.origin.resumed_from,
            run.policy.model_chunks,
            run.policy.optimizer,
            run.policy.scheduler,
            groups=run.policy.groups,
        )
