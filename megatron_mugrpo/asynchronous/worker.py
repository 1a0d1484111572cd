"""The rollout worker of async mode: generate prompt groups continuously with the latest published weights.

``run_worker`` runs on the last ``async.rollout_ranks`` ranks of an async launch (``cli.cmd_train``
dispatches by role). Its loop, one queue shard per turn::

    wait for room in the queue (workers pause while async.queue_groups groups are unconsumed)
    → apply newly published weights, if any: the newest directory, or the newest publication staged
      in memory (without async.partial_rollout between batches only: a whole batch, every VIGOR round
      included, is sampled by one policy)
    → pause (loading newer weights as they come) while the batch's groups would be dropped for
      their lag when the trainer reaches them (``batches.lag_pause``; counted in the shard's record)
    → generate and score batch b: its prompts are ``batches.prompt_range(async, b, w)`` of the seeded prompt
      stream (this worker is w) and every engine call is seeded from (stages.seed, w, b, round)
    → normalise advantages per group, tag every group with the policy version, append the shard

With env.enabled the worker holds the run's environment for its whole life (``envs.episodes.stage_env``:
without env.search.url the loopback search server starts once its tokenizer is known and stops when it
ends), every prompt gets G multi-turn trajectories (policy mask, turns, environment seconds; the queue
shard carries them as the rollout store does), and each shard's record carries the batch's environment
counts (``EnvTally``), which the trainer logs with the update that admits it. Under env.overlap=auto (the
default) the environment's calls overlap decoding on the transformers engine: a row waiting for its observation
does not hold up the batch's other rows (``envs.registry.env_overlap`` says why async runs default to it). A
batch whose trajectories fail beyond env.max_error_frac stops the worker with an ``EnvError`` naming the
environment and its last error, before its shard is written; the trainer reads it from the worker's failed
heartbeat.

With async.partial_rollout the engine also applies a staged publication between two decode steps
(``Worker.between_steps``, handed to it as an ``engine.Interrupt``): the batch's in-flight sequences go
on under the new weights, every token records the version that sampled it (``partial.group_versions``)
and a group's version is its oldest token's.

It never initialises torch.distributed's default group and never imports Megatron; with
async.publish=memory a background thread joins the publication group and stages each publication
(``publish.Staging``), which the loop applies where it loads new weights. Its engine has a seed of its own,
``engine_seed(seed, w)``. Its heartbeat carries its progress (every response generated, batch
written, and look at the trainer while it waits). It ends when the trainer's heartbeat says the run
is done, and fails with a message naming the trainer when that heartbeat stops or the trainer's
progress does (``liveness``). A
worker restarted after a crash continues at its first unrecorded batch (what it left half-written
is deleted first), so batch b holds the same prompts whichever process made it.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch

from megatron_mugrpo.algorithms.advantages import assign_advantages
from megatron_mugrpo.asynchronous.batches import lag_pause, prompt_range
from megatron_mugrpo.asynchronous.config import AsyncConfig, partial_rollout_problem
from megatron_mugrpo.asynchronous.files import AsyncPaths, write_json
from megatron_mugrpo.asynchronous.liveness import Heartbeat, Peer, advance
from megatron_mugrpo.asynchronous.partial import group_versions
from megatron_mugrpo.asynchronous.publish import Publication, Staging, Subscription, engine_digest, published_names
from megatron_mugrpo.asynchronous.roles import ProcessRole
from megatron_mugrpo.asynchronous.transport import Received
from megatron_mugrpo.envs.episodes import EnvTally, StageEnv, stage_env
from megatron_mugrpo.envs.registry import env_overlap
from megatron_mugrpo.errors import ConfigError
from megatron_mugrpo.records import RolloutGroup
from megatron_mugrpo.rewards.registry import RewardFn, RewardSet
from megatron_mugrpo.rollout.config import RolloutConfig
from megatron_mugrpo.rollout.engine import (
    Interrupt,
    RolloutEngine,
    build_engine_from_config,
    derive_seed,
    shutdown_engine,
)
from megatron_mugrpo.rollout.generate import generate_groups
from megatron_mugrpo.rollout.prompts import DataConfig, PromptRecord, load_prompts, prompt_slice
from megatron_mugrpo.rollout.queue import QueueWriter

log = logging.getLogger(__name__)

POLL_S = 0.05
"""Seconds between two looks at the queue bound or the publications while a worker waits."""
_GPU_PLACEMENT: dict[str, Callable[[int], dict[str, Any]]] = {
    "transformers": lambda gpu: {"device": f"cuda:{gpu}"},
    "sglang": lambda gpu: {"base_gpu_id": gpu},
}
"""Engine keywords that put a worker's engine on its own local GPU (torchrun's LOCAL_RANK)."""

T = TypeVar("T")


def engine_seed(seed: int, worker: int) -> int:
    """The engine seed of rollout worker ``worker`` (SGLang's ``random_seed``): one of its own, so that
    workers never draw the same random stream, and the same for that worker in every launch."""
    return derive_seed(seed, worker)


class WorkerConfig(Protocol):
    """The sections of a run's config a rollout worker reads (``config.RunConfig`` has them; the entry
    point hands it in, so this role never imports the config root)."""

    rollout: RolloutConfig
    async_: AsyncConfig
    data: DataConfig
    model: Any
    algo: Any
    stages: Any
    moe: Any
    """``moe.routing_replay=rollout``: the engine records each response's routes, which the queue carries."""
    env: Any
    """``env.enabled``: multi-turn trajectories against the environment the worker holds (``Worker.env``)."""
    seed: int


