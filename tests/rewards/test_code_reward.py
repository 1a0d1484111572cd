"""The code reward: extraction, output comparison, and programs scored through the real sandbox."""

from __future__ import annotations

import base64
import dataclasses
import json

import pytest

from megatron_mugrpo.errors import InputError
from megatron_mugrpo.rewards.code import (
    CodeProblem,
    CodeRewardConfig,
    CodeRewardPool,
    _compare,
    extract_program,
    outputs_match,
    score_program,
    score_response,
    values_match,
)
from megatron_mugrpo.rewards.sandbox import Sandbox, check_available, memory_bound

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


# --------------------------------------------------------------------------------------------------
# Each test alone: its own input, a fresh scratch, nothing left of the test before.
# --------------------------------------------------------------------------------------------------

TWO_SUMS = CodeProblem(inputs=("1 2\n", "5 7\n"), outputs=("3\n", "12\n"))
PATIENT = CodeRewardConfig(max_cpu_s=3.0)
"""7 s of wall clock per test: these tests are about what one test leaves for the next, not about time."""
CHEATERS = {
    # Test 1 answers itself and leaves a daemon that waits for the next test's process, learns that
    # test's input (from a file that holds every input, else the process's own stdin) and writes the
    # answer into the process's stdout; test 2 itself prints nothing.
    "daemon": (
        "import json, os, sys, time\n"
        "a, b = map(int, sys.stdin.read().split())\n"
        "if a == 1:\n"
        "    print(a + b)\n"
        "    sys.stdout.flush()\n"
        "    if os.fork() == 0:\n"
        "        os.setsid()\n"
        "        try:\n"
        "            answer = sum(map(int, json.load(open('/code/tests.json'))['tests'][1].split()))\n"
        "        except Exception:\n"
        "            answer = None\n"
        "        seen, deadline = set(os.listdir('/proc')), time.time() + 20\n"
        "        while time.time() < deadline:\n"
        "            for pid in set(os.listdir('/proc')) - seen:\n"
        "                try:\n"
        "                    value = answer or sum(map(int, open(f'/proc/{pid}/fd/0').read().split()))\n"
        "                    open(f'/proc/{pid}/fd/1', 'w').write(f'{value}\\n')\n"
        "                    seen.add(pid)\n"
        "                except Exception:\n"
        "                    pass\n"
        "        os._exit(0)\n"
        "else:\n"
        "    time.sleep(1.5)\n"
    ),
    # Test 1 leaves a file in /tmp; test 2 answers from it (here, what test 1 computed from a guess).
    "scratch": (
        "import os, sys\n"
        "a, b = map(int, sys.stdin.read().split())\n"
        "if a == 1:\n"
        "    open('/tmp/answers', 'w').write('12')\n"
        "    open(os.path.join(os.environ.get('TMPDIR', '/tmp'), 'answers'), 'w').write('12')\n"
        "    print(a + b)\n"
        "else:\n"
        "    for path in ('/tmp/answers', os.path.join(os.getcwd(), 'answers')):\n"
        "        if os.path.exists(path):\n"
        "            print(open(path).read())\n"
        "            break\n"
    ),
    # Test 1 keeps its answer book in a SysV message queue of the jail; test 2 reads it.
    "ipc": (
        "import ctypes, sys\n"
        "libc = ctypes.CDLL(None)\n"
        "a, b = map(int, sys.stdin.read().split())\n"
        "queue = libc.msgget(4242, 0o1600)\n"
        "buffer = ctypes.create_string_buffer(64)\n"
        "if a == 1:\n"
        "    ctypes.memmove(buffer, (1).to_bytes(8, 'little') + b'12', 10)\n"
        "    libc.msgsnd(queue, buffer, 2, 0)\n"
        "    print(a + b)\n"
        "elif libc.msgrcv(queue, buffer, 8, 0, 0o4000) > 0:\n"
        "    print(buffer.raw[8:10].decode())\n"
    ),
}


@pytest.mark.parametrize("name", sorted(CHEATERS))
def test_nothing_of_one_test_reaches_the_next(box, name):
    score = score_program(box, CHEATERS[name], TWO_SUMS, PATIENT)
    assert (score.passed, score.reason) == (1, "wrong_answer"), (name, score)


