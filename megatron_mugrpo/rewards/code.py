"""The code reward: a model's program run against a problem's tests inside the sandbox.

Per response: take the last fenced code block of the language (``extract_program``; none: reason
``no_code``), run it on the problem's tests inside one sandbox (``rewards/code_runner.py`` runs each
test in a fresh interpreter and sees only the inputs), and compare each output here, outside the
sandbox: stdin/stdout tests line by line with whitespace normalised (``outputs_match``, numbers
within ``float_tolerance`` when set), functional tests on the returned value. Public tests run
first; by default the first failing test stops the program's remaining tests, so a wrong program
costs little.

The reward is 1 when every test passes (the paper's full pass), else 0; with ``partial`` it is the
fraction passed (VIGOR's average test pass rate). ``CodeScore`` carries both, and the reason: the
first failure's (``CODE_REASONS``), or ``correct``.

    problem = CodeProblem(inputs=("1 2\\n",), outputs=("3\\n",))
    score = score_response(Sandbox(slot=0), response_text, problem, CodeRewardConfig())
    score.reward, score.reason, score.passed, score.total
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import json
import logging
import math
import queue
import re
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_mugrpo.errors import InputError
from megatron_mugrpo.rewards.sandbox import Limits, RunResult, Sandbox, Unsandboxed, check_available
from megatron_mugrpo.rewards.score import Score

CODE_REASONS = (
    "correct",
    "no_code",
    "syntax_error",
    "runtime_error",
    "timeout",
    "memory_limit",
    "output_limit",
    "wrong_answer",
    "sandbox_error",
)
TEST_KINDS = ("stdin", "functional")
RUNNER_STATUSES = ("ok", "runtime_error", "timeout", "output_limit", "memory_limit", "syntax_error", "killed")
"""What ``code_runner`` reports per test ('killed': SIGKILL, memory or time: see ``_killed_reason``)."""
HARNESSES = ("plain", "livecodebench")
"""How a problem's program is run: as written ('plain': code_contests, the built-in tasks), or after
LiveCodeBench's import prelude (its starter code uses ``List`` and friends without importing them)."""
LIVECODEBENCH_PRELUDE = (
    "from string import *\nfrom re import *\nfrom datetime import *\nfrom collections import *\n"
    "from heapq import *\nfrom bisect import *\nfrom copy import *\nfrom math import *\nfrom random import *\n"
    "from statistics import *\nfrom itertools import *\nfrom functools import *\nfrom operator import *\n"
    "from io import *\nfrom sys import *\nfrom json import *\nfrom builtins import *\nfrom typing import *\n"
    "import string\nimport re\nimport datetime\nimport collections\nimport heapq\nimport bisect\nimport copy\n"
    "import math\nimport random\nimport statistics\nimport itertools\nimport functools\nimport operator\n"
    "import io\nimport sys\nimport json\nsys.setrecursionlimit(50000)\n"
)
"""LiveCodeBench's ``import_string`` (lcb_runner/evaluation/testing_util.py), which its runner prepends to
every solution, functional and stdin alike. It runs here in the program's namespace before the program
(the same names, and the program's line numbers and ``from __future__`` imports stay its own)."""
PRELUDES = {"plain": "", "livecodebench": LIVECODEBENCH_PRELUDE}
JAIL_LINE_OVERHEAD = 256
"""Bytes of the runner's JSON line around one test's base64 output."""
LANGUAGE_TAGS = {"python": ("python", "python3", "py")}
"""Fence labels accepted per language; an unlabelled fence is accepted when no labelled one exists."""
SANDBOXES = ("bwrap", "none")
"""reward.code.sandbox: 'bwrap' (the default, see rewards.sandbox) or 'none' (UNSAFE: trusted programs only)."""
RUNNER = Path(__file__).with_name("code_runner.py")
log = logging.getLogger(__name__)
JAIL_OVERHEAD_S = 5.0
"""Wall seconds the jail gets beyond its tests' own: the sandbox's and the runner's start-up."""
SWEEP_ALLOWANCE_S = 1.0
"""Wall seconds per test for the runner's clean-up between tests (killing, emptying /tmp)."""
_FENCE = re.compile(r"```([^\n`]*)\n(.*?)```", re.DOTALL)