@dataclass
class Worker:
    """What one rollout worker holds."""

    cfg: WorkerConfig
    role: ProcessRole
    paths: AsyncPaths
    trainer: Peer
    subscription: Subscription
    engine: RolloutEngine | None = None
    tokenizer: Any = None
    prompts: list[PromptRecord] = field(default_factory=list)
    reward_fn: RewardFn | None = None
    queue: QueueWriter | None = None
    digest: str = ""
    """``publish.weights_digest`` of the loaded weights (async.verify_weights), else ''."""
    staging: Staging | None = None
    """Memory publication (async.publish=memory): what the background thread has received."""
    record_routes: bool = False
    """The engine records each response's routes (``moe.routing_replay=rollout``); the queue carries them
    to the trainer, which replays them (``rollout.routes``)."""
    applied: Publication | None = None
    """The last publication applied from memory (None: the engine holds the subscription's)."""
    switch_s: float = 0.0
    """Seconds spent applying publications between two decode steps (async.partial_rollout) since the
    last batch was written."""
    env: StageEnv | None = None
    """The environment of multi-turn rollouts (env.enabled), held from set-up to the worker's end; its
    tally counts the current batch only (``generate_batch`` restarts it)."""

    @property
    def index(self) -> int:
        return self.role.worker_index

    @property
    def holds(self) -> Publication:
        """The publication the engine holds now."""
        return self.applied if self.applied is not None else self.subscription.current

    def refresh(self) -> float:
        """Apply newer weights, if any: the newest disk publication, then the newest staged in memory.
        Called only at safe points (between batches). Returns the seconds it took."""
        before = self.subscription.current
        seconds = self.subscription.refresh(self.load)
        if self.subscription.current != before:
            self.applied = None  # a directory published after the memory ones (a resumed trainer)
            self._acknowledge()
        received = self._staged()
        return seconds + (self.apply(received) if received is not None else 0.0)

    def between_steps(self) -> bool:
        """Apply the newest staged publication, if any, between two decode steps (async.partial_rollout;
        the engine's ``Interrupt``). Returns whether the weights changed."""
        received = self._staged()
        if received is None:
            return False
        self.switch_s += self.apply(received)
        return True

    def _staged(self) -> Received | None:
        """The newest publication staged in memory and not yet applied (None without memory publication)."""
        if self.staging is None:
            return None
        try:
            return self.staging.take()
        except RuntimeError:
            self.trainer.check()  # the trainer failed: its own message says why, not the broken connection
            if self.trainer.done:
                return None
            raise

    def apply(self, received: Received) -> float:
        """Load a staged publication into the engine (the second phase of a memory publication)."""
        started = time.perf_counter()
        advance(f"applying the weights of publication {received.name}")
        self.engine.load_weights(iter(received.tensors))
        self.staging.applied(received)
        if self.cfg.async_.verify_weights:
            self.digest = engine_digest(self.engine, [name for name, _ in received.tensors])
        self.applied = Publication(name=received.name, version=received.version, digest=received.digest)
        self._acknowledge()
        return time.perf_counter() - started

    def _acknowledge(self) -> None:
        """What this worker now serves, for the trainer and the benchmarks (``AsyncPaths.ack``)."""
        held = self.holds
        record = {"name": held.name, "version": held.version, "digest": self.digest, "applied_at": time.time()}
        write_json(self.paths.ack(self.index), record)

    def load(self, path: str) -> None:
        """Build the engine on the first publication (unless ``warm_up`` did); later ones replace its weights."""
        advance(f"loading the weights of publication {Path(path).name}")
        if self.engine is None:
            self.engine = self._build_engine(path)
        else:
            self.engine.load_hf_dir(path)
        if self.cfg.async_.verify_weights:
            self.digest = engine_digest(self.engine, published_names(Path(path)))

    def warm_up(self) -> None:
        """Start the verifier, build the engine and read the prompts from ``model.hf_dir`` while the trainer sets up.

        Building an engine takes seconds (model classes, allocation); loading a publication into a
        built one takes a fraction of that, so the trainer's first update no longer waits for it.
        Likewise the verifier's processes (spawned, importing math-verify: ~1 s) start now rather
        than at the first answer the string fast path cannot decide. Nothing is sampled before a
        publication has been loaded: these weights are only a start. Without ``model.hf_dir`` (the
        demo builds its base model on the trainer) there is no engine to build yet; a path without
        ``config.json`` is left for the trainer to report.
        """
        advance("warming up (verifier, engine, prompts)")
        if self.reward_fn is None:
            self.reward_fn = RewardSet(self.cfg.reward)
            self.reward_fn.start()
        hf_dir = self.cfg.model.hf_dir
        if self.engine is None and hf_dir and (Path(hf_dir) / "config.json").is_file():
            self.engine = self._build_engine(hf_dir)
            self.read_prompts(hf_dir)

    def read_prompts(self, hf_dir: str | Path) -> None:
        """The tokenizer of ``hf_dir`` (the base model's, which every publication copies) and the prompts."""
        from megatron_mugrpo.char_tokenizer import load_tokenizer_dir

        self.tokenizer = load_tokenizer_dir(hf_dir)  # the demos' character tokenizer kept as built (spaces)
        self.prompts = load_prompts(self.cfg.data, self.tokenizer, self.cfg.rollout.max_prompt_tokens)

    def _build_engine(self, path: str) -> RolloutEngine:
        overrides = {}
        if torch.cuda.is_available():
            gpu = int(os.environ.get("LOCAL_RANK", "0"))
            overrides = _GPU_PLACEMENT.get(self.cfg.rollout.engine, lambda _: {})(gpu)
        seed = engine_seed(self.cfg.seed, self.index)
        if self.record_routes:  # only then: an engine that records no routes need not know the keyword
            overrides = {**overrides, "record_routes": True}
        return build_engine_from_config(self.cfg.rollout, path, seed=seed, **overrides)

    def first_weights(self) -> bool | None:
        """Load the first publication if there is one yet (True), else None."""
        self.refresh()
        return True if self.subscription.current is not None else None

    def start_staging(self) -> None:
        """Receive memory publications from now on (async.publish=memory): publication rank 1 + w, staged
        where ``transport.staging_place`` says for this engine (SGLang: pinned host memory)."""
        gpu = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if torch.cuda.is_available() else None
        self.staging = Staging(
            self.paths.weights,
            rank=1 + self.index,
            timeout_s=self.cfg.async_.publish_timeout_s,
            gpu=gpu,
            engine=self.cfg.rollout.engine,
        )
        self.staging.start()


