"""The code reward: extraction, output comparison, and programs scored through the real sandbox."""

from __future__ import annotations

import dataclasses
import json

import pytest

from megatron_mugrpo.errors import InputError
from megatron_mugrpo.rewards.code import (
    CodeProblem,
    CodeRewardConfig,
    CodeRewardPool,
    extract_program,
    outputs_match,
    score_program,
    score_response,
    values_match,
)
from megatron_mugrpo.rewards.sandbox import Sandbox, check_available

SUM = CodeProblem(inputs=("1 2\n", "5 7\n", "10 -3\n"), outputs=("3\n", "12\n", "7"), time_limit_s=1.0)
CFG = CodeRewardConfig(max_cpu_s=1.0)


def fenced(source: str, label: str = "python") -> str:
    return f"Here is my solution.\n```{label}\n{source}```\nDone."


@pytest.fixture(scope="module")
def box() -> Sandbox:
    check_available()
    return Sandbox(slot=9)


def test_extract_takes_the_last_block_of_the_language():
    text = "```python\nprint(1)\n```\ntext\n```\nprint(2)\n```\n```py\nprint(3)\n```\n```cpp\nint main(){}\n```"
    assert extract_program(text) == "print(3)\n"
    assert extract_program("```\nprint(2)\n```") == "print(2)\n"  # unlabelled, when no labelled block exists
    assert extract_program("the answer is print(1)") is None
    assert extract_program("```cpp\nint main(){}\n```") is None


def test_outputs_match_normalises_whitespace_and_tolerates_numbers_on_request():
    assert outputs_match("3\n4\n", "3  \n4\n\n\n")
    assert outputs_match("1 2 3", "1   2\t3")
    assert not outputs_match("1 2", "1\n2")
    assert not outputs_match("3", "3.0")
    assert outputs_match("0.3333", "0.33330001", tolerance=1e-6)
    assert not outputs_match("0.3333", "0.34", tolerance=1e-6)
    assert values_match([1, 2.0, {"a": True}], [1, 2, {"a": True}])
    assert not values_match(True, 1)
    assert values_match(0.1 + 0.2, 0.3, tolerance=1e-9) and not values_match(0.1 + 0.2, 0.3)


@pytest.mark.parametrize(
    ("source", "reward", "reason", "passed"),
    [
        ("a, b = map(int, input().split())\nprint(a + b)\n", 1.0, "correct", 3),
        ("a, b = map(int, input().split())\nprint(a * b)\n", 0.0, "wrong_answer", 0),
        ("a, b = map(int, input().split())\nprint(a + b if a < 5 else 0)\n", 0.0, "wrong_answer", 1),
        ("while True:\n    pass\n", 0.0, "timeout", 0),
        ("raise SystemExit(3)\n", 0.0, "runtime_error", 0),
        ("def f(:\n", 0.0, "syntax_error", 0),
        ("x = bytearray(8 << 30)\n", 0.0, "memory_limit", 0),
        ("print('x' * (8 << 20))\n", 0.0, "output_limit", 0),
    ],
)
def test_programs_get_their_reward_and_reason(box, source, reward, reason, passed):
    score = score_program(box, source, SUM, CFG)
    assert (score.reward, score.reason, score.passed, score.total) == (reward, reason, passed, 3)


def test_no_code_block(box):
    score = score_response(box, "I would add the numbers.", SUM, CFG)
    assert (score.reward, score.reason, score.passed) == (0.0, "no_code", 0)
    assert score_response(box, fenced("print(sum(map(int, input().split())))\n"), SUM, CFG).reward == 1.0


