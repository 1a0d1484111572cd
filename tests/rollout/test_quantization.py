"""Quantized behaviour policy (rollout.quantization): the transformers engine samples from the
fake-quant FP8 model and stores *its* log-probs exactly; exported checkpoints dequantize to the
fake-quant weights; a quantized mixture of experts records the routes it sampled with; clear errors
without ModelOpt or without a GPU.

Tests that quantize need NVIDIA Model Optimizer (the ``fp8`` extra); they are skipped without it.
"""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, PreTrainedModel

from megatron_mugrpo.config import load_config
from megatron_mugrpo.errors import ConfigError, InputError
from megatron_mugrpo.rollout.config import RolloutConfig
from megatron_mugrpo.rollout.engine import SamplingParams
from megatron_mugrpo.rollout.quantization import (
    BehaviourQuantizer,
    ModelOptConfig,
    ModelOptMissingError,
    QuantizationError,
    available_schemes,
    behaviour_quantizer,
    calibration_batches,
    check_scheme_usable,
    dequantized_state_dict,
    export_checkpoint,
    load_behaviour_policy,
    quantization_scheme,
    quantize_model,
)
from megatron_mugrpo.rollout.transformers_engine import TransformersEngine, teacher_forced_logprobs
from megatron_mugrpo.training.tiny import tiny_hf_dir, tiny_model

HAVE_MODELOPT = importlib.util.find_spec("modelopt") is not None  # without importing it (slow) at collection
needs_modelopt = pytest.mark.skipif(
    not HAVE_MODELOPT, reason="NVIDIA Model Optimizer is not installed (pip install 'megatron_mugrpo[fp8]')"
)

LOGPROB_TOLERANCE = 1e-5
"""Engine log-probs vs a teacher-forced recompute of the same (quantized) model, float32."""
VOCAB = 64
SHAPE = {"vocab_size": VOCAB, "max_position_embeddings": 128, "tie_word_embeddings": True}
"""tiny_model's qwen2 (hidden 64, 2 layers, 4 heads / 2 KV heads, EOS id 2) with these changes."""
CPU_SCHEMES = ("fp8", "fp8_per_channel")
PROMPTS = [[1, 5, 6], [1, 7, 8, 9, 10, 11], [1, 2], [1, 30, 31, 32]]
CALIBRATION = [[1, 3 + i, 4 + i, 5 + (i % 7)] for i in range(24)] + [[1, 9, 9, 9, 9, 9, 2]]


def _tiny_model(seed: int) -> PreTrainedModel:
    return tiny_model(seed=seed, **SHAPE).eval()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_hf_dir(tmp_path_factory.mktemp("tiny_fp8") / "model", seed=0, tokenizer=False, **SHAPE)


def _named(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(n, p.detach().clone()) for n, p in model.named_parameters()]


def _quantizer(name: str, tmp_path) -> BehaviourQuantizer:
    return BehaviourQuantizer(
        scheme=quantization_scheme(name), calibration=CALIBRATION, batch_size=8, export_dir=tmp_path / "q"
    )


def _quantized_engine(model_dir, tensors, name: str, tmp_path, engine=None) -> TransformersEngine:
    return load_behaviour_policy(
        engine,
        tensors,
        engine_name="transformers",
        hf_dir=model_dir,
        build=lambda d: TransformersEngine(d, dtype="float32", device="cpu", batch_size=4, eos_token_ids=[2, 3]),
        quantizer=_quantizer(name, tmp_path),
    )


# ----------------------------------------------------------------------------- no ModelOpt needed


def test_schemes_registry_and_config_key():
    assert available_schemes()[:3] == ("none", "fp8", "fp8_per_channel")
    assert quantization_scheme("none") is None
    with pytest.raises(QuantizationError, match=r"rollout\.quantization=.int3. is unknown"):
        quantization_scheme("int3")
    with pytest.raises(ConfigError, match=r"rollout\.quantization"):
        load_config(None, ["rollout.quantization=int3"])
    assert load_config(None, ["rollout.quantization=fp8"]).rollout.quantization == "fp8"
    with pytest.raises(QuantizationError, match=r"rollout\.modelopt\.calibration_prompts"):
        ModelOptConfig(calibration_prompts=0)


def test_no_quantizer_for_none_and_calibration_from_stage_prompts(tmp_path):
    class Prompt:
        def __init__(self, ids):
            self.prompt_ids = ids

    prompts = [Prompt([1, i]) for i in range(10)]
    assert behaviour_quantizer(RolloutConfig(), prompts, tmp_path) is None
    rollout = RolloutConfig(quantization="fp8", modelopt=ModelOptConfig(calibration_prompts=3))
    quantizer = behaviour_quantizer(rollout, prompts, tmp_path)
    assert quantizer.calibration == [[1, 0], [1, 1], [1, 2]] and quantizer.scheme.name == "fp8"


