"""Transformers rollout engine: behaviour log-probs equal a teacher-forced recompute, padding, EOS,
determinism, weight loading, output validation, and the engine registry."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2ForCausalLM

from megatron_mugrpo.rollout.config import RolloutConfig
from megatron_mugrpo.rollout.engine import (
    EngineOutputError,
    Generation,
    RolloutEngine,
    SamplingParams,
    build_engine,
    build_engine_from_config,
    engine_kwargs,
    sampling_params,
    validate_generations,
)
from megatron_mugrpo.rollout.placement import EnginePlacement
from megatron_mugrpo.rollout.sglang_engine import SGLangEngineConfig
from megatron_mugrpo.rollout.transformers_engine import (
    TransformersEngine,
    TransformersEngineConfig,
    teacher_forced_logprobs,
)
from megatron_mugrpo.training.tiny import tiny_hf_dir

LOGPROB_TOLERANCE = 1e-5
"""float32 engine log-probs vs one unpadded forward pass per sequence (measured ≈ 5e-7)."""
VOCAB = 48
# Prompts of different lengths share a micro-batch: left padding must not change any log-prob.
PROMPTS = [[1, 5, 6], [1, 7, 8, 9, 10, 11, 12, 13, 14], [1, 2], [1, 30, 31, 32, 33]]
COUNTS = [3, 2, 4, 1]
STOP_IDS = list(range(2, 12))
"""Many EOS ids so that a random model stops often (≈ 20% per step)."""


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """Two tiny Qwen2 checkpoints with different weights (EOS id 2, no tokenizer)."""
    root = tmp_path_factory.mktemp("tiny_models")
    shape = {"hidden_size": 32, "intermediate_size": 64, "max_position_embeddings": 128, "tie_word_embeddings": True}
    a = tiny_hf_dir(root / "a", seed=0, tokenizer=False, vocab_size=VOCAB, **shape)
    b = tiny_hf_dir(root / "b", seed=1, tokenizer=False, vocab_size=VOCAB, **shape)
    return str(a), str(b)


def _engine(model_dir: str, **kwargs) -> TransformersEngine:
    kwargs.setdefault("batch_size", 4)
    return TransformersEngine(model_dir, dtype="float32", device="cpu", **kwargs)


def _flatten(prompts, groups):
    rows = [(prompts[i], gen) for i, group in enumerate(groups) for gen in group]
    return [p for p, _ in rows], [g for _, g in rows]


def _max_logprob_error(engine: TransformersEngine, prompts, groups, temperature: float) -> float:
    flat_prompts, gens = _flatten(prompts, groups)
    reference = teacher_forced_logprobs(engine.model, flat_prompts, [g.response_ids for g in gens], temperature)
    return max(float((torch.tensor(g.logprobs) - ref).abs().max()) for g, ref in zip(gens, reference))


@pytest.mark.parametrize("use_cache", [True, False], ids=["kv_cache", "no_cache"])
def test_logprobs_equal_teacher_forced_recompute(model_dirs, use_cache):
    engine = _engine(model_dirs[0], use_cache=use_cache, eos_token_ids=STOP_IDS)
    params = SamplingParams(max_new_tokens=12, temperature=0.7, seed=3)
    groups = engine.generate(PROMPTS, COUNTS, params)
    assert [len(g) for g in groups] == COUNTS
    assert _max_logprob_error(engine, PROMPTS, groups, params.temperature) <= LOGPROB_TOLERANCE


def test_cache_does_not_change_samples(model_dirs):
    params = SamplingParams(max_new_tokens=10, temperature=1.0, seed=5)
    cached = _engine(model_dirs[0], use_cache=True).generate(PROMPTS, 2, params)
    uncached = _engine(model_dirs[0], use_cache=False).generate(PROMPTS, 2, params)
    for group_a, group_b in zip(cached, uncached):
        for a, b in zip(group_a, group_b):
            assert a.response_ids == b.response_ids
            assert a.logprobs == pytest.approx(b.logprobs, abs=LOGPROB_TOLERANCE)


def test_eos_ends_response_and_is_scored(model_dirs):
    engine = _engine(model_dirs[0], eos_token_ids=STOP_IDS)
    params = SamplingParams(max_new_tokens=8, seed=0)
    gens = [g for group in engine.generate(PROMPTS, 6, params) for g in group]
    stops = [g for g in gens if g.finish_reason == "stop"]
    lengths = [g for g in gens if g.finish_reason == "length"]
    assert stops and lengths, "the fixture should produce both finish reasons"
    for g in stops:
        assert g.response_ids[-1] in STOP_IDS and len(g.logprobs) == len(g.response_ids)
        assert not set(g.response_ids[:-1]) & set(STOP_IDS)
    for g in lengths:
        assert len(g.response_ids) == params.max_new_tokens and not set(g.response_ids) & set(STOP_IDS)


def test_same_seed_same_samples_other_seed_differs(model_dirs):
    engine = _engine(model_dirs[0])
    first = engine.generate(PROMPTS, 2, SamplingParams(max_new_tokens=10, seed=11))
    again = engine.generate(PROMPTS, 2, SamplingParams(max_new_tokens=10, seed=11))
    other = engine.generate(PROMPTS, 2, SamplingParams(max_new_tokens=10, seed=12))
    assert first == again
    assert first != other


def test_per_prompt_counts_progress_and_order(model_dirs):
    engine = _engine(model_dirs[0], batch_size=3)
    seen: list[int] = []
    groups = engine.generate(PROMPTS, [2, 0, 3, 1], SamplingParams(max_new_tokens=4), progress=seen.append)
    assert [len(g) for g in groups] == [2, 0, 3, 1]
    assert sum(seen) == 6 and len(seen) == 2  # two micro-batches of at most 3 rows


def test_load_weights_round_trip(model_dirs):
    dir_a, dir_b = model_dirs
    params = SamplingParams(max_new_tokens=6, seed=2)
    expected = _engine(dir_b).generate(PROMPTS, 2, params)
    engine = _engine(dir_a)
    assert engine.generate(PROMPTS, 2, params) != expected
    source = Qwen2ForCausalLM.from_pretrained(dir_b, dtype=torch.float32)
    engine.load_weights(source.state_dict().items())
    assert engine.generate(PROMPTS, 2, params) == expected


def test_load_weights_is_strict(model_dirs):
    engine = _engine(model_dirs[0])
    weights = dict(Qwen2ForCausalLM.from_pretrained(model_dirs[1], dtype=torch.float32).state_dict())
    with pytest.raises(KeyError, match="not_a_weight"):
        engine.load_weights([("not_a_weight", torch.zeros(1))])
    name = "model.norm.weight"
    with pytest.raises(ValueError, match="shape"):
        engine.load_weights([(name, torch.zeros(7))])
    with pytest.raises(ValueError, match="no tensor for"):
        engine.load_weights([(name, weights[name])])
    assert engine.model is None, "a failed load must not leave a half-updated policy behind"


def test_release_then_reload_from_dir_or_tensors(model_dirs):
    dir_a, dir_b = model_dirs
    params = SamplingParams(max_new_tokens=6, seed=4)
    expected_b = _engine(dir_b).generate(PROMPTS, 2, params)
    engine = _engine(dir_a)
    expected_a = engine.generate(PROMPTS, 2, params)
    engine.release()
    assert engine.model is None
    with pytest.raises(RuntimeError, match="released"):
        engine.generate(PROMPTS, 1, params)
    engine.load_hf_dir(dir_a)
    assert engine.generate(PROMPTS, 2, params) == expected_a
    engine.release()  # next stage: weights streamed from the trainer into a rebuilt model
    engine.load_weights(Qwen2ForCausalLM.from_pretrained(dir_b, dtype=torch.float32).state_dict().items())
    assert engine.generate(PROMPTS, 2, params) == expected_b


def test_prompt_ids_outside_vocab_rejected(model_dirs):
    engine = _engine(model_dirs[0])
    with pytest.raises(ValueError, match="outside the model vocabulary"):
        engine.generate([[1, VOCAB + 3]], 1, SamplingParams(max_new_tokens=2))
    with pytest.raises(ValueError, match="empty"):
        engine.generate([[]], 1, SamplingParams(max_new_tokens=2))


@pytest.mark.parametrize(
    ("generation", "message"),
    [
        (Generation([1, 2], [-0.1, float("nan")], "stop"), "not finite"),
        (Generation([1, 2], [-0.1, float("-inf")], "stop"), "not finite"),
        (Generation([1, VOCAB], [-0.1, -0.2], "length"), "outside the vocabulary"),
        (Generation([1, 2, 3], [-0.1, -0.2], "length"), "3 token ids but 2 log-probs"),
        (Generation([1], [-0.1], "abort"), "finish_reason"),
        (Generation([1, 2, 3, 4, 5], [-0.1] * 5, "length"), "max_new_tokens"),
        (Generation([1], [0.5], "stop"), "<= 0"),
    ],
)
def test_bad_engine_output_rejected(generation, message):
    with pytest.raises(EngineOutputError, match=message):
        validate_generations([[generation]], [1], vocab_size=VOCAB, max_new_tokens=4, engine="test")
    with pytest.raises(EngineOutputError, match="responses for prompt 0"):
        validate_generations([[]], [1], vocab_size=VOCAB, max_new_tokens=4, engine="test")


def test_registry_builds_engines(model_dirs):
    engine = build_engine("transformers", model_dirs[0], dtype="float32", batch_size=2)
    assert isinstance(engine, RolloutEngine) and isinstance(engine, TransformersEngine)
    cfg = RolloutConfig(transformers=TransformersEngineConfig(batch_size=5), temperature=0.5, max_new_tokens=7)
    assert build_engine_from_config(cfg, model_dirs[0], dtype="float32").batch_size == 5
    assert sampling_params(cfg, seed=4) == SamplingParams(temperature=0.5, max_new_tokens=7, seed=4)
    with pytest.raises(ValueError, match="unknown rollout engine"):
        build_engine("no_such_engine", model_dirs[0])


def test_sglang_missing_gives_install_hint(model_dirs):
    pytest.importorskip("megatron_mugrpo.rollout.sglang_engine")
    try:
        import sglang  # noqa: F401

        pytest.skip("SGLang is installed: the missing-package error cannot be observed")
    except ImportError:
        pass
    from megatron_mugrpo.rollout.sglang_engine import SGLangNotInstalledError

    with pytest.raises(SGLangNotInstalledError, match=r"pip install 'megatron_mugrpo\[sglang\]'"):
        build_engine("sglang", model_dirs[0])


def test_sampling_params_validation():
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(max_new_tokens=4, temperature=0.0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_logprobs_equal_teacher_forced_recompute_on_gpu(model_dirs):
    engine = TransformersEngine(model_dirs[0], dtype="float32", device="cuda", batch_size=4, eos_token_ids=STOP_IDS)
    params = SamplingParams(max_new_tokens=12, temperature=0.7, seed=3)
    groups = engine.generate(PROMPTS, COUNTS, params)
    # cuBLAS / SDPA kernels differ between a batched decode step and one full forward: allow TF32-free
    # float32 noise, still far below any ratio the loss could notice.
    assert _max_logprob_error(engine, PROMPTS, groups, params.temperature) <= 1e-4


def test_sglang_output_parsing_without_sglang():
    from megatron_mugrpo.rollout.sglang_engine import _check_ok, generation_from_output

    output = {
        "meta_info": {
            "output_token_logprobs": [(-0.5, 7, "a"), (-1.25, 2, "<eos>")],
            "finish_reason": {"type": "stop", "matched": 2},
        }
    }
    assert generation_from_output(output) == Generation([7, 2], [-0.5, -1.25], "stop")
    output["meta_info"]["finish_reason"] = {"type": "abort", "message": "oom"}
    with pytest.raises(RuntimeError, match="abort"):
        generation_from_output(output)
    with pytest.raises(ValueError, match="return_logprob"):
        generation_from_output({"meta_info": {"finish_reason": {"type": "length"}}})
    _check_ok((True, "ok", 0), "update")
    with pytest.raises(RuntimeError, match="bad shapes"):
        _check_ok((False, "bad shapes"), "update_weights_from_disk")


def test_sglang_engine_is_placed_on_its_groups_first_gpu():
    """Engine group 1 of TP 2 on a 4-GPU node: its host (rank 2) runs SGLang from local GPU 2 with
    tp_size 2 and a sampling seed of its own; the transformers engine needs no placement knobs."""
    placement = EnginePlacement(rank=2, world_size=4, local_rank=2, local_world_size=4, tensor_parallel=2, cores=8)
    cfg = RolloutConfig(engine="sglang", tensor_parallel=2, sglang=SGLangEngineConfig(mem_fraction_static=0.6))
    assert engine_kwargs(cfg, seed=10, placement=placement) == {
        "mem_fraction_static": 0.6,
        "enable_memory_saver": True,
        "deterministic": False,
        "seed": 11,
        "tp_size": 2,
        "base_gpu_id": 2,
    }
    cfg = RolloutConfig(transformers=TransformersEngineConfig(batch_size=3))
    assert engine_kwargs(cfg, seed=10, placement=placement) == {"batch_size": 3}


def test_engine_sections_come_from_the_registry_without_heavy_imports():
    """Each engine module brings its ``rollout.<name>`` section; loading the run config (all sections)
    imports neither SGLang, transformers' models nor megatron-core."""
    import subprocess
    import sys

    code = (
        "import sys, dataclasses\n"
        "import megatron_mugrpo.config\n"
        "from megatron_mugrpo.rollout.config import RolloutConfig\n"
        "from megatron_mugrpo.rollout.engine import available_engines, engine_configs\n"
        "fields = {f.name: f.type for f in dataclasses.fields(RolloutConfig)}\n"
        "assert all(fields[name] is cls for name, cls in engine_configs().items()), fields\n"
        "assert set(engine_configs()) == set(available_engines())\n"
        "heavy = [m for m in sys.modules if m == 'sglang' or m.startswith(('sglang.', 'transformers.models.'))]\n"
        "assert not heavy, heavy\n"
        "megatron = [m for m in sys.modules if m.startswith('megatron.core')]\n"
        "assert not megatron, megatron[:3]\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