def test_each_test_sees_only_its_own_input(box):
    problem = CodeProblem(inputs=("1 2\n", "5 7\n"), outputs=("None\n", "None\n"))
    spy = (
        "import os\n"
        "needle, found = ('5' + ' 7').encode(), []\n"  # test 2's input, not spelled out in this source
        "for folder in ('/code', '/tmp', os.getcwd()):\n"
        "    for name in os.listdir(folder):\n"
        "        path = os.path.join(folder, name)\n"
        "        if os.path.isfile(path) and needle in open(path, 'rb').read():\n"
        "            found.append(path)\n"
        "for pid in os.listdir('/proc'):\n"
        "    if pid.isdigit() and int(pid) != os.getpid():\n"
        "        for what in ('cmdline', 'environ', 'fd/0'):\n"
        "            try:\n"
        "                if needle in open(f'/proc/{pid}/{what}', 'rb').read():\n"
        "                    found.append(pid)\n"
        "            except Exception:\n"
        "                pass\n"
        "print(found[0] if found else None)\n"
    )
    score = score_program(box, spy, problem, PATIENT)
    assert score.passed >= 1  # the first test finds nothing of the second test's input
    assert (score.passed, score.reason) == (2, "correct")  # nor does the second find its own anywhere else


def test_output_is_capped_per_test_not_for_the_whole_run(box):
    """40 tests of 200 KB each (8 MB in all) under a 256 KiB per-test cap: a correct program passes."""
    line = "7" * 200_000
    problem = CodeProblem(inputs=("\n",) * 40, outputs=(line + "\n",) * 40, time_limit_s=1.0)
    cfg = dataclasses.replace(CFG, output_bytes=256 << 10)
    score = score_program(box, f"print('7' * {len(line)})\n", problem, cfg)
    assert (score.reason, score.passed) == ("correct", 40)
    too_much = score_program(box, "print('7' * 300_000)\n", problem, cfg)
    assert too_much.reason == "output_limit"


# --------------------------------------------------------------------------------------------------
# What a program writes is data, never a crash.
# --------------------------------------------------------------------------------------------------

FUNCTIONAL = CodeProblem(
    inputs=([[1, 2, 3]],), outputs=("[1, 2, 3]",), kind="functional", func_name="echo", time_limit_s=1.0
)


def test_a_functional_return_larger_than_a_pipe_is_scored(box):
    problem = CodeProblem(
        inputs=([30000],), outputs=(json.dumps(list(range(30000))),), kind="functional", func_name="f"
    )
    score = score_program(box, "def f(n):\n    return list(range(n))\n", problem, CFG)
    assert score.reason == "correct"


@pytest.mark.parametrize(
    ("forged", "detail"),
    [
        (b"[" * 5000 + b"]" * 5000, "nested too deeply"),
        (b"[" * 900 + b"]" * 900, "differs"),  # parses; the comparison itself must not recurse into a crash
        (b"9" * 5000, "differs"),  # beyond Python's int-from-text limit: compared as exact text
        (b"NaN", "differs"),
        (b"\xff\xfe[1, 2, 3]", "not UTF-8"),
        (b'"' + b"x" * 200_000 + b'"', "differs"),
        (b"[1, 2, 3", "not JSON"),
    ],
)
def test_a_forged_functional_result_is_a_verdict_never_an_exception(box, forged, detail):
    """The program writes the result channel itself and exits: whatever it wrote is compared, never raised."""
    program = f"import os, sys\nos.write(int(sys.argv[-1]), {forged!r})\nos._exit(0)\n"
    score = score_program(box, program, FUNCTIONAL, CFG)
    assert (score.reward, score.reason) == (0.0, "wrong_answer") and detail in score.detail, score


@pytest.mark.parametrize("seed", range(3))
def test_fuzzed_results_never_raise(seed):
    """Hostile results straight into the comparison (no sandbox): every one is a verdict."""
    import random

    rng = random.Random(seed)
    pieces = [b"[", b"]", b"{", b"}", b'"a"', b":", b",", b"1e999", b"-0", b"NaN", b"Infinity", b"\xff", b"9" * 4500]
    problems = [FUNCTIONAL, SUM, dataclasses.replace(SUM, outputs=("3\n", "1e999\n", "nan"))]
    for _ in range(100):
        blob = b"".join(rng.choice(pieces) for _ in range(rng.randrange(1, 40)))
        blob = rng.choice([blob, b"[" * rng.randrange(1, 3000) + blob, blob * rng.randrange(1, 8)])
        for problem in problems:
            status, _ = _compare(problem, 0, blob, rng.choice([0.0, 1e-6]))
            assert status in ("ok", "wrong_answer")
    assert _compare(SUM, 0, b"x" * (10 << 20), 0.0) == ("wrong_answer", "the output differs")


