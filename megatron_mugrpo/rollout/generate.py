"""Phase 1 of a stage: the frozen behaviour policy generates the static rollout dataset D_k, on
every engine host at once.

The unit of work is one shard of the rollout store: shard i holds the stage's prompts
``prompts[i·S:(i+1)·S]`` and every engine call for it is seeded from (seed, stage, i, round). For
each shard a host samples responses (G per prompt, or VIGOR rounds), decodes and scores them with
its own reward pool, normalises advantages per group once the allocation is final, validates
everything and writes the shard. Nothing about a shard depends on which host made it or how many
hosts there are, so D_k is the same from 1 engine or from 32 (bitwise with the seeded transformers
engine on CPU, at equal threads per engine).

The hosts share the work through the store (see ``rollout/store.py``): rank 0 prepares the store
(``plan_stage``: resume, verify, repair), every host claims missing shards until none is left
(``generate_planned``: a faster engine takes more), and rank 0 seals the manifest after a barrier.
A rerun after a crash generates only the missing shards, on however many engines it has.

A host asked to stop (``stop``: the run was signalled to preempt) claims no further shard once the
one it is writing is done. Every rank then still meets at the same gather, and if shards are left
unwritten every rank raises ``GenerationStopped`` together, so the ranks leave the phase at the same
collective point (a host leaving alone would strand the others in the gather).

    identity = stage_identity(cfg=cfg.rollout, reward=reward_record(cfg.reward), prompts=records, stage=0,
                              policy_version=0, seed=cfg.stages.seed, vocab_size=hf_vocab, engine_name="transformers")
    plan = plan_stage(run / "rollouts/stage_000", identity, hosts)                 # collective
    metrics = generate_planned(plan, engine=engine, prompts=records, tokenizer=tok, reward_fn=reward,
                               cfg=cfg.rollout, adv_eps=cfg.algo.adv_eps, store_dir=run / "rollouts/stage_000",
                               seed=cfg.stages.seed, hosts=hosts)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from megatron_mugrpo.algorithms.advantages import assign_advantages
from megatron_mugrpo.algorithms.allocation import (
    initial_allocation,
    next_allocation,
    num_rounds,
    total_budget,
)
from megatron_mugrpo.envs.episodes import StageEnv, env_metrics, episode_samples, stage_env
from megatron_mugrpo.envs.registry import env_overlap, env_record
from megatron_mugrpo.errors import MissingInputError
from megatron_mugrpo.metric_names import (
    ROLLOUT_ENGINES,
    ROLLOUT_SAMPLING_S,
    ROLLOUT_SHARDS_MAX_PER_ENGINE,
    ROLLOUT_SHARDS_RESUMED,
    ROLLOUT_SHARDS_WRITTEN,
    ROLLOUT_TIME_S,
    ROLLOUT_TOKENS,
    ROLLOUT_TOKENS_PER_S,
    STAGE_OVERHEAD_REWARD,
    STAGE_OVERHEAD_STORE_WRITE,
)
from megatron_mugrpo.records import RolloutGroup, RolloutSample
from megatron_mugrpo.rewards.registry import RewardFn
from megatron_mugrpo.rollout.config import RolloutConfig
from megatron_mugrpo.rollout.engine import (
    Generation,
    ProgressCallback,
    RolloutEngine,
    SamplingParams,
    derive_seed,
    validate_generations,
)
from megatron_mugrpo.rollout.manifest import (
    StoreManifest,
    prompts_fingerprint,
    read_manifest,
    store_identity,
    store_metrics,
)
from megatron_mugrpo.rollout.placement import HostGroup
from megatron_mugrpo.rollout.routes import RouteRecordingError
from megatron_mugrpo.rollout.store import ShardWriter, StorePlan, prepare_store, seal_store

if TYPE_CHECKING:
    from megatron_mugrpo.rollout.prompts import PromptRecord

log = logging.getLogger(__name__)


class GenerationStopped(Exception):  # noqa: N818 (an event: the hosts stopped as asked)
    """Raised on every rank by ``generate_planned`` when a host stopped early (its ``stop``) and shards
    are left unwritten: the store is not sealed; the written shards are durable and a rerun makes the rest."""

    def __init__(self, written: int, missing: int) -> None:
        self.written, self.missing = written, missing
        super().__init__(f"generation stopped as asked after {written} of {missing} missing shards")


class Decoder(Protocol):
    """The part of a tokenizer that generation needs."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