def run_worker(cfg: WorkerConfig, run_dir: Path, role: ProcessRole) -> None:
    """Generate into the run's queue until the trainer is done (see the module docstring)."""
    paths, timeouts = AsyncPaths(run_dir), cfg.async_
    problem = partial_rollout_problem(cfg.async_, cfg.rollout.engine)
    if problem:
        raise ConfigError(problem)
    with (
        Heartbeat(paths.worker_heartbeat(role.worker_index)) as heartbeat,  # a failure reaches the trainer
        ExitStack() as held,  # the environment (env.enabled): closed last, even if the engine's shutdown fails
    ):
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()  # a "Loading weights" bar at every weight pick-up is noise
        trainer = Peer(
            paths.trainer_heartbeat,
            "the trainer (rank 0)",
            timeout_s=timeouts.worker_timeout_s,
            startup_s=timeouts.startup_timeout_s,
            progress_timeout_s=timeouts.progress_timeout_s,
            echo=heartbeat.echo,  # the trainer's nonce in this worker's record: proof it is of this launch
        )
        worker = Worker(
            cfg=cfg,
            role=role,
            paths=paths,
            trainer=trainer,
            subscription=Subscription(paths.weights),
            record_routes=cfg.moe.routing_replay == "rollout",
        )
        try:
            worker.warm_up()
            first = _wait(worker, worker.first_weights, "waiting for the trainer's first publication")
            if first is None:
                return  # the trainer finished before this worker got weights: nothing left to do
            _setup(worker)
            overlap = env_overlap(cfg.env, asynchronous=True, engine=cfg.rollout.engine)  # 'auto' is on here
            worker.env = held.enter_context(stage_env(cfg.env, worker.tokenizer, overlap=overlap))
            if cfg.async_.publish == "memory":
                worker.start_staging()
            if cfg.async_.partial_rollout:
                worker.engine.interrupt = Interrupt(
                    between_steps=worker.between_steps, version=lambda: worker.holds.version, kv=cfg.async_.partial_kv
                )
            worker_loop(worker, idle_s=first[1])
        finally:
            if worker.staging is not None:
                worker.staging.stop()
            if worker.reward_fn is not None:  # first: SGLang's engine shutdown kills every child process
                worker.reward_fn.close()
            if worker.engine is not None:
                shutdown_engine(worker.engine)