def test_calibration_batches_never_pad():
    prompts = [[1, 2], [3, 4, 5], [6, 7], [8, 9], [1, 2, 3]]
    assert calibration_batches(prompts, batch_size=2) == [[[1, 2], [6, 7]], [[8, 9]], [[3, 4, 5], [1, 2, 3]]]


def test_missing_modelopt_is_an_input_error_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "modelopt", None)  # makes `import modelopt...` raise ImportError
    monkeypatch.setitem(sys.modules, "modelopt.torch", None)
    monkeypatch.setitem(sys.modules, "modelopt.torch.quantization", None)
    with pytest.raises(ModelOptMissingError, match=r"megatron_mugrpo\[fp8\]") as info:
        check_scheme_usable(quantization_scheme("fp8"))
    assert isinstance(info.value, InputError)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_gpu_only_scheme_on_cpu_is_an_input_error():
    with pytest.raises(QuantizationError, match="needs a CUDA GPU") as info:
        check_scheme_usable(quantization_scheme("nvfp4"))
    assert isinstance(info.value, InputError)
    with pytest.raises(QuantizationError, match="needs a CUDA GPU"):
        quantize_model(_tiny_model(0), quantization_scheme("nvfp4"), CALIBRATION)


# ------------------------------------------------------------------------------ with ModelOpt


@needs_modelopt
@pytest.mark.parametrize("name", CPU_SCHEMES)
def test_engine_logprobs_are_the_quantized_models(model_dir, tmp_path, name):
    """Quantize → fold → generate: stored log-probs equal a teacher-forced pass of the quantized model,
    and differ from the full-precision model's (so the quantization did happen). Deterministic (seeded);
    in general a rare token can differ by one FP8 step, when float32 rounding differences between the
    batched decode and the recompute cross an FP8 rounding boundary (see rollout.quantization)."""
    original = _tiny_model(0)
    engine = _quantized_engine(model_dir, _named(original), name, tmp_path)
    _assert_samples_are_the_quantized_models(engine, original, samples_per_prompt=3)


def _assert_samples_are_the_quantized_models(
    engine: TransformersEngine, original: torch.nn.Module, samples_per_prompt: int
) -> list:
    """Sample PROMPTS; the stored log-probs equal a teacher-forced pass of the engine's (quantized) model
    and differ from the full-precision ``original``'s, so the quantization did happen. Returns the groups."""
    params = SamplingParams(max_new_tokens=10, temperature=0.9, seed=5)
    groups = engine.generate(PROMPTS, samples_per_prompt, params)
    prompts = [PROMPTS[i] for i, g in enumerate(groups) for _ in g]
    gens = [gen for g in groups for gen in g]
    responses = [g.response_ids for g in gens]
    quantized = teacher_forced_logprobs(engine.model, prompts, responses, params.temperature)
    full = teacher_forced_logprobs(original, prompts, responses, params.temperature)
    stored = [torch.tensor(g.logprobs) for g in gens]
    assert max(float((s - q).abs().max()) for s, q in zip(stored, quantized)) <= LOGPROB_TOLERANCE
    assert max(float((s - f).abs().max()) for s, f in zip(stored, full)) > 1e-4
    return groups


@needs_modelopt
def test_a_quantized_moe_engine_records_the_routes_its_quantized_routers_chose(tmp_path):
    """FP8 rollouts × routing replay: a tiny Qwen3-MoE quantized by ModelOpt stores the quantized
    model's log-probs and, per token, the experts the quantized model routed it to (the routes the
    trainer then replays)."""
    from route_checks import assert_routes_are_teacher_forced

    moe_dir = tiny_hf_dir(tmp_path / "moe", "qwen3_moe", seed=0, tokenizer=False, **SHAPE)
    source = AutoModelForCausalLM.from_pretrained(str(moe_dir)).eval()
    engine = load_behaviour_policy(
        None,
        _named(source),
        engine_name="transformers",
        hf_dir=moe_dir,
        build=lambda d: TransformersEngine(
            d, dtype="float32", device="cpu", batch_size=4, eos_token_ids=[2, 3], record_routes=True
        ),
        quantizer=_quantizer("fp8", tmp_path),
    )
    groups = _assert_samples_are_the_quantized_models(engine, source, samples_per_prompt=2)
    config = engine.model.config
    assert_routes_are_teacher_forced(
        engine.model, PROMPTS, groups, moe_layers=config.num_hidden_layers, topk=config.num_experts_per_tok
    )


