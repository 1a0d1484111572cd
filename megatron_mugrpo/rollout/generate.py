"""Phase 1 of a stage: the frozen behaviour policy generates the static rollout dataset D_k.

``generate_stage`` walks the stage's prompts shard by shard. For each shard it samples responses
(G per prompt, or VIGOR rounds), decodes and scores them, normalises advantages per group after the
allocation is final, validates everything and writes the shard to the rollout store. A rerun after
a crash resumes at the first missing shard: the prompts of shard i are ``prompts[i·S:(i+1)·S]`` and
every engine call's seed is derived from (seed, stage, shard, round), so the regenerated shards
are those an uninterrupted run would have written (bitwise with the seeded transformers engine).

    metrics = generate_stage(engine=engine, prompts=records, tokenizer=tok, reward_fn=reward,
                             cfg=cfg.rollout, adv_eps=cfg.algo.adv_eps, store_dir=run / "rollouts/stage_0000",
                             stage=0, policy_version=0, seed=cfg.stages.seed, vocab_size=hf_vocab)
"""

from __future__ import annotations

import time
from collections.abc import Sequence
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
from megatron_mugrpo.config import RolloutConfig
from megatron_mugrpo.errors import MissingInputError
from megatron_mugrpo.records import RolloutGroup, RolloutSample
from megatron_mugrpo.rollout.engine import (
    Generation,
    ProgressCallback,
    RolloutEngine,
    SamplingParams,
    validate_generations,
)
from megatron_mugrpo.rollout.rewards import RewardFn
from megatron_mugrpo.rollout.store import (
    RolloutStoreWriter,
    StoreManifest,
    prompts_fingerprint,
    read_manifest,
    store_metrics,
)

if TYPE_CHECKING:
    from megatron_mugrpo.rollout.prompts import PromptRecord


class Decoder(Protocol):
    """The part of a tokenizer that generation needs."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


@dataclass
class _Pending:
    """Responses of one prompt collected over the allocation rounds."""

    record: PromptRecord
    samples: list[RolloutSample]


def generate_stage(
    *,
    engine: RolloutEngine,
    prompts: Sequence[PromptRecord],
    tokenizer: Decoder,
    reward_fn: RewardFn,
    cfg: RolloutConfig,
    adv_eps: float,
    store_dir: str | Path,
    stage: int,
    policy_version: int,
    seed: int,
    vocab_size: int,
    progress: ProgressCallback | None = None,
) -> dict[str, float]:
    """Generate (or finish generating) the rollout store of one stage.

    Args:
        prompts: the stage's B_train prompts; shard i holds ``prompts[i·S:(i+1)·S]``, S = cfg.shard_groups.
        vocab_size: the TRUE vocabulary size (token ids must be below it).
        progress: forwarded to ``engine.generate`` (sequences finished).

    Returns:
        ``rollout/*`` metrics of the whole store (reward mean, solve-all/none fractions, response
        length, length-finish fraction, reason counts, ...) and ``perf/*`` metrics of this call
        (generated tokens, seconds, shards written and resumed).
    """
    if not prompts:
        raise ValueError("generate_stage() got no prompts; the stage needs at least one prompt group")
    writer = RolloutStoreWriter.create_or_resume(
        store_dir,
        stage=stage,
        policy_version=policy_version,
        engine=getattr(engine, "name", type(engine).__name__),
        sampling=_sampling_record(cfg, seed),
        num_groups=len(prompts),
        shard_groups=cfg.shard_groups,
        vocab_size=vocab_size,
        prompts_sha256=prompts_fingerprint((p.prompt_id, p.prompt_ids, p.answer) for p in prompts),
    )
    resumed, tokens, started = writer.next_shard_index, 0, time.perf_counter()
    for shard in range(writer.next_shard_index, writer.num_shards):
        records = [prompts[i] for i in writer.manifest.shard_range(shard)]
        groups = generate_groups(
            engine=engine,
            records=records,
            tokenizer=tokenizer,
            reward_fn=reward_fn,
            cfg=cfg,
            seeds=(seed, stage, shard),
            vocab_size=vocab_size,
            progress=progress,
        )
        for group in groups:
            group.stage, group.policy_version = stage, policy_version
        assign_advantages(groups, adv_eps)
        writer.write_shard(shard, groups)
        tokens += sum(len(s.response_ids) for g in groups for s in g.samples)
    elapsed = time.perf_counter() - started
    return _stage_metrics(writer.manifest, tokens=tokens, seconds=elapsed, resumed=resumed)


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
) -> list[RolloutGroup]:
    """Sample, decode and score the responses of some prompts (fixed G or VIGOR rounds).

    ``seeds`` identifies the call (e.g. (seed, stage, shard)); round r samples with a seed derived
    from seeds + (r,). Advantages are left at 0 (the caller normalises once allocation is final).
    """
    pending = [_Pending(record, []) for record in records]
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
        _sample_round(engine, pending, extra, params, tokenizer, reward_fn, vocab_size, progress)
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
) -> None:
    """Generate ``counts[p]`` more responses for each prompt p, score them, append them."""
    chosen = [p for p, n in enumerate(counts) if n > 0]
    wanted = [counts[p] for p in chosen]
    generations = engine.generate([list(pending[p].record.prompt_ids) for p in chosen], wanted, params, progress)
    validate_generations(
        generations,
        wanted,
        vocab_size=vocab_size,
        max_new_tokens=params.max_new_tokens,
        engine=getattr(engine, "name", type(engine).__name__),
    )
    flat: list[tuple[int, Generation]] = [(p, gen) for p, group in zip(chosen, generations) for gen in group]
    texts = [tokenizer.decode(gen.response_ids, skip_special_tokens=True) for _, gen in flat]
    scores = reward_fn.score(texts, [pending[p].record.answer for p, _ in flat])
    for (p, gen), (reward, reason) in zip(flat, scores):
        pending[p].samples.append(
            RolloutSample(
                response_ids=list(gen.response_ids),
                behaviour_logprobs=list(gen.logprobs),
                finish_reason=gen.finish_reason,
                reward=reward,
                reward_reason=reason,
            )
        )


def derive_seed(*parts: int) -> int:
    """A 31-bit seed that depends on every part (stable across runs, platforms and Python versions)."""
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(1)[0] & 0x7FFFFFFF)


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
        "reward": cfg.reward,
    }


def _stage_metrics(manifest: StoreManifest, *, tokens: int, seconds: float, resumed: int) -> dict[str, float]:
    metrics = store_metrics(manifest)
    metrics["perf/rollout_tokens"] = float(tokens)
    metrics["perf/rollout_time_s"] = seconds
    metrics["perf/rollout_tokens_per_s"] = tokens / seconds if seconds > 0 else 0.0
    metrics["perf/rollout_shards_resumed"] = float(resumed)
    metrics["perf/rollout_shards_written"] = float(manifest.num_shards - resumed)
    return metrics


def stage_store_metrics(store_dir: str | Path) -> dict[str, float]:
    """``rollout/*`` metrics of an existing store (e.g. after a restart that skipped generation)."""
    manifest = read_manifest(store_dir)
    if manifest is None:
        raise MissingInputError(f"{store_dir} has no rollout store manifest")
    return store_metrics(manifest)