def worker_loop(worker: Worker, idle_s: float = 0.0) -> None:
    """Wait for room → pick up new weights → pause while too stale → generate batch b → append it; until
    the trainer is done.

    ``idle_s``: seconds already spent waiting (for the first weights), counted with the first batch.
    """
    cfg = worker.cfg.async_
    batch = worker.queue.resume_batch()
    log.info("%s: generating from batch %d", worker.role.describe(), batch)
    while True:
        room = f"waiting for room in the queue before batch {batch}"
        waited = _wait(worker, lambda: worker.queue.unconsumed() < cfg.queue_groups or None, room)
        if waited is None:
            return
        load_s = worker.refresh()  # new weights only here, between batches
        paused = _pause_for_lag(worker, batch)
        if paused is None:
            return
        paused_s, paused_load_s = paused
        advance(f"generating batch {batch} with publication {worker.holds.name}")
        started = time.perf_counter()
        groups = generate_batch(worker, batch)
        advance(f"writing batch {batch}")
        switch_s, worker.switch_s = worker.switch_s, 0.0
        generate_s = time.perf_counter() - started - switch_s
        worker.queue.append(
            batch,
            groups,
            idle_s=idle_s + waited[1] + paused_s,
            paused_s=paused_s,
            load_s=load_s + paused_load_s + switch_s,
            generate_s=generate_s,
            publication=worker.holds.name,  # the newest weights of the batch (partial rollouts: its last tokens')
            weights_digest=worker.digest,
            env=worker.env.tally.counts(generate_s) if worker.env is not None else None,
        )
        batch, idle_s = batch + 1, 0.0