@dataclass(kw_only=True)
class CodeRewardConfig:
    """``reward.code.*``: how programs are run and scored."""

    language: str = "python"
    """Language of the fenced block taken from a response."""
    partial: bool = False
    """Reward the fraction of tests passed instead of 1 only for a full pass."""
    stop_at_first_failure: bool = True
    """A failing test stops the program's remaining tests (they count as failed)."""
    float_tolerance: float = 0.0
    """Numbers in outputs may differ by this much (absolute or relative); 0 compares tokens exactly."""
    max_cpu_s: float = 4.0
    """CPU seconds per test: the problem's own time limit, capped here."""
    max_memory_mib: int = 512
    """Address space per process: the problem's own memory limit, capped here."""
    output_bytes: int = 1 << 20
    """Output per test (and 16× that for the whole run)."""
    scratch_mib: int = 64
    """Writable scratch (/tmp) per program."""
    processes: int = 32
    """Processes per program (the runner, one interpreter per test, and what the program starts)."""
    sandbox: str = "bwrap"
    """'bwrap': every program in an isolated sandbox. 'none' is UNSAFE: programs run with this
    process's network, files and processes in reach; only for trusted programs (tests)."""

    def __post_init__(self) -> None:
        if self.language not in LANGUAGE_TAGS:
            raise InputError(f"reward.code.language={self.language!r} is not one of {tuple(LANGUAGE_TAGS)}")
        for name in ("max_cpu_s", "max_memory_mib", "output_bytes", "scratch_mib", "processes"):
            if not getattr(self, name) > 0:
                raise InputError(f"reward.code.{name}={getattr(self, name)} must be > 0")
        if self.sandbox not in SANDBOXES:
            raise InputError(f"reward.code.sandbox={self.sandbox!r} is not one of {SANDBOXES}")
        if self.float_tolerance < 0:
            raise InputError(f"reward.code.float_tolerance={self.float_tolerance} must be >= 0")


@dataclass(frozen=True, kw_only=True)
class CodeProblem:
    """One problem's tests, public ones first."""

    inputs: tuple[Any, ...]
    """stdin text per test, or (functional) the JSON-able argument list."""
    outputs: tuple[str, ...]
    """Expected stdout per test, or (functional) the JSON of the expected return value."""
    kind: str = "stdin"
    """'stdin' or 'functional'."""
    func_name: str | None = None
    """Entry point of a functional problem (a method of ``Solution`` or a function)."""
    time_limit_s: float | None = None
    memory_limit_mib: int | None = None
    harness: str = "plain"
    """'plain' or 'livecodebench' (``HARNESSES``): what runs before the program."""

    def __post_init__(self) -> None:
        if self.kind not in TEST_KINDS:
            raise InputError(f"test kind {self.kind!r} is not one of {TEST_KINDS}")
        if self.harness not in HARNESSES:
            raise InputError(f"harness {self.harness!r} is not one of {HARNESSES}")
        if len(self.inputs) != len(self.outputs) or not self.inputs:
            raise InputError(
                f"a problem needs tests with one output per input ({len(self.inputs)} vs {len(self.outputs)})"
            )
        if self.kind == "functional" and not self.func_name:
            raise InputError("a functional problem needs func_name (LiveCodeBench: metadata.func_name)")

    def to_json(self) -> str:
        """The problem as one compact JSON string: how it travels as a prompt's reference answer
        (through the rollout store and between processes) to the code reward."""
        return json.dumps(
            {
                "kind": self.kind,
                "inputs": list(self.inputs),
                "outputs": list(self.outputs),
                "func_name": self.func_name,
                "time_limit_s": self.time_limit_s,
                "memory_limit_mib": self.memory_limit_mib,
                "harness": self.harness,
            },
            separators=(",", ":"),
        )

    @classmethod
    def from_json(cls, text: str) -> CodeProblem:
        """The inverse of ``to_json``; a reference answer that is not one is an ``InputError``."""
        try:
            spec = json.loads(text)
            return cls(
                inputs=tuple(spec["inputs"]),
                outputs=tuple(spec["outputs"]),
                kind=spec.get("kind", "stdin"),
                func_name=spec.get("func_name"),
                time_limit_s=spec.get("time_limit_s"),
                memory_limit_mib=spec.get("memory_limit_mib"),
                harness=spec.get("harness", "plain"),
            )
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise InputError(
                f"a code problem's reference answer is not a problem spec ({exc}): code data must be loaded with "
                "data.format code_contests or livecodebench (or a built-in code task), not as math problems"
            ) from exc


