"""Built-in arithmetic task and the locally built character tokenizer."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from megatron_mugrpo.rollout.tasks import (
    BUILTIN_TASKS,
    CHARACTERS,
    build_char_tokenizer,
    builtin_completion,
    builtin_problems,
    builtin_prompt,
    is_eval_problem,
)


def _value(problem: str) -> int:
    for op in "+-*":
        if op in problem:
            a, b = problem.split(op)
            return {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
    raise AssertionError(f"no operator in {problem!r}")


@pytest.mark.parametrize("task", sorted(BUILTIN_TASKS))
def test_answers_are_correct_and_within_difficulty(task):
    spec = BUILTIN_TASKS[task]
    rows = builtin_problems(task, 300, seed=1, split="train")
    assert len(rows) == 300
    for row in rows:
        assert _value(row["problem"]) == int(row["answer"]) >= 0
        operands = [int(x) for x in row["problem"].replace("+", " ").replace("-", " ").replace("*", " ").split()]
        assert all(0 <= x <= spec.max_operand for x in operands)


def test_deterministic_distinct_and_seeded():
    first = builtin_problems("arithmetic", 500, seed=0, split="train")
    assert first == builtin_problems("arithmetic", 500, seed=0, split="train")
    assert first != builtin_problems("arithmetic", 500, seed=1, split="train")
    assert len({r["problem"] for r in first}) == 500


def test_train_and_eval_splits_are_disjoint():
    train = {r["problem"] for r in builtin_problems("arithmetic", 3000, seed=0, split="train")}
    evals = {r["problem"] for r in builtin_problems("arithmetic", 500, seed=7, split="eval")}
    assert not train & evals
    assert all(is_eval_problem(p) for p in evals) and not any(is_eval_problem(p) for p in train)


def test_small_problem_space_repeats_instead_of_hanging():
    # arithmetic_easy has at most 200 distinct problems; the eval split holds about a tenth of them.
    rows = builtin_problems("arithmetic_easy", 100, seed=0, split="eval")
    assert len(rows) == 100 and len({r["problem"] for r in rows}) < 100


def test_bad_arguments_name_the_fix():
    with pytest.raises(ValueError, match=r"data\.builtin_task"):
        builtin_problems("calculus", 3, seed=0, split="train")
    with pytest.raises(ValueError, match="split"):
        builtin_problems("arithmetic", 3, seed=0, split="test")


def test_char_tokenizer_round_trip(tmp_path):
    build_char_tokenizer(tmp_path / "tok")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "tok")
    assert len(tokenizer) < 128
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    text = builtin_prompt("23+58") + builtin_completion("81")
    assert text == "23+58=\\boxed{81}"
    ids = tokenizer(text)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id and len(ids) == len(text) + 1  # one token per character
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    every_char = CHARACTERS + "Let's think step by step."
    assert tokenizer.decode(tokenizer(every_char)["input_ids"], skip_special_tokens=True) == every_char
    assert tokenizer.unk_token_id not in tokenizer(every_char)["input_ids"]
    with_eos = tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]
    assert tokenizer.decode(with_eos, skip_special_tokens=True) == text
