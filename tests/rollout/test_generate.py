"""Stage generation: the real transformers engine into the rollout store, resume after a crash, VIGOR,
and the same D_k from one engine or two (spawned gloo ranks sharing the shards)."""

from __future__ import annotations

import math
import os
import signal

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed
from transformers import Qwen2Config, Qwen2ForCausalLM

from megatron_mugrpo.algorithms.allocation import VigorConfig
from megatron_mugrpo.char_tokenizer import build_char_tokenizer, char_vocab
from megatron_mugrpo.durable import Checksum
from megatron_mugrpo.rewards.registry import build_reward
from megatron_mugrpo.rollout.config import RolloutConfig
from megatron_mugrpo.rollout.engine import EngineOutputError, Generation, derive_seed
from megatron_mugrpo.rollout.generate import GenerationStopped, generate_planned, plan_stage, stage_identity
from megatron_mugrpo.rollout.manifest import is_complete
from megatron_mugrpo.rollout.placement import EnginePlacement, HostGroup, engine_threads
from megatron_mugrpo.rollout.prompts import PromptRecord
from megatron_mugrpo.rollout.shards import StoreError
from megatron_mugrpo.rollout.store import RolloutStore
from megatron_mugrpo.rollout.tasks import builtin_problems, builtin_prompt
from megatron_mugrpo.rollout.transformers_engine import TransformersEngine

LOGPROB_TOLERANCE = 1e-5
"""Stored (float32) behaviour log-probs vs a teacher-forced recompute of the same model."""
VOCAB = len(char_vocab())
EOS_ID = char_vocab()["<eos>"]


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        eos_token_id=EOS_ID,
    )
    path = tmp_path_factory.mktemp("tiny_char_model")
    Qwen2ForCausalLM(config).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def reward():
    fn = build_reward("math", workers=1, timeout_s=10.0)
    yield fn
    fn.close()


def make_prompts(tokenizer, n: int) -> list[PromptRecord]:
    rows = builtin_problems("arithmetic_easy", n, seed=0, split="train")
    return [
        PromptRecord(
            prompt_id=f"test-{i}",
            prompt_ids=tokenizer(builtin_prompt(r["problem"]))["input_ids"],
            answer=r["answer"],
            text=builtin_prompt(r["problem"]),
        )
        for i, r in enumerate(rows)
    ]


def rollout_cfg(**overrides) -> RolloutConfig:
    return RolloutConfig(**({"group_size": 3, "max_new_tokens": 6, "shard_groups": 2} | overrides))


def run(store_dir, engine, prompts, tokenizer, reward, cfg, *, hosts=None, stage=2, policy_version=40, seed=5, **extra):
    """One stage's store the way the staged loop makes it: its identity, the plan, the generation
    (``extra``: more of ``generate_planned``'s arguments)."""
    hosts = hosts or HostGroup(EnginePlacement.single())
    identity = stage_identity(
        cfg=cfg,
        reward={"kind": "math"},
        prompts=prompts,
        stage=stage,
        policy_version=policy_version,
        seed=seed,
        vocab_size=VOCAB,
        engine_name=getattr(engine, "name", type(engine).__name__),
    )
    plan = plan_stage(store_dir, identity, hosts)
    return generate_planned(
        plan,
        engine=engine,
        prompts=prompts,
        tokenizer=tokenizer,
        reward_fn=reward,
        cfg=cfg,
        adv_eps=1e-6,
        store_dir=store_dir,
        seed=seed,
        hosts=hosts,
        **extra,
    )


class CountingEngine:
    """Delegates to a real engine, records each call's prompts, and can crash at a chosen call."""

    name = "transformers"

    def __init__(self, engine, crash_at_call: int | None = None, sigkill: bool = False):
        self.engine, self.crash_at_call, self.sigkill, self.calls = engine, crash_at_call, sigkill, []

    def generate(self, prompts, n, params, progress=None):
        if len(self.calls) == self.crash_at_call:
            if self.sigkill:  # nothing cleans up, as when a node dies
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError("simulated crash during generation")
        self.calls.append([list(p) for p in prompts])
        return self.engine.generate(prompts, n, params, progress)