@dataclass(frozen=True)
class CodeScore:
    reward: float
    reason: str
    """'correct' or the first failure's reason (CODE_REASONS)."""
    passed: int
    total: int
    seconds: float
    detail: str = ""
    """Why the first failing test failed, in words (e.g. 'the returned value is nested too deeply'); may be empty."""

    @property
    def pass_fraction(self) -> float:
        return self.passed / self.total if self.total else 0.0


def extract_program(response: str, language: str = "python") -> str | None:
    """The last fenced code block labelled with ``language``; else the last unlabelled one; else None."""
    blocks = [(label.strip().lower(), body) for label, body in _FENCE.findall(response)]
    tags = LANGUAGE_TAGS[language]
    labelled = [body for label, body in blocks if label in tags]
    if labelled:
        return labelled[-1]
    unlabelled = [body for label, body in blocks if not label]
    return unlabelled[-1] if unlabelled else None


def outputs_match(expected: str, actual: str, tolerance: float = 0.0) -> bool:
    """Equal line by line after normalising whitespace (trailing blank lines ignored). With a tolerance,
    a pair of numeric tokens of which one is a non-integer decimal (``0.5``, ``1e-3``) matches within it
    (absolute or relative) when both are finite; integer tokens always compare exactly, and only
    plain decimals are numbers (``1_000``, ``inf``, ``nan`` are compared as text)."""
    want, got = _lines(expected), _lines(actual)
    if len(want) != len(got):
        return False
    for a_line, b_line in zip(want, got):
        a_tokens, b_tokens = a_line.split(), b_line.split()
        if len(a_tokens) != len(b_tokens):
            return False
        if any(not _token_match(a, b, tolerance) for a, b in zip(a_tokens, b_tokens)):
            return False
    return True


def values_match(expected: Any, actual: Any, tolerance: float = 0.0) -> bool:
    """Returned values (parsed JSON) equal, tuples as lists. Integers compare exactly (any size); the
    tolerance applies only when one side is a float and both are finite; True is not 1."""
    if isinstance(expected, _BigInt) or isinstance(actual, _BigInt):
        return type(expected) is type(actual) and str.__eq__(expected, actual)
    if isinstance(expected, bool) or isinstance(actual, bool):
        return type(expected) is type(actual) and expected == actual
    if isinstance(expected, (int, float)) and isinstance(actual, (int, float)):
        if expected == actual:
            return True
        if tolerance <= 0 or not (isinstance(expected, float) or isinstance(actual, float)):
            return False
        return _close(expected, actual, tolerance)
    if isinstance(expected, list) and isinstance(actual, list):
        return len(expected) == len(actual) and all(values_match(a, b, tolerance) for a, b in zip(expected, actual))
    if isinstance(expected, dict) and isinstance(actual, dict):
        return expected.keys() == actual.keys() and all(
            values_match(expected[k], actual[k], tolerance) for k in expected
        )
    return expected == actual


def score_response(box: Sandbox, response: str, problem: CodeProblem, cfg: CodeRewardConfig) -> CodeScore:
    """Extract the program from ``response`` and score it (``score_program``)."""
    program = extract_program(response, cfg.language)
    if program is None:
        return CodeScore(0.0, "no_code", 0, len(problem.inputs), 0.0)
    return score_program(box, program, problem, cfg)


