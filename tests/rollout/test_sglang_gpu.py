"""SGLang engine on a GPU: behaviour log-probs equal a teacher-forced recompute, weights refresh,
memory release. Skipped without CUDA and SGLang (``pip install 'megatron_mugrpo[sglang]'``)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from transformers import Qwen2ForCausalLM

from megatron_mugrpo.char_tokenizer import build_char_tokenizer
from megatron_mugrpo.rollout.engine import SamplingParams
from megatron_mugrpo.rollout.tasks import builtin_problems, builtin_prompt
from megatron_mugrpo.rollout.transformers_engine import teacher_forced_logprobs
from megatron_mugrpo.training.tiny import tiny_hf_dir

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="SGLang is not installed"),
]

MEAN_TOLERANCE = 1e-3
MAX_TOLERANCE = 1e-2
"""float32 SGLang kernels (paged attention, fused norms) vs one HF forward per sequence."""


def _save_model(path, seed: int) -> None:
    """A float32 Qwen2 over the character tokenizer (saved with it), 2 layers, tied embeddings."""
    tiny_hf_dir(
        path,
        seed=seed,
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=2,  # head_dim 64: supported by every SGLang attention backend
        num_key_value_heads=1,
        tie_word_embeddings=True,
    )


def _logprob_errors(model_dir, prompts, groups, temperature):
    model = Qwen2ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
    rows = [(prompts[i], g) for i, group in enumerate(groups) for g in group]
    reference = teacher_forced_logprobs(model, [p for p, _ in rows], [g.response_ids for _, g in rows], temperature)
    errors = torch.cat([(torch.tensor(g.logprobs) - ref).abs() for (_, g), ref in zip(rows, reference)])
    return float(errors.mean()), float(errors.max())


def test_sglang_logprobs_weights_and_release(tmp_path):
    from megatron_mugrpo.rollout.sglang_engine import SGLangEngine

    tokenizer = build_char_tokenizer()
    dir_a, dir_b = tmp_path / "a", tmp_path / "b"
    _save_model(dir_a, seed=0)
    _save_model(dir_b, seed=1)
    prompts = [
        tokenizer(builtin_prompt(r["problem"]))["input_ids"] for r in builtin_problems("arithmetic", 8, 0, "train")
    ]
    params = SamplingParams(max_new_tokens=24, temperature=0.8, seed=0)
    engine = SGLangEngine(
        str(dir_a),
        mem_fraction_static=0.3,
        dtype="float32",
        attention_backend="triton",
        disable_cuda_graph=True,
    )
    try:
        groups = engine.generate(prompts, [4] * len(prompts), params)
        assert [len(g) for g in groups] == [4] * len(prompts)
        mean_err, max_err = _logprob_errors(dir_a, prompts, groups, params.temperature)
        assert mean_err <= MEAN_TOLERANCE and max_err <= MAX_TOLERANCE, (mean_err, max_err)

        engine.release()
        with pytest.raises(RuntimeError, match="released"):
            engine.generate(prompts, 1, params)
        engine.load_hf_dir(str(dir_b))  # the next stage's policy
        groups = engine.generate(prompts, 2, params)
        mean_err, max_err = _logprob_errors(dir_b, prompts, groups, params.temperature)
        assert mean_err <= MEAN_TOLERANCE and max_err <= MAX_TOLERANCE, (mean_err, max_err)

        weights_a = Qwen2ForCausalLM.from_pretrained(dir_a, dtype=torch.float32).state_dict()
        engine.load_weights(weights_a.items())  # tensors streamed from the trainer
        groups = engine.generate(prompts, 2, params)
        mean_err, max_err = _logprob_errors(dir_a, prompts, groups, params.temperature)
        assert mean_err <= MEAN_TOLERANCE and max_err <= MAX_TOLERANCE, (mean_err, max_err)
    finally:
        engine.shutdown()