def test_generate_stage_with_transformers_engine(tmp_path, model_dir, tokenizer, reward):
    engine = TransformersEngine(model_dir, dtype="float32", device="cpu", batch_size=16)
    prompts = make_prompts(tokenizer, 5)
    metrics = run(tmp_path, engine, prompts, tokenizer, reward, rollout_cfg())
    store = RolloutStore.open(tmp_path)
    assert store.manifest.num_shards == 3 and store.manifest.complete
    assert store.manifest.engine == "transformers"
    groups = store.groups()
    assert [g.prompt_id for g in groups] == [p.prompt_id for p in prompts]
    assert all(len(g.samples) == 3 and g.stage == 2 and g.policy_version == 40 for g in groups)
    # The stored behaviour log-probs are what the trainer-side forward computes.
    flat = [(g.prompt_ids, s) for g in groups for s in g.samples]
    reference = engine.teacher_forced_logprobs([p for p, _ in flat], [s.response_ids for _, s in flat], 1.0)
    error = max(float((torch.tensor(s.behaviour_logprobs) - ref).abs().max()) for (_, s), ref in zip(flat, reference))
    assert error <= LOGPROB_TOLERANCE
    lengths = [len(s.response_ids) for _, s in flat]
    assert metrics["rollout/responses"] == 15
    assert metrics["rollout/response_len_mean"] == pytest.approx(sum(lengths) / 15)
    assert metrics["perf/rollout_tokens"] == sum(lengths)
    assert metrics["perf/rollout_shards_written"] == 3
    reasons = sum(v for k, v in metrics.items() if k.startswith("rollout/reason_"))
    assert reasons == 15
    for key in (
        "rollout/reward_mean",
        "rollout/solve_all_frac",
        "rollout/solve_none_frac",
        "rollout/finish_length_frac",
    ):
        assert math.isfinite(metrics[key])


def test_resume_after_crash_regenerates_only_missing_shards(tmp_path, model_dir, tokenizer, reward):
    engine = TransformersEngine(model_dir, dtype="float32", device="cpu", batch_size=16)
    prompts, cfg = make_prompts(tokenizer, 6), rollout_cfg()
    run(tmp_path / "uninterrupted", engine, prompts, tokenizer, reward, cfg)

    crashing = CountingEngine(engine, crash_at_call=1)
    with pytest.raises(RuntimeError, match="simulated crash"):
        run(tmp_path / "resumed", crashing, prompts, tokenizer, reward, cfg)
    assert not is_complete(tmp_path / "resumed")

    counting = CountingEngine(engine)
    metrics = run(tmp_path / "resumed", counting, prompts, tokenizer, reward, cfg)
    assert counting.calls == [[p.prompt_ids for p in prompts[2:4]], [p.prompt_ids for p in prompts[4:6]]]
    assert metrics["perf/rollout_shards_resumed"] == 1
    assert RolloutStore.open(tmp_path / "resumed").groups() == RolloutStore.open(tmp_path / "uninterrupted").groups()

    with pytest.raises(StoreError, match="prompts_sha256"):
        run(tmp_path / "resumed", counting, prompts[::-1], tokenizer, reward, cfg)

    again = CountingEngine(engine)
    assert run(tmp_path / "resumed", again, prompts, tokenizer, reward, cfg)["rollout/responses"] == 18
    assert again.calls == []


class ScriptedEngine:
    """Answers from a script: prompt i's k-th response is correct when script(i, k)."""

    name = "scripted"

    def __init__(self, tokenizer, prompts, script, bad_logprob: float | None = None):
        self.tokenizer, self.script, self.bad_logprob = tokenizer, script, bad_logprob
        self.answers = {tuple(p.prompt_ids): (i, p.answer) for i, p in enumerate(prompts)}
        self.seen: dict[int, int] = {}
        self.calls: list[list[int]] = []

    def generate(self, prompts, n, params, progress=None):
        counts = n if isinstance(n, list) else [n] * len(prompts)
        self.calls.append(counts)
        out = []
        for prompt, count in zip(prompts, counts):
            index, answer = self.answers[tuple(prompt)]
            group = []
            for _ in range(count):
                k = self.seen.get(index, 0)
                self.seen[index] = k + 1
                text = f"\\boxed{{{answer if self.script(index, k) else answer + '1'}}}"
                ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [EOS_ID]
                logprobs = [-0.5] * len(ids)
                if self.bad_logprob is not None:
                    logprobs[1] = self.bad_logprob
                group.append(Generation(response_ids=ids, logprobs=logprobs, finish_reason="stop"))
            out.append(group)
        return out