def score_program(box: Sandbox, program: str, problem: CodeProblem, cfg: CodeRewardConfig) -> CodeScore:
    """Run ``program`` on every test of ``problem`` in one sandbox and compare the outputs here, each
    test's as soon as its line arrives. Whatever the program writes is data: never an exception."""
    started = time.perf_counter()
    cpu_s = min(problem.time_limit_s or cfg.max_cpu_s, cfg.max_cpu_s)
    test_wall_s = 2 * cpu_s + 1  # a program that sleeps or waits uses no CPU: bound its wall time too
    total = len(problem.inputs)
    spec = {
        "kind": problem.kind,
        "func_name": problem.func_name,
        "tests": list(problem.inputs),  # on the runner's stdin: no file in the jail holds every input
        "prelude": PRELUDES[problem.harness],
        "cpu_s": cpu_s,
        "wall_s": test_wall_s,
        "output_bytes": cfg.output_bytes,
        "processes": cfg.processes,
        "stop_at_first_failure": cfg.stop_at_first_failure,
        "sweep": box.sweep,
    }
    # Output is capped per test (the runner); the jail's cap only has to hold every test's line:
    # base64 (4 bytes per 3) of at most output_bytes, plus the line's own JSON.
    line_bytes = 4 * (cfg.output_bytes // 3 + 1) + JAIL_LINE_OVERHEAD
    limits = Limits(
        cpu_s=total * cpu_s + JAIL_OVERHEAD_S,
        wall_s=total * (test_wall_s + SWEEP_ALLOWANCE_S) + JAIL_OVERHEAD_S,
        memory_mib=min(problem.memory_limit_mib or cfg.max_memory_mib, cfg.max_memory_mib),
        processes=cfg.processes,
        output_bytes=total * line_bytes + 65536,
        scratch_mib=cfg.scratch_mib,
    )
    verdicts = _Verdicts(problem, cfg.float_tolerance, cfg.stop_at_first_failure)
    files = {"main.py": program.encode(), "runner.py": RUNNER.read_bytes()}
    run = box.run(files, ["runner.py"], stdin=json.dumps(spec).encode(), limits=limits, consume=verdicts.feed)
    passed, reason, detail = 0, "correct", ""
    for status, why in verdicts.results:
        if status == "ok":
            passed += 1
        elif reason == "correct":
            reason, detail = (_killed_reason(run) if status == "killed" else status), why
    if len(verdicts.results) < total and reason == "correct":
        reason, detail = _jail_reason(run), verdicts.broken or run.status
    reward = 1.0 if passed == total else (passed / total if cfg.partial else 0.0)
    return CodeScore(reward, reason, passed, total, time.perf_counter() - started, detail)


class _Verdicts:
    """The runner's report, read as it streams: each complete line is one test's result, compared at
    once (so the run stops at the first failure, and no line is parsed twice). A line that is not the
    runner's ends the reading (a program that spoils the report spoils only its own score)."""

    def __init__(self, problem: CodeProblem, tolerance: float, stop_at_first_failure: bool) -> None:
        self.problem, self.tolerance, self.stop = problem, tolerance, stop_at_first_failure
        self.results: list[tuple[str, str]] = []
        """(status, detail) per test, in order: 'ok', 'wrong_answer' or the runner's status."""
        self.broken = ""
        self._buffer = bytearray()

    def feed(self, chunk: bytes) -> bool:
        """Take a chunk of the runner's stdout; True when the run may stop (a failure, or a broken report)."""
        self._buffer += chunk
        start = 0
        while not self.broken and len(self.results) < len(self.problem.inputs):
            end = self._buffer.find(b"\n", start)
            if end < 0:
                break
            self._take(bytes(self._buffer[start:end]))
            start = end + 1
        del self._buffer[:start]
        failed = any(status != "ok" for status, _ in self.results)
        return bool(self.broken) or (self.stop and failed)

    def _take(self, line: bytes) -> None:
        try:
            report = json.loads(line)
            status, output = report["status"], base64.b64decode(report["output"], validate=True)
        except (ValueError, TypeError, KeyError, RecursionError, binascii.Error) as exc:
            self.broken = f"the runner's report is unreadable ({type(exc).__name__})"
            return
        if status not in RUNNER_STATUSES:
            self.broken = f"the runner's report has an unknown status {str(status)[:40]!r}"
            return
        index = len(self.results)
        if status != "ok":
            self.results.append((status, ""))
            return
        self.results.append(_compare(self.problem, index, output, self.tolerance))


def _compare(problem: CodeProblem, index: int, output: bytes, tolerance: float) -> tuple[str, str]:
    """('ok' | 'wrong_answer', why) for one test's output; never raises, whatever the bytes."""
    try:
        text = output.decode("utf-8")
    except UnicodeDecodeError:
        return "wrong_answer", "the output is not UTF-8"
    try:
        if problem.kind == "stdin":
            same = outputs_match(problem.outputs[index], text, tolerance)
            return ("ok", "") if same else ("wrong_answer", "the output differs")
        expected, why = _load_json(problem.outputs[index])
        if why:
            return "wrong_answer", f"the expected value is unreadable: {why}"
        actual, why = _load_json(text)
        if why:
            return "wrong_answer", f"the returned value is unreadable: {why}"
        same = values_match(expected, actual, tolerance)
        return ("ok", "") if same else ("wrong_answer", "the returned value differs")
    except RecursionError:
        return "wrong_answer", "the returned value is nested too deeply to compare"
    except (ValueError, TypeError, OverflowError, MemoryError) as exc:
        return "wrong_answer", f"the output cannot be compared ({type(exc).__name__})"


class _BigInt(str):
    """A JSON integer too long for ``int()`` (Python's 4,300-digit limit): compared by its exact text."""


BIG_INT_DIGITS = 4000


def _exact_int(text: str) -> int | _BigInt:
    return int(text) if len(text) <= BIG_INT_DIGITS else _BigInt(text)


def _load_json(text: str) -> tuple[Any, str]:
    """(value, '') or (None, why it cannot be read)."""
    try:
        return json.loads(text, parse_int=_exact_int), ""
    except RecursionError:
        return None, "nested too deeply"
    except (ValueError, TypeError) as exc:
        return None, f"not JSON ({str(exc)[:80]})"


class CodeRewardPool:
    """A bounded pool of sandbox slots that scores a stage's programs, ``workers`` at a time.

    Each slot is a thread with a ``Sandbox`` of its own (its own host uid, so its own process budget);
    the programs themselves run in the sandboxes' processes, so one slow program holds one slot and
    never the stage. Starting the pool checks the sandbox once and fails closed.
    """

    def __init__(self, cfg: CodeRewardConfig, *, workers: int) -> None:
        if workers < 1:
            raise InputError(f"the code reward needs workers >= 1, got {workers}")
        if cfg.sandbox == "none":
            log.warning(
                "reward.code.sandbox=none: model-written programs run WITHOUT isolation (network, files and "
                "processes of this machine are in their reach). Use it for trusted programs only"
            )
            slots = [Unsandboxed(slot=i) for i in range(workers)]
        else:
            check_available()
            slots = [Sandbox(slot=i) for i in range(workers)]
        self.cfg = cfg
        self._slots: queue.Queue[Sandbox] = queue.Queue()
        for slot in slots:
            self._slots.put(slot)
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="code-reward")

    def score(self, responses: Sequence[str], problems: Sequence[CodeProblem]) -> list[CodeScore]:
        """Scores in input order. A program that occurs more than once for the same problem in one call
        (a group's samples often agree) runs once; its copies get the same verdict with 0 seconds. "The
        same problem" is the same object: ``CodeReward.score`` parses each distinct answer once."""
        if len(responses) != len(problems):
            raise ValueError(f"{len(responses)} responses for {len(problems)} problems")
        programs = [extract_program(response, self.cfg.language) for response in responses]
        first: dict[tuple[str, int], int] = {}
        to_run: list[int] = []
        for index, (program, problem) in enumerate(zip(programs, problems)):
            if program is not None and first.setdefault((program, id(problem)), index) == index:
                to_run.append(index)
        run = self._executor.map(self._score_one, [programs[i] for i in to_run], [problems[i] for i in to_run])
        scored = dict(zip(to_run, run))
        scores = []
        for index, (program, problem) in enumerate(zip(programs, problems)):
            if program is None:
                scores.append(CodeScore(0.0, "no_code", 0, len(problem.inputs), 0.0))
            elif index in scored:
                scores.append(scored[index])
            else:
                scores.append(dataclasses.replace(scored[first[(program, id(problem))]], seconds=0.0))
        return scores

    def _score_one(self, program: str, problem: CodeProblem) -> CodeScore:
        box = self._slots.get()
        try:
            return score_program(box, program, problem, self.cfg)
        finally:
            self._slots.put(box)

    def close(self) -> None:
        self._executor.shutdown(wait=True)
        while not self._slots.empty():
            self._slots.get().close()  # give the slots' host uids back