def _pause_for_lag(worker: Worker, batch: int) -> tuple[float, float] | None:
    """Wait while batch ``batch`` would be dropped for its lag (``batches.lag_pause``), loading newer
    weights as they are published. Returns (seconds paused, seconds loading weights meanwhile), or None
    once the trainer is done."""
    cfg = worker.cfg
    groups = len(prompt_range(cfg.async_, batch, worker.index))
    load_s = [0.0]

    def fresh() -> bool | None:
        load_s[0] += worker.refresh()
        unconsumed, update = worker.queue.backlog()
        stale = lag_pause(
            cfg.async_,
            groups=groups,
            unconsumed=unconsumed,
            trainer_update=update,
            version=worker.holds.version,
            mini_groups=cfg.stages.mini_groups,
        )
        return None if stale else True

    if fresh():
        return 0.0, load_s[0]
    log.debug("%s: pausing before batch %d: its groups would be too old when trained on", worker.role.describe(), batch)
    waited = _wait(worker, fresh, f"pausing before batch {batch}: its groups would be dropped for their lag")
    return None if waited is None else (max(waited[1] - load_s[0], 0.0), load_s[0])


def generate_batch(worker: Worker, batch: int) -> list[RolloutGroup]:
    """Batch ``batch`` of this worker, sampled and scored by the policy it holds now."""
    cfg, publication = worker.cfg, worker.holds
    positions = prompt_range(cfg.async_, batch, worker.index)
    records = prompt_slice(worker.prompts, positions.start, len(positions), cfg.data.seed)

    def responses(finished: int) -> None:  # the engine's progress: this worker's main loop moves
        advance(steps=finished)

    if worker.env is not None:
        worker.env.tally = EnvTally()  # the shard's record carries this batch's counts only
    groups = generate_groups(
        engine=worker.engine,
        records=records,
        tokenizer=worker.tokenizer,
        reward_fn=worker.reward_fn,
        cfg=cfg.rollout,
        seeds=(cfg.stages.seed, worker.index, batch),
        vocab_size=worker.queue.vocab_size,
        progress=responses,
        env=worker.env,  # multi-turn trajectories; raises EnvError past env.max_error_frac, before the append
    )
    for group in groups:
        group.policy_version = publication.version
        group.stage = publication.version // cfg.stages.updates_per_stage
    if cfg.async_.partial_rollout:  # the versions that sampled each token; a group's version is its oldest token's
        group_versions(groups, engine=worker.engine.name, updates_per_stage=cfg.stages.updates_per_stage)
    assign_advantages(groups, cfg.algo.adv_eps)
    return groups


def _setup(worker: Worker) -> None:
    """Tokenizer, prompts and queue, once the first publication (an HF directory) is loaded."""
    from megatron_mugrpo.conversion.hf_io import load_hf_config

    path = worker.subscription.path(worker.subscription.current)
    if worker.tokenizer is None:  # else warm_up read them from model.hf_dir
        worker.read_prompts(path)
    vocab_size = int(load_hf_config(path)["vocab_size"])
    worker.queue = QueueWriter(worker.paths.queue, worker=worker.index, vocab_size=vocab_size)


def _wait(worker: Worker, ready: Callable[[], T | None], doing: str) -> tuple[T, float] | None:
    """Poll ``ready()`` until it returns a value; returns it with the seconds waited, or None once the
    trainer is done. Raises RankFailedError when the trainer failed, went silent or hangs. Every poll
    is progress of this worker's main loop (``doing``)."""
    started = time.perf_counter()
    while True:
        advance(doing)
        worker.trainer.check()
        if worker.trainer.done:
            return None
        value = ready()
        if value is not None:
            worker.trainer.check()  # read (and echo) the trainer's record written before what was found
            return value, time.perf_counter() - started
        time.sleep(POLL_S)