@needs_modelopt
def test_next_stage_requantizes_the_new_weights(model_dir, tmp_path):
    """A second sync quantizes the new weights from scratch: equal to a fresh engine given them."""
    engine = _quantized_engine(model_dir, _named(_tiny_model(0)), "fp8", tmp_path)
    engine = _quantized_engine(model_dir, _named(_tiny_model(1)), "fp8", tmp_path, engine=engine)
    fresh = _quantized_engine(model_dir, _named(_tiny_model(1)), "fp8", tmp_path)
    ids = torch.tensor([PROMPTS[1]])
    with torch.no_grad():
        torch.testing.assert_close(engine.model(ids).logits, fresh.model(ids).logits, rtol=0, atol=0)


def _fake_quant_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Each quantized Linear's fake-quant weight (computed in float32, as the transformers engine does)."""
    return {
        f"{module_name}.weight": module.weight_quantizer(module.weight.float()).detach().clone()
        for module_name, module in model.named_modules()
        if getattr(getattr(module, "weight_quantizer", None), "is_enabled", False)
    }


@needs_modelopt
@pytest.mark.parametrize("name", CPU_SCHEMES)
def test_export_dequantizes_to_the_fake_quant_weights(tmp_path, name):
    """Export → w_fp8 · weight_scale by hand = the fake-quant weights (float32 model: exact up to
    float32 rounding of the scale), and the checkpoint is what an engine needs."""
    model = _tiny_model(0)
    quantize_model(model, quantization_scheme(name), CALIBRATION, batch_size=8)
    fake = _fake_quant_weights(model)
    assert len(fake) == 2 * 7  # q, k, v, o, gate, up, down per layer; embeddings and lm_head stay full
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer_config.json").write_text("{}")
    target = export_checkpoint(model, tmp_path / "export", tokenizer_dir=tmp_path / "tok")
    quant_config = json.loads((target / "hf_quant_config.json").read_text())
    assert quant_config["producer"]["name"] == "modelopt" and "FP8" in quant_config["quantization"]["quant_algo"]
    assert (target / "tokenizer_config.json").is_file()
    assert not list(tmp_path.glob(".export*")), "no temporary directory is left behind"
    weights = dequantized_state_dict(target)
    for key, expected in fake.items():
        torch.testing.assert_close(weights[key], expected, rtol=1e-6, atol=0)
    torch.testing.assert_close(weights["model.embed_tokens.weight"], _tiny_model(0).model.embed_tokens.weight.detach())


@needs_modelopt
def test_bf16_export_is_within_one_fp8_step_of_the_fake_quant(tmp_path):
    """A bf16 model's FP8 codes are w / s cast to E4M3, with s the exported float32 scale. Dividing in
    bf16 first (a second rounding) would put a few percent of them one E4M3 step (3 mantissa bits)
    away from the float32 fake quant; ModelOpt 0.47 on CPU divides in float32 (the bf16 weight is
    promoted by the float32 scale), so none moves. The test first checks that this model does expose
    the double rounding (else "nothing moved" would prove nothing), then that the export moved either
    no code or exactly the codes a bf16 division moves, never others, and each by at most one step.
    SGLang serves the exported codes."""
    model = _tiny_model(0).to(torch.bfloat16)
    quantize_model(model, quantization_scheme("fp8"), CALIBRATION, batch_size=8)
    fake = _fake_quant_weights(model)
    bf16_weights = {key: p.detach().clone() for key, p in model.named_parameters() if key in fake}
    target = export_checkpoint(model, tmp_path / "export")
    weights = dequantized_state_dict(target)
    scales = {key: t for f in target.glob("*.safetensors") for key, t in load_file(str(f)).items()}
    moved = hazard = total = 0
    for key, expected in fake.items():
        diff = (weights[key] - expected).abs()
        assert bool((diff <= expected.abs() * 2**-3 + 1e-12).all()), key
        moved, total = moved + int((diff > expected.abs() * 1e-6).sum()), total + diff.numel()
        scale = scales[key.removesuffix("weight") + "weight_scale"].float()
        scale = scale.view(-1, 1) if scale.numel() > 1 else scale
        w = bf16_weights[key]
        exact = (w.float() / scale).to(torch.float8_e4m3fn).float()
        rounded_twice = (w / scale.to(torch.bfloat16)).to(torch.float8_e4m3fn).float()
        hazard += int((exact != rounded_twice).sum())
    assert 0 < hazard / total < 0.1, f"a bf16 division would move {hazard}/{total} codes; expected a few percent"
    assert moved in (0, hazard), f"{moved}/{total} codes moved; expected 0 (float32 division) or {hazard} (bf16)"


@needs_modelopt
def test_export_replaces_an_older_checkpoint(tmp_path):
    for seed in (0, 1):
        model = _tiny_model(seed).to(torch.bfloat16)
        quantize_model(model, quantization_scheme("fp8"), CALIBRATION, batch_size=8)
        export_checkpoint(model, tmp_path / "export")
    embed = dequantized_state_dict(tmp_path / "export")["model.embed_tokens.weight"]
    torch.testing.assert_close(embed, _tiny_model(1).model.embed_tokens.weight.bfloat16().float())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]