@dataclass
class PhaseSeconds:
    """Seconds a rollout call spent in each of its parts, added up over shards and rounds (rank 0's
    ``perf/rollout_sampling_s``, ``perf/stage_overhead_reward_s``, ``perf/stage_overhead_store_write_s``):
    the stage boundary is what is not sampling."""

    sampling: float = 0.0
    """Inside ``engine.generate``."""
    reward: float = 0.0
    """Decoding and scoring the responses."""
    store_write: float = 0.0
    """Claiming and writing shards, sealing the manifest (fsyncs included)."""


@dataclass
class _Pending:
    """Responses of one prompt collected over the allocation rounds."""

    record: PromptRecord
    samples: list[RolloutSample]


def stage_identity(
    *,
    cfg: RolloutConfig,
    reward: dict[str, Any],
    prompts: Sequence[PromptRecord],
    stage: int,
    policy_version: int,
    seed: int,
    vocab_size: int,
    engine_name: str,
    routes: bool = False,
    env: Any = None,
) -> StoreManifest:
    """The manifest a stage's store must have: what a resumed store is checked against. ``reward``
    names the reward and its options (``rewards.registry.reward_record``): other scores, another store.
    ``routes``: the engine records routes (``moe.routing_replay=rollout``); recorded only when on, so a
    store with routes is never completed by shards without them, and stores without still resume.
    ``env``: the run's ``env`` section; when enabled its settings are recorded the same way (a store of
    multi-turn trajectories, ``rollout.store.holds_env``), so trajectories of another environment, limits
    or corpus never complete it."""
    recorded = ({"routes": True} if routes else {}) | ({"env": env_record(env)} if env and env.enabled else {})
    return store_identity(
        stage=stage,
        policy_version=policy_version,
        engine=engine_name,
        sampling=_sampling_record(cfg, seed) | recorded | {"reward": reward},
        num_groups=len(prompts),
        shard_groups=cfg.shard_groups,
        vocab_size=vocab_size,
        prompts_sha256=prompts_fingerprint((p.prompt_id, p.prompt_ids, p.answer) for p in prompts),
    )


def plan_stage(
    store_dir: str | Path, identity: StoreManifest, hosts: HostGroup, *, keep_policy_version: bool = False
) -> StorePlan:
    """Rank 0 prepares the store (creates it, or verifies and repairs an existing one); every rank
    gets the plan. Collective. A damaged shard of a sealed store is dropped with a warning saying so."""
    plan = None
    if hosts.placement.rank == 0:
        plan = prepare_store(store_dir, identity, keep_policy_version=keep_policy_version)
        total = plan.manifest.num_shards
        for index, problem in plan.dropped.items():
            log.warning(
                "%s. Regenerating shard %d only: %s is marked incomplete until the shard is rewritten, and its "
                "other %d shards are kept (the result is the same shard bitwise on CPU).",
                problem,
                index,
                Path(store_dir) / "manifest.json",
                total - len(plan.missing),
            )
        if plan.missing and len(plan.missing) < total and not plan.dropped:
            log.info("resuming %s: %d of %d shards already written", store_dir, total - len(plan.missing), total)
    return hosts.broadcast(plan)