class CodeReward:
    """The code reward as the reward registry builds it (``reward.kind: code``): each reference answer
    is a problem's tests as ``CodeProblem.to_json()``; each score is a ``Score`` with the tests passed
    and run and the seconds spent. Building it checks the sandbox (fails closed)."""

    def __init__(self, *, workers: int, timeout_s: float, options: CodeRewardConfig | None = None) -> None:
        del timeout_s  # programs are bounded by reward.code's limits and the problems' own
        self.pool = CodeRewardPool(options or CodeRewardConfig(), workers=workers)

    def score(self, responses: list[str], answers: list[str]) -> list[tuple[float, str]]:
        if len(responses) != len(answers):
            raise InputError(f"score() got {len(responses)} responses but {len(answers)} problems")
        problems: dict[str, CodeProblem] = {}  # a group's G responses share one problem: parse it once
        for answer in answers:
            if answer not in problems:
                problems[answer] = CodeProblem.from_json(answer)
        scores = self.pool.score(responses, [problems[a] for a in answers])
        return [Score(s.reward, s.reason, s.passed, s.total, s.seconds) for s in scores]

    def start(self) -> None:
        """Nothing to warm up: a sandbox starts per program."""

    def close(self) -> None:
        self.pool.close()


def _jail_reason(run: RunResult) -> str:
    """Why the sandbox ended before every test ran (the runner itself stopped, or its report broke)."""
    if run.status == "stopped":
        return "wrong_answer"
    if run.oom_kills:
        return "memory_limit"
    if run.status in ("timeout", "memory_limit", "output_limit", "sandbox_error"):
        return run.status
    return "runtime_error"


def _killed_reason(run: RunResult) -> str:
    """A test killed by SIGKILL: the jail's memory cgroup killed something (memory), else the CPU's hard limit."""
    return "memory_limit" if run.oom_kills else "timeout"


def _lines(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


_INTEGER = re.compile(r"[+-]?[0-9]+")
# Unambiguous (no two ways to split a digit run): a hostile 5,000-digit token fails in linear time.
_DECIMAL = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")


def _token_match(a: str, b: str, tolerance: float) -> bool:
    if a == b:
        return True
    if tolerance <= 0 or (_INTEGER.fullmatch(a) and _INTEGER.fullmatch(b)):
        return False
    if not (_DECIMAL.fullmatch(a) and _DECIMAL.fullmatch(b)):
        return False
    return _close(float(a), float(b), tolerance)


def _close(a: float, b: float, tolerance: float) -> bool:
    """Within the tolerance (absolute or relative), both finite: two numbers too large for a float
    (both inf) are not 'close'."""
    try:
        a, b = float(a), float(b)
    except OverflowError:
        return False
    return math.isfinite(a) and math.isfinite(b) and math.isclose(a, b, rel_tol=tolerance, abs_tol=tolerance)