def test_partial_credit_and_stopping_at_the_first_failure(box):
    half = "a, b = map(int, input().split())\nprint(a + b if a < 5 else 0)\n"
    partial = score_program(box, half, SUM, CodeRewardConfig(max_cpu_s=1.0, partial=True))
    assert partial.reward == pytest.approx(1 / 3) and partial.passed == 1
    # the last test passes when run: a full run counts it, the default stop after test 2 does not
    later = CodeProblem(inputs=("1 2\n", "5 7\n", "2 5\n"), outputs=("3\n", "35\n", "7"), time_limit_s=1.0)
    everything = score_program(box, half, later, CodeRewardConfig(max_cpu_s=1.0, stop_at_first_failure=False))
    stopped = score_program(box, half, later, CFG)
    assert (everything.passed, stopped.passed) == (2, 1)


def test_expected_outputs_never_enter_the_sandbox(box):
    """A program that reads the test file and prints it learns no answer (the comparison runs outside)."""
    thief = "import os\nprint(sorted(os.listdir('/code')), open('/code/runner.py').read()[:0])\n"
    score = score_program(box, thief, SUM, CFG)
    assert score.reason == "wrong_answer"  # /code holds the program and the runner: no test, no answer
    forger = 'print(\'{"status": "ok", "output": "3"}\')\n'  # pretends to be the runner's report
    assert score_program(box, forger, SUM, CFG).reason == "wrong_answer"


def test_functional_tests_call_the_entry_point(box):
    problem = CodeProblem(
        inputs=([[1, 2, 3]], [[]]), outputs=("6", "0"), kind="functional", func_name="total", time_limit_s=1.0
    )
    method = "class Solution:\n    def total(self, xs):\n        print('noise')\n        return sum(xs)\n"
    assert score_program(box, method, problem, CFG).reason == "correct"
    function = "def total(xs):\n    return len(xs)\n"
    assert score_program(box, function, problem, CFG).reason == "wrong_answer"
    missing = "def other(xs):\n    return 0\n"
    assert score_program(box, missing, problem, CFG).reason == "runtime_error"
    assert json.loads(problem.outputs[0]) == 6


def test_bad_problems_and_options_are_refused():
    with pytest.raises(InputError, match="one output per input"):
        CodeProblem(inputs=("1",), outputs=())
    with pytest.raises(InputError, match="func_name"):
        CodeProblem(inputs=([1],), outputs=("1",), kind="functional")
    with pytest.raises(InputError, match=r"reward\.code\.language='rust'"):
        CodeRewardConfig(language="rust")


def test_pool_scores_in_order_and_plain_processes_agree():
    responses = [fenced("print(sum(map(int, input().split())))\n"), "no code", fenced("print(0)\n")] * 2
    for sandbox_name in ("bwrap", "none"):
        pool = CodeRewardPool(CodeRewardConfig(max_cpu_s=1.0, sandbox=sandbox_name), workers=2)
        try:
            scores = pool.score(responses, [SUM] * len(responses))
        finally:
            pool.close()
        assert [s.reason for s in scores] == ["correct", "no_code", "wrong_answer"] * 2
    with pytest.raises(InputError, match="sandbox='docker'"):
        CodeRewardConfig(sandbox="docker")


def test_a_program_repeated_for_one_problem_runs_once():
    """A group's identical samples share one run (the copies report 0 seconds); the same program for
    another problem, or a different program, runs on its own and gets its own verdict."""
    add, other = fenced("print(sum(map(int, input().split())))\n"), fenced("print(1)\n")
    product = CodeProblem(inputs=("2 3\n",), outputs=("6\n",))
    responses = [add, add, other, add, add]
    problems = [SUM, SUM, SUM, product, SUM]
    pool = CodeRewardPool(CodeRewardConfig(max_cpu_s=1.0), workers=2)
    try:
        scores = pool.score(responses, problems)
    finally:
        pool.close()
    assert [s.reason for s in scores] == ["correct", "correct", "wrong_answer", "wrong_answer", "correct"]
    assert [s.seconds > 0 for s in scores] == [True, False, True, True, False]
    assert scores[1] == dataclasses.replace(scores[0], seconds=0.0)