def generate_planned(
    plan: StorePlan,
    *,
    engine: RolloutEngine | None,
    prompts: Sequence[PromptRecord],
    tokenizer: Decoder,
    reward_fn: RewardFn,
    cfg: RolloutConfig,
    adv_eps: float,
    store_dir: str | Path,
    seed: int,
    hosts: HostGroup,
    progress: ProgressCallback | None = None,
    on_shard_written: Callable[[int], None] | None = None,
    stop: Callable[[], bool] | None = None,
    env: Any = None,
) -> dict[str, float]:
    """Every host claims and writes the plan's missing shards; rank 0 then seals the store. Collective:
    every rank calls it, hosts with their engine, other ranks with ``engine=None``. The caller has
    loaded the stage's policy into every engine (``rollout_phase`` in loop/staged.py).

    ``prompts`` are the stage's B_train prompts (shard i holds ``prompts[i·S:(i+1)·S]``, S =
    cfg.shard_groups). ``on_shard_written(index)`` runs on the writing host after each shard (fault
    injection in tests). ``stop()`` is asked before each claim: true, and the host claims no more;
    when shards are then left unwritten, every rank raises ``GenerationStopped``. ``env``: the run's
    ``env`` section; when enabled, each host rolls out multi-turn trajectories against the environment,
    which it holds for this call (``envs.episodes.stage_env``).

    Returns (on rank 0; other ranks get ``{}``): ``rollout/*`` metrics of the whole store (reward mean,
    solve-all/none fractions, response length, length-finish fraction, reason counts, test pass rate
    of rewards that run tests) and ``perf/*`` metrics of this call (generated tokens over all hosts,
    seconds, shards written and resumed, engines).
    """
    started, seconds, mine = time.perf_counter(), PhaseSeconds(), _HostCounts()
    if hosts.placement.is_host:
        if engine is None:
            raise ValueError(f"rank {hosts.placement.rank} hosts an engine but generate_planned() got engine=None")
        inputs = _ShardInputs(engine, prompts, tokenizer, reward_fn, cfg, adv_eps, seed, progress, seconds)
        mine = _write_missing(plan, store_dir, inputs, env=env, on_shard_written=on_shard_written, stop=stop)
    counts = hosts.gather(mine)  # rank 0 hears from every rank once each host has written its shards
    written = hosts.broadcast(_written_if_stopped(counts, len(plan.missing)) if counts is not None else None)
    if written is not None:
        raise GenerationStopped(written, len(plan.missing))  # on every rank, before the store is sealed
    with _adding(seconds, "store_write"):
        manifest = seal_store(store_dir) if hosts.placement.rank == 0 and plan.missing else plan.manifest
    hosts.barrier()  # nobody opens the store before it is sealed
    if counts is None:
        return {}
    return _phase_metrics(
        manifest, counts, hosts, resumed=manifest.num_shards - len(plan.missing), started=started, seconds=seconds
    )


def _phase_metrics(
    manifest: StoreManifest,
    counts: list[_HostCounts],
    hosts: HostGroup,
    *,
    resumed: int,
    started: float,
    seconds: PhaseSeconds,
) -> dict[str, float]:
    """Rank 0: ``generate_planned``'s metrics, from the sealed manifest and every rank's counts."""
    return (
        _stage_metrics(
            manifest,
            tokens=sum(c.tokens for c in counts),
            seconds=time.perf_counter() - started,
            resumed=resumed,
            engines=hosts.placement.num_engines,
            per_engine=[counts[rank].shards for rank in hosts.placement.host_ranks],
        )
        | env_metrics([c.tally for c in counts if c.tally is not None])
        | {
            ROLLOUT_SAMPLING_S: seconds.sampling,
            STAGE_OVERHEAD_REWARD: seconds.reward,
            STAGE_OVERHEAD_STORE_WRITE: seconds.store_write,
        }
    )


def _written_if_stopped(counts: list[_HostCounts], missing: int) -> int | None:
    """Rank 0: the shards written when a host stopped early and shards are left unwritten, else None."""
    written = sum(c.shards for c in counts)
    return written if written < missing and any(c.stopped for c in counts) else None


@contextmanager
def _adding(seconds: PhaseSeconds | None, part: str) -> Iterator[None]:
    """Add the block's wall-clock seconds to ``seconds.<part>`` (nothing when ``seconds`` is None)."""
    started = time.perf_counter()
    try:
        yield
    finally:
        if seconds is not None:
            setattr(seconds, part, getattr(seconds, part) + time.perf_counter() - started)


@dataclass(frozen=True)
class _HostCounts:
    """What one rank reports after its part of ``generate_planned`` (a rank without an engine: nothing)."""

    tokens: int = 0
    """Response tokens generated."""
    shards: int = 0
    """Shards written."""
    tally: Any = None
    """The environment's tally (multi-turn rollouts), else None."""
    stopped: bool = False
    """Whether ``stop()`` ended this host's claiming early (shards may be left for nobody)."""


@dataclass(frozen=True)
class _ShardInputs:
    """What each shard of a stage is generated from (``generate_planned``'s arguments)."""

    engine: RolloutEngine
    prompts: Sequence[PromptRecord]
    tokenizer: Decoder
    reward_fn: RewardFn
    cfg: RolloutConfig
    adv_eps: float
    seed: int
    progress: ProgressCallback | None
    seconds: PhaseSeconds


