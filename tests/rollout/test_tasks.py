"""Built-in arithmetic and code tasks and the locally built character tokenizer."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from megatron_mugrpo.char_tokenizer import CHARACTERS, build_char_tokenizer
from megatron_mugrpo.rewards.code import CodeProblem, CodeRewardConfig, extract_program, score_response
from megatron_mugrpo.rewards.sandbox import Unsandboxed
from megatron_mugrpo.rollout.tasks import (
    BUILTIN_TASKS,
    ArithmeticTask,
    builtin_completion,
    builtin_problems,
    builtin_prompt,
    builtin_reward_kind,
    builtin_template,
    code_solution,
    code_value,
    is_eval_problem,
)

MATH_TASKS = sorted(name for name, spec in BUILTIN_TASKS.items() if isinstance(spec, ArithmeticTask))
CODE_TASKS = sorted(name for name in BUILTIN_TASKS if builtin_reward_kind(name) == "code")


def _value(problem: str) -> int:
    for op in "+-*":
        if op in problem:
            a, b = problem.split(op)
            return {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
    raise AssertionError(f"no operator in {problem!r}")


@pytest.mark.parametrize("task", MATH_TASKS)
def test_answers_are_correct_and_within_difficulty(task):
    spec = BUILTIN_TASKS[task]
    rows = builtin_problems(task, 300, seed=1, split="train")
    assert len(rows) == 300
    for row in rows:
        assert _value(row["problem"]) == int(row["answer"]) >= 0
        operands = [int(x) for x in row["problem"].replace("+", " ").replace("-", " ").replace("*", " ").split()]
        assert all(0 <= x <= spec.max_operand for x in operands)
    assert builtin_reward_kind(task) == "math" and builtin_template(task)("23+58") == "23+58="


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


# --------------------------------------------------------------------------------------------------
# Code tasks
# --------------------------------------------------------------------------------------------------


def test_there_is_a_code_task():
    assert CODE_TASKS == ["code_expr"]
    assert builtin_template("code_expr")("max(a,b)*3-7") == "max(a,b)*3-7:"


@pytest.mark.parametrize("task", CODE_TASKS)
def test_code_rows_are_problems_with_right_hidden_tests(task):
    rows = builtin_problems(task, 300, seed=1, split="train")
    assert len({r["problem"] for r in rows}) == 300
    for row in rows:
        problem = CodeProblem.from_json(row["answer"])
        assert problem.kind == "stdin" and len(problem.inputs) >= 3
        assert set(row["problem"]) <= set(CHARACTERS)
        for stdin, stdout in zip(problem.inputs, problem.outputs):
            a, b = map(int, stdin.split())
            assert stdout == f"{code_value(row['problem'], a, b)}\n"
            assert a >= 0 and b >= 0
        assert max(len(x) for stdin in problem.inputs for x in stdin.split()) >= 2, "multi-digit operands"
    # the hidden tests depend on the problem only, not on the seed or split that drew it
    again = {r["problem"]: r["answer"] for r in builtin_problems(task, 1000, seed=2, split="train")}
    assert all(again[r["problem"]] == r["answer"] for r in rows if r["problem"] in again)


@pytest.mark.parametrize(
    ("problem", "a", "b", "value"),
    [
        ("a+b", 12, 7, 19),
        ("(b-a)*3-7", 10, 4, -25),
        ("max(a,b)*3-7", 9, 10, 23),
        ("min(a,b)+5", 9, 10, 14),
        ("a*b-99", 12, 10, 21),
        ("b*4", 1, 25, 100),
        ("a-b", 3, 30, -27),
    ],
)
def test_code_value_by_hand(problem, a, b, value):
    assert code_value(problem, a, b) == value


@pytest.mark.parametrize("task", CODE_TASKS)
def test_code_splits_are_disjoint(task):
    train = {r["problem"] for r in builtin_problems(task, 1500, seed=0, split="train")}
    evals = {r["problem"] for r in builtin_problems(task, 100, seed=7, split="eval")}
    assert len(evals) == 100 and not train & evals
    assert all(is_eval_problem(p) for p in evals) and not any(is_eval_problem(p) for p in train)


def test_code_programs_correct_passes_and_flawed_fails():
    """Through the real scoring path (programs run by the code runner, unsandboxed: they are ours)."""
    rows = builtin_problems("code_expr", 6, seed=3, split="eval")
    box, cfg = Unsandboxed(slot=0), CodeRewardConfig(sandbox="none")
    tokenizer = build_char_tokenizer()
    for row in rows:
        problem = CodeProblem.from_json(row["answer"])
        program = code_solution(row["problem"])
        assert extract_program(program) == f"a,b=map(int,input().split())\nprint({row['problem']})\n"
        assert tokenizer.unk_token_id not in tokenizer(program)["input_ids"]
        score = score_response(box, program, problem, cfg)
        assert (score.reward, score.reason, score.passed) == (1.0, "correct", len(problem.inputs))
        flawed = score_response(box, code_solution(row["problem"], flawed=True), problem, cfg)
        assert flawed.reward == 0.0 and flawed.reason in ("wrong_answer", "runtime_error")


def test_flawed_program_fails_every_problem():
    """By construction each problem has a test the flawed program (input left as text) fails."""
    from megatron_mugrpo.rollout.tasks import _flawed_output

    for row in builtin_problems("code_expr", 1000, seed=0, split="train"):
        problem = CodeProblem.from_json(row["answer"])
        pairs = [tuple(map(int, stdin.split())) for stdin in problem.inputs]
        assert any(_flawed_output(row["problem"], a, b) != out for (a, b), out in zip(pairs, problem.outputs))