def test_vigor_allocation_in_stage_generation(tmp_path, tokenizer, reward):
    prompts = make_prompts(tokenizer, 8)
    mixed = {1, 6}  # these prompts are answered right half of the time; 0-3 always right, 4-7 never
    engine = ScriptedEngine(tokenizer, prompts, lambda i, k: (k % 2 == 0) if i in mixed else i < 4)
    cfg = rollout_cfg(
        allocation="vigor",
        shard_groups=8,
        max_new_tokens=16,
        vigor=VigorConfig(n0=2, alpha=0.25, increment=2, rounds=2, budget=32),
    )
    metrics = run(tmp_path, engine, prompts, tokenizer, reward, cfg)
    groups = RolloutStore.open(tmp_path).groups()
    sizes = [len(g.samples) for g in groups]
    assert sum(sizes) == 32
    assert [sizes[i] for i in range(8) if i not in mixed] == [2] * 6
    assert sizes[1] == sizes[6] == 2 + 2 + 6
    assert engine.calls == [[2] * 8, [2, 2], [6, 6]]
    for i, g in enumerate(groups):
        advantages = [s.advantage for s in g.samples]
        if i in mixed:
            assert all(abs(a) > 0.5 for a in advantages)
            assert sum(advantages) == pytest.approx(0.0, abs=1e-9)
        else:
            assert advantages == [0.0] * len(advantages)
    assert metrics["rollout/solve_all_frac"] == pytest.approx(3 / 8)
    assert metrics["rollout/solve_none_frac"] == pytest.approx(3 / 8)
    assert metrics["rollout/group_size_mean"] == 4.0
    assert metrics["rollout/reason_correct"] + metrics["rollout/reason_wrong"] == 32


def test_invalid_engine_output_is_rejected_before_writing(tmp_path, tokenizer, reward):
    prompts = make_prompts(tokenizer, 2)
    engine = ScriptedEngine(tokenizer, prompts, lambda i, k: True, bad_logprob=math.nan)
    with pytest.raises(EngineOutputError, match="not finite"):
        run(tmp_path, engine, prompts, tokenizer, reward, rollout_cfg(max_new_tokens=16))
    assert not is_complete(tmp_path)
    assert not list(tmp_path.glob("shard_*"))


def test_derive_seed_is_stable_and_distinct():
    assert derive_seed(5, 2, 0, 0) == derive_seed(5, 2, 0, 0)
    assert len({derive_seed(5, 2, shard, r) for shard in range(10) for r in range(3)}) == 30
    assert 0 <= derive_seed(1, 2, 3) < 2**31


# ----------------------------------------------------------------------------------------------
# Several engines: spawned gloo ranks, one engine each, one torch thread per engine on both sides
# (thread counts change float rounding on CPU, so equal threads per engine is the fair comparison).
# ----------------------------------------------------------------------------------------------

ENGINE_THREADS = 1
SCALING_CFG = {"group_size": 3, "max_new_tokens": 6, "shard_groups": 2}


def _generate_on_ranks(rank, world_size, store_dir, model_dir, prompts, crash_at_call) -> None:
    """Every rank hosts one engine and generates the stage into ``store_dir`` with the others."""
    if world_size > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
    hosts = HostGroup.create(EnginePlacement.from_env(tensor_parallel=1, cores=world_size))
    engine = TransformersEngine(model_dir, dtype="float32", device="cpu", batch_size=16)
    if crash_at_call is not None:
        engine = CountingEngine(engine, crash_at_call=crash_at_call, sigkill=True)
    reward = build_reward("math", workers=1, timeout_s=10.0)
    try:
        with engine_threads(ENGINE_THREADS):
            metrics = run(
                store_dir, engine, prompts, build_char_tokenizer(), reward, RolloutConfig(**SCALING_CFG), hosts=hosts
            )
    finally:
        reward.close()
    if rank == 0:
        assert metrics["perf/rollout_engines"] == world_size
        assert metrics["perf/rollout_shards_written"] + metrics["perf/rollout_shards_resumed"] == 4
    else:
        assert metrics == {}


def _hashes(store_dir) -> dict[str, Checksum]:
    return {p.name: Checksum.of_file(p) for p in sorted(store_dir.glob("shard_*.arrow"))}


@pytest.fixture(scope="module")
def one_engine_store(tmp_path_factory, model_dir, tokenizer):
    """D_k of 8 prompts (4 shards) generated by one engine on one thread: the reference."""
    store_dir = tmp_path_factory.mktemp("one_engine")
    prompts = make_prompts(tokenizer, 8)
    run_distributed(_generate_on_ranks, 1, str(store_dir), model_dir, prompts, None)
    return store_dir, prompts