def _write_missing(
    plan: StorePlan,
    store_dir: str | Path,
    inputs: _ShardInputs,
    *,
    env: Any,
    on_shard_written: Callable[[int], None] | None,
    stop: Callable[[], bool] | None,
) -> _HostCounts:
    """This host's part of ``generate_planned``: claim and write the plan's missing shards that no other
    host took, holding the environment (if any) meanwhile, until none is left or ``stop()`` is true."""
    tokens, written, stopped = 0, 0, False
    writer = ShardWriter(store_dir, plan.manifest)
    overlap = env_overlap(env, asynchronous=False, engine=inputs.cfg.engine)  # env.overlap=always; 'auto' is off here
    with stage_env(env, inputs.tokenizer, overlap=overlap) as stage:
        for index in plan.missing:
            if stop is not None and stop():
                stopped = True
                break
            with _adding(inputs.seconds, "store_write"):
                claimed = writer.claim(index)
            if not claimed:
                continue  # another host took it
            try:
                tokens += _generate_shard(writer, index, inputs, stage)
            except BaseException:
                writer.release(index)
                raise
            written += 1
            if on_shard_written is not None:
                on_shard_written(index)
        tally = stage.tally.counts(inputs.seconds.sampling) if stage is not None else None
    return _HostCounts(tokens=tokens, shards=written, tally=tally, stopped=stopped)


def _generate_shard(writer: ShardWriter, index: int, inputs: _ShardInputs, env: StageEnv | None) -> int:
    """Generate, score and write shard ``index``; returns its response tokens."""
    manifest = writer.manifest
    groups = generate_groups(
        engine=inputs.engine,
        records=[inputs.prompts[i] for i in manifest.shard_range(index)],
        tokenizer=inputs.tokenizer,
        reward_fn=inputs.reward_fn,
        cfg=inputs.cfg,
        seeds=(inputs.seed, manifest.stage, index),
        vocab_size=manifest.vocab_size,
        progress=inputs.progress,
        seconds=inputs.seconds,
        env=env,
    )
    for group in groups:
        group.stage, group.policy_version = manifest.stage, manifest.policy_version
    assign_advantages(groups, inputs.adv_eps)
    with _adding(inputs.seconds, "store_write"):
        writer.write_shard(index, groups)
    return sum(len(s.response_ids) for g in groups for s in g.samples)


def generate_groups(
    *,
    engine: RolloutEngine,
    records: Sequence[PromptRecord],
    tokenizer: Decoder,
    reward_fn: RewardFn,
    cfg: RolloutConfig,
    seeds: tuple[int, ...],
    vocab_size: int,
    progress: ProgressCallback | None = None,
    seconds: PhaseSeconds | None = None,
    env: StageEnv | None = None,
) -> list[RolloutGroup]:
    """Sample, decode and score the responses of some prompts (fixed G or VIGOR rounds).

    ``seeds`` identifies the call (e.g. (seed, stage, shard)); round r samples with a seed derived
    from seeds + (r,). Advantages are left at 0 (the caller normalises once allocation is final).
    ``seconds`` (optional) gets the time spent sampling and scoring added. With ``env``, each prompt gets
    G multi-turn trajectories against the environment instead (fixed allocation, one round).
    """
    pending = [_Pending(record, []) for record in records]
    if env is not None:
        params = SamplingParams(
            temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens, seed=derive_seed(*seeds, 0)
        )
        with _adding(seconds, "sampling"):  # environment calls included: they are the trajectories' time
            samples = episode_samples(
                engine,  # type: ignore[arg-type]  # the config allows multi-turn engines only
                env,
                records,
                group_size=cfg.group_size,
                params=params,
                decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                reward_fn=reward_fn,
            )
        for p, group_samples in zip(pending, samples):
            p.samples = group_samples
        return _groups(pending)
    budget = total_budget(len(records), cfg)
    extra = initial_allocation(len(records), cfg)
    for round_index in range(num_rounds(cfg) + 1):
        if round_index > 0:
            rewards = [[s.reward for s in p.samples] for p in pending]
            spent = sum(len(r) for r in rewards)
            extra = next_allocation(rewards, spent, cfg, budget, last_round=round_index == num_rounds(cfg))
        if not any(extra):
            break
        params = SamplingParams(
            temperature=cfg.temperature,
            max_new_tokens=cfg.max_new_tokens,
            seed=derive_seed(*seeds, round_index),
        )
        _sample_round(engine, pending, extra, params, tokenizer, reward_fn, vocab_size, progress, seconds)
    return _groups(pending)


def _groups(pending: list[_Pending]) -> list[RolloutGroup]:
    return [
        RolloutGroup(
            prompt_id=p.record.prompt_id,
            prompt_ids=list(p.record.prompt_ids),
            answer=p.record.answer,
            samples=p.samples,
        )
        for p in pending
    ]


