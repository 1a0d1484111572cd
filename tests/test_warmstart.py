"""The demo's base model: worked solutions, the deliberate answer flaw, and caching of the built directory."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from megatron_mugrpo.char_tokenizer import build_char_tokenizer
from megatron_mugrpo.config import load_config
from megatron_mugrpo.rewards.registry import build_reward
from megatron_mugrpo.rollout.tasks import CODE_READ_FLAWED, builtin_completion, builtin_problems, code_solution
from megatron_mugrpo.warmstart import WARMSTART_FILE, miscopy, prepare_base_model, sft_batch, worked_solution


@pytest.mark.parametrize(
    ("problem", "answer", "expected"),
    [
        ("23+58", "81", "3+8+0=11,2+5+1=8,\\boxed{81}"),
        ("99+99", "198", "9+9+0=18,9+9+1=19,\\boxed{198}"),
        ("7+5", "12", "7+5+0=12,\\boxed{12}"),
        ("52-38", "14", "12-8-0=4,5-3-1=1,\\boxed{14}"),
        ("90-9", "81", "10-9-0=1,9-0-1=8,\\boxed{81}"),
    ],
)
def test_worked_solution_by_hand(problem: str, answer: str, expected: str):
    assert worked_solution(problem, answer) == expected


def test_worked_solutions_are_verified_correct():
    rows = builtin_problems("arithmetic", 200, seed=3, split="train")
    reward = build_reward("math", workers=1, timeout_s=5.0)
    try:
        scores = reward.score([worked_solution(r["problem"], r["answer"]) for r in rows], [r["answer"] for r in rows])
    finally:
        reward.close()
    assert all(score == 1.0 for score, _ in scores)


def test_miscopy_changes_exactly_one_digit():
    rng = random.Random(0)
    for answer in ("0", "7", "81", "198"):
        for _ in range(20):
            wrong = miscopy(answer, rng)
            assert len(wrong) == len(answer) and sum(a != b for a, b in zip(wrong, answer)) == 1


def test_sft_batch_labels_only_the_completion_and_noise_rate():
    tokenizer = build_char_tokenizer()
    rows = builtin_problems("addition", 400, seed=0, split="train")
    batch = sft_batch(rows, tokenizer, noise=0.5, rng=random.Random(1))
    labels, ids = batch["labels"], batch["input_ids"]
    for row, lab, seq in zip(rows[:5], labels, ids):
        prompt_len = len(tokenizer(row["problem"] + "=")["input_ids"])
        assert (lab[:prompt_len] == -100).all() and (lab[prompt_len] == seq[prompt_len])
    texts = [tokenizer.decode([t for t in lab.tolist() if t >= 0], skip_special_tokens=True) for lab in labels]
    wrong = sum(not t.endswith(builtin_completion(r["answer"])) for t, r in zip(texts, rows))
    assert 150 <= wrong <= 250  # ~50% of 400


def test_sft_batch_of_a_code_task_teaches_programs_with_the_flaw_at_its_rate():
    tokenizer = build_char_tokenizer()
    rows = builtin_problems("code_expr", 400, seed=0, split="train")
    batch = sft_batch(rows, tokenizer, noise=0.5, rng=random.Random(1), task="code_expr")
    texts = []
    for row, lab, seq in zip(rows, batch["labels"], batch["input_ids"]):
        prompt_len = len(tokenizer(row["problem"] + ":")["input_ids"])
        assert (lab[:prompt_len] == -100).all() and (lab[prompt_len] == seq[prompt_len])
        completion = [t for t in lab.tolist() if t >= 0]
        assert completion[-1] == tokenizer.eos_token_id
        texts.append(tokenizer.decode(completion, skip_special_tokens=True))
    flawed = sum(t == code_solution(r["problem"], flawed=True) for t, r in zip(texts, rows))
    correct = sum(t == code_solution(r["problem"]) for t, r in zip(texts, rows))
    assert flawed + correct == 400 and 150 <= flawed <= 250  # ~50% of 400
    assert all((CODE_READ_FLAWED in t) == (t == code_solution(r["problem"], flawed=True)) for t, r in zip(texts, rows))
    clean = sft_batch(rows, tokenizer, noise=0.0, rng=random.Random(1), task="code_expr")
    assert clean["labels"].shape[0] == 400 and not any(
        CODE_READ_FLAWED in tokenizer.decode([t for t in lab.tolist() if t >= 0]) for lab in clean["labels"]
    )


def test_math_sft_batch_is_unchanged_by_the_task_argument():
    tokenizer = build_char_tokenizer()
    rows = builtin_problems("addition", 64, seed=0, split="train")
    plain = sft_batch(rows, tokenizer, noise=0.5, rng=random.Random(1))
    named = sft_batch(rows, tokenizer, noise=0.5, rng=random.Random(1), task="addition")
    assert all(torch.equal(plain[k], named[k]) for k in plain)


def test_prepare_base_model_is_cached(tmp_path: Path):
    cfg = load_config(Path(__file__).parents[1] / "configs" / "demo_cpu.yaml", ["warmstart.steps=2"])
    out = prepare_base_model(cfg, tmp_path / "base")
    marker = json.loads((out / WARMSTART_FILE).read_text())
    assert marker["spec"]["warmstart"]["steps"] == 2 and (out / "config.json").is_file()
    mtime = (out / "model.safetensors").stat().st_mtime_ns
    assert prepare_base_model(cfg, tmp_path / "base") == out
    assert (out / "model.safetensors").stat().st_mtime_ns == mtime, "a matching base model is reused"
    changed = load_config(Path(__file__).parents[1] / "configs" / "demo_cpu.yaml", ["warmstart.steps=3"])
    prepare_base_model(changed, tmp_path / "base")
    assert json.loads((out / WARMSTART_FILE).read_text())["spec"]["warmstart"]["steps"] == 3


def test_tiny_moe_arch_builds_a_qwen3_moe_and_leaves_the_dense_spec_alone(tmp_path: Path):
    from megatron_mugrpo.warmstart import TinyModelConfig, WarmStartConfig, base_model_spec, build_tiny_model

    tokenizer = build_char_tokenizer(tmp_path)
    dense = TinyModelConfig()
    # The dense spec keeps the keys it had before model.tiny.arch existed: cached demo models stay valid.
    assert set(base_model_spec(dense, WarmStartConfig(), task="addition", seed=0)["tiny"]) == {
        "hidden_size", "num_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
        "max_position_embeddings", "tie_word_embeddings", "rope_theta",
    }  # fmt: skip
    moe_cfg = TinyModelConfig(arch="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    spec = base_model_spec(moe_cfg, WarmStartConfig(), task="addition", seed=0)["tiny"]
    assert spec["arch"] == "qwen3_moe" and spec["num_experts"] == 4
    moe = build_tiny_model(moe_cfg, tokenizer, seed=0)
    assert type(moe).__name__ == "Qwen3MoeForCausalLM"
    assert moe.config.num_experts_per_tok == 2 and moe.config.moe_intermediate_size == 16
    assert moe.config.head_dim == 16  # hidden 64 / 4 heads, as the dense model
    with torch.no_grad():
        logits = moe(torch.tensor([[1, 5, 7, 9]])).logits
    assert logits.shape == (1, 4, len(tokenizer)) and torch.isfinite(logits).all()
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        TinyModelConfig(arch="qwen3_moe", num_experts=2, num_experts_per_tok=3)
    with pytest.raises(ValueError, match=r"model\.tiny\.arch"):
        TinyModelConfig(arch="mixtral")


def test_model_dtype_names_a_torch_dtype_and_a_typo_names_the_key() -> None:
    from megatron_mugrpo.errors import ConfigError
    from megatron_mugrpo.warmstart import DTYPES, ModelConfig

    assert [ModelConfig(dtype=name).torch_dtype for name in DTYPES] == [torch.float32, torch.bfloat16, torch.float16]
    with pytest.raises(ConfigError, match=r"model\.dtype='bf16' is not one of"):
        ModelConfig(dtype="bf16")