def test_the_runners_report_is_parsed_once_as_it_streams(monkeypatch):
    """Feeding the report byte by byte parses each line once (no re-parse of the whole output per chunk)."""
    from megatron_mugrpo.rewards import code

    lines = b"".join(
        json.dumps({"status": "ok", "output": base64.b64encode(out.encode()).decode()}).encode() + b"\n"
        for out in SUM.outputs
    )
    calls = []
    real = code.json.loads
    monkeypatch.setattr(code.json, "loads", lambda text, **kw: calls.append(1) or real(text, **kw))
    verdicts = code._Verdicts(SUM, 0.0, True)
    stops = [verdicts.feed(lines[i : i + 1]) for i in range(len(lines))]
    assert verdicts.results == [("ok", "")] * 3 and not any(stops)
    assert len(calls) == 3
    broken = code._Verdicts(SUM, 0.0, True)
    assert broken.feed(b'{"status": "ok", "output": "!!"}\n') and "unreadable" in broken.broken


# --------------------------------------------------------------------------------------------------
# Answers compared as the task intends.
# --------------------------------------------------------------------------------------------------


def test_livecodebench_solutions_run_after_its_import_prelude(box):
    functional = CodeProblem(
        inputs=([[3, 1, 2]],), outputs=("[1, 2, 3]",), kind="functional", func_name="sortIt", harness="livecodebench"
    )
    starter_completed = (
        "class Solution:\n    def sortIt(self, nums: List[int]) -> List[int]:\n        return sorted(nums)\n"
    )
    assert score_program(box, starter_completed, functional, CFG).reason == "correct"
    stdin = CodeProblem(inputs=("3\n",), outputs=("[0, 1, 2]\n",), harness="livecodebench")
    uses_names = "q = deque(range(int(input())))\nprint(list(q))\n"
    assert score_program(box, uses_names, stdin, CFG).reason == "correct"
    future = "from __future__ import annotations\nprint(list(deque(range(int(input())))))\n"
    assert score_program(box, future, stdin, CFG).reason == "correct"
    plain = dataclasses.replace(stdin, harness="plain")  # code_contests programs run as written
    assert score_program(box, uses_names, plain, CFG).reason == "runtime_error"
    assert CodeProblem.from_json(functional.to_json()) == functional
    with pytest.raises(InputError, match="harness 'lcb'"):
        dataclasses.replace(stdin, harness="lcb")


@pytest.mark.parametrize(
    ("expected", "actual", "same"),
    [
        ("999999937", "999999938", False),  # integers compare exactly, whatever the tolerance
        ("1" + "0" * 400, "1" + "0" * 399 + "1", False),  # both would be inf as floats
        ("1000", "1_000", False),
        ("1000", "1e3", True),
        ("inf", "1e999", False),
        ("nan", "nan", True),  # equal text
        ("0.3333", "0.33330001", True),
        ("0.3333", "0.334", False),
        ("2.5", "2.5000001", True),
    ],
)
def test_float_tolerance_applies_only_to_finite_non_integer_numbers(expected, actual, same):
    assert outputs_match(expected, actual, tolerance=1e-6) is same


def test_returned_numbers_compare_exactly_unless_a_float_is_involved():
    assert not values_match(999999937, 999999938, tolerance=1e-6)
    assert values_match(0.1 + 0.2, 0.3, tolerance=1e-9) and not values_match(0.1 + 0.2, 0.3)
    assert values_match(2, 2.0) and not values_match(True, 1)
    big = 10**400
    assert not values_match(big, big + 1, tolerance=1e-6) and not values_match(float("inf"), big, tolerance=0.5)
    assert not values_match(float("nan"), float("nan"), tolerance=1e-6)


def test_a_shared_memory_hog_fails_its_own_test_and_the_next_test_runs(box):
    """Test 1 leaves 1.5 GiB in detached SysV segments (no process maps them); the jail's cgroup stops it
    (or seccomp denies shmget), and the segments are gone before test 2, which passes."""
    hog = (
        "import ctypes, sys\n"
        "a, b = map(int, sys.stdin.read().split())\n"
        "if a == 1:\n"
        "    libc = ctypes.CDLL(None)\n"
        "    libc.shmat.restype = ctypes.c_void_p\n"
        "    for _ in range(24):\n"
        "        address = libc.shmat(libc.shmget(0, ctypes.c_size_t(64 << 20), 0o1600), None, 0)\n"
        "        assert address not in (None, 2**64 - 1), 'shmget or shmat failed'\n"
        "        ctypes.memset(address, 1, 64 << 20)\n"
        "        libc.shmdt(ctypes.c_void_p(address))\n"
        "print(a + b)\n"
    )
    # A long time budget: on a loaded machine the kernel's reclaim before the cgroup's OOM kill can take
    # seconds, and the verdict must come from the memory bound, not from a clock.
    cfg = dataclasses.replace(PATIENT, max_cpu_s=30.0, max_memory_mib=256, partial=True, stop_at_first_failure=False)
    score = score_program(box, hog, TWO_SUMS, cfg)
    expected = "runtime_error" if memory_bound().kind == "seccomp" else "memory_limit"
    assert (score.reason, score.passed) == (expected, 1), score