def _sample_round(
    engine: RolloutEngine,
    pending: list[_Pending],
    counts: list[int],
    params: SamplingParams,
    tokenizer: Decoder,
    reward_fn: RewardFn,
    vocab_size: int,
    progress: ProgressCallback | None,
    seconds: PhaseSeconds | None = None,
) -> None:
    """Generate ``counts[p]`` more responses for each prompt p, score them, append them."""
    chosen = [p for p, n in enumerate(counts) if n > 0]
    wanted = [counts[p] for p in chosen]
    with _adding(seconds, "sampling"):
        generations = engine.generate([list(pending[p].record.prompt_ids) for p in chosen], wanted, params, progress)
    validate_generations(
        generations,
        wanted,
        vocab_size=vocab_size,
        max_new_tokens=params.max_new_tokens,
        engine=getattr(engine, "name", type(engine).__name__),
    )
    flat: list[tuple[int, Generation]] = [(p, gen) for p, group in zip(chosen, generations) for gen in group]
    with _adding(seconds, "reward"):
        texts = [tokenizer.decode(gen.response_ids, skip_special_tokens=True) for _, gen in flat]
        scores = reward_fn.score(texts, [pending[p].record.answer for p, _ in flat])
    for (p, gen), score in zip(flat, scores):
        reward, reason = score
        prompt_ids = pending[p].record.prompt_ids
        pending[p].samples.append(
            RolloutSample(
                response_ids=list(gen.response_ids),
                behaviour_logprobs=list(gen.logprobs),
                finish_reason=gen.finish_reason,
                reward=reward,
                reward_reason=reason,
                pass_fraction=getattr(score, "pass_fraction", None),
                routes=_checked_routes(gen, len(prompt_ids), engine),
                versions=gen.versions,  # per-token policy versions: async.partial_rollout only
            )
        )


def _checked_routes(gen: Generation, prompt_len: int, engine: RolloutEngine) -> np.ndarray | None:
    """The generation's routes (``rollout.routes.RoutedGeneration``), None when the engine records none;
    RouteRecordingError unless they cover the trainer's input, prompt + response minus its last token."""
    routes = getattr(gen, "routes", None)
    expected = prompt_len + len(gen.response_ids) - 1
    if routes is not None and (routes.ndim != 3 or routes.shape[0] != expected):
        raise RouteRecordingError(
            f"engine {getattr(engine, 'name', type(engine).__name__)!r} returned routes of shape {routes.shape} "
            f"for a {prompt_len}-token prompt and a {len(gen.response_ids)}-token response; routes need "
            f"{expected} rows (prompt + response - 1), one per token the trainer feeds: the engine's route "
            "recording is broken"
        )
    return routes


def _sampling_record(cfg: RolloutConfig, seed: int) -> dict[str, Any]:
    """What the manifest records about how the store was sampled (resume must match it exactly).

    A quantized behaviour policy is recorded only when on, so stores written before the key existed
    still resume."""
    quantized = {"quantization": cfg.quantization} if cfg.quantization != "none" else {}
    return quantized | {
        "temperature": cfg.temperature,
        "top_p": cfg.top_p,
        "top_k": cfg.top_k,
        "max_new_tokens": cfg.max_new_tokens,
        "seed": seed,
        "allocation": cfg.allocation,
        "group_size": cfg.group_size,
        "vigor": asdict(cfg.vigor) if cfg.allocation == "vigor" else None,
    }


def _stage_metrics(
    manifest: StoreManifest, *, tokens: int, seconds: float, resumed: int, engines: int, per_engine: list[int]
) -> dict[str, float]:
    metrics = store_metrics(manifest)
    metrics[ROLLOUT_TOKENS] = float(tokens)
    metrics[ROLLOUT_TIME_S] = seconds
    metrics[ROLLOUT_TOKENS_PER_S] = tokens / seconds if seconds > 0 else 0.0
    metrics[ROLLOUT_SHARDS_RESUMED] = float(resumed)
    metrics[ROLLOUT_SHARDS_WRITTEN] = float(manifest.num_shards - resumed)
    metrics[ROLLOUT_ENGINES] = float(engines)
    metrics[ROLLOUT_SHARDS_MAX_PER_ENGINE] = float(max(per_engine, default=0))
    return metrics


def stage_store_metrics(store_dir: str | Path) -> dict[str, float]:
    """``rollout/*`` metrics of an existing store (e.g. after a restart that skipped generation)."""
    manifest = read_manifest(store_dir)
    if manifest is None:
        raise MissingInputError(f"{store_dir} has no rollout store manifest")
    return store_metrics(manifest)