@pytest.mark.multiprocess
def test_two_engines_generate_the_same_store_as_one(tmp_path, model_dir, one_engine_store):
    reference, prompts = one_engine_store
    run_distributed(_generate_on_ranks, 2, str(tmp_path), model_dir, prompts, None)
    assert is_complete(tmp_path)
    assert _hashes(tmp_path) == _hashes(reference) and len(_hashes(reference)) == 4
    assert (tmp_path / "manifest.json").read_bytes() == (reference / "manifest.json").read_bytes()


@pytest.mark.multiprocess
def test_a_partial_store_from_two_engines_is_finished_by_one(tmp_path, model_dir, tokenizer, one_engine_store):
    """Both engines are SIGKILLed at their second shard (their claims stay behind); one engine then
    finishes the store, generating only what is missing, and the result equals the uninterrupted one."""
    reference, prompts = one_engine_store
    with pytest.raises(RuntimeError, match="SIGKILL"):
        run_distributed(_generate_on_ranks, 2, str(tmp_path), model_dir, prompts, 1)
    assert not is_complete(tmp_path)
    survivors = {
        p.name: p.stat().st_mtime_ns for p in tmp_path.glob("shard_*.arrow") if (p.with_suffix(".json")).exists()
    }
    assert 1 <= len(survivors) <= 2 and list(tmp_path.glob("*.claim"))

    run_distributed(_generate_on_ranks, 1, str(tmp_path), model_dir, prompts, None)
    assert _hashes(tmp_path) == _hashes(reference)
    assert {name: (tmp_path / name).stat().st_mtime_ns for name in survivors} == survivors  # not regenerated
    assert not list(tmp_path.glob("*.claim"))


def _stop_on_ranks(rank, world_size, store_dir, model_dir, prompts, stopping_ranks) -> None:
    """Every rank hosts one engine; the ranks in ``stopping_ranks`` are asked to stop (as a preempted
    host is) once they have written one shard. Asserts what each rank sees."""
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    hosts = HostGroup.create(EnginePlacement.from_env(tensor_parallel=1, cores=world_size))
    engine = TransformersEngine(model_dir, dtype="float32", device="cpu", batch_size=16)
    reward = build_reward("math", workers=1, timeout_s=10.0)
    mine: list[int] = []
    try:
        with engine_threads(ENGINE_THREADS):
            metrics = run(
                store_dir,
                engine,
                prompts,
                build_char_tokenizer(),
                reward,
                RolloutConfig(**SCALING_CFG),
                hosts=hosts,
                on_shard_written=mine.append,
                stop=lambda: rank in stopping_ranks and len(mine) >= 1,
            )
    except GenerationStopped as stopped:  # every rank, at the same point: none is left waiting
        assert len(stopping_ranks) == world_size, "a host that was not asked to stop finishes the store"
        assert (stopped.written, stopped.missing) == (2, 4) and len(mine) == 1
        hosts.barrier()  # every rank is still in step for its next collective
        return
    finally:
        reward.close()
    assert len(stopping_ranks) < world_size, "every host stopped after one shard of four: the store is incomplete"
    if rank in stopping_ranks:
        assert len(mine) <= 1  # none if the other host claimed every shard first (a loaded machine)
    if rank == 0:
        assert metrics["perf/rollout_shards_written"] == 4


@pytest.mark.multiprocess
def test_hosts_asked_to_stop_leave_generation_together_and_a_rerun_finishes_the_store(
    tmp_path, model_dir, one_engine_store
):
    """Both hosts are asked to stop (a preemption signals every rank) after their first shard: each rank
    raises GenerationStopped at the same point, with 2 of 4 shards written and the store not sealed;
    one engine then makes the other two, and the store equals the uninterrupted one."""
    reference, prompts = one_engine_store
    run_distributed(_stop_on_ranks, 2, str(tmp_path), model_dir, prompts, (0, 1))
    assert not is_complete(tmp_path) and len(_hashes(tmp_path)) == 2
    run_distributed(_generate_on_ranks, 1, str(tmp_path), model_dir, prompts, None)
    assert _hashes(tmp_path) == _hashes(reference)


@pytest.mark.multiprocess
def test_a_host_asked_to_stop_leaves_the_rest_to_the_other(tmp_path, model_dir, one_engine_store):
    """Only rank 1 is asked to stop: it writes one shard, rank 0 claims the rest, the store is sealed."""
    reference, prompts = one_engine_store
    run_distributed(_stop_on_ranks, 2, str(tmp_path), model_dir, prompts, (1,))
    assert is_complete(tmp_path) and _hashes(tmp_path) == _hashes(reference)
