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
RUNNER_STATUSES = ("ok", "runtime_error", "timeout", "output_limit", "memory_limit", "syntax_error")
"""What ``code_runner`` reports per test."""
LANGUAGE_TAGS = {"python": ("python", "python3", "py")}
"""Fence labels accepted per language; an unlabelled fence is accepted when no labelled one exists."""
SANDBOXES = ("bwrap", "none")
"""reward.code.sandbox: 'bwrap' (the default, see rewards.sandbox) or 'none' (UNSAFE: trusted programs only)."""
RUNNER = Path(__file__).with_name("code_runner.py")
log = logging.getLogger(__name__)
JAIL_OVERHEAD_S = 5.0
"""Wall seconds the jail gets beyond its tests' own: the sandbox's and the runner's start-up."""
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

    def __post_init__(self) -> None:
        if self.kind not in TEST_KINDS:
            raise InputError(f"test kind {self.kind!r} is not one of {TEST_KINDS}")
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
    """Equal line by line after normalising whitespace (trailing blank lines ignored); with a
    tolerance, numeric tokens match within it (absolute or relative)."""
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
    """Returned values (parsed JSON) equal, floats within the tolerance, tuples as lists."""
    if isinstance(expected, bool) or isinstance(actual, bool):
        return type(expected) is type(actual) and expected == actual  # True is not 1
    if isinstance(expected, (int, float)) and isinstance(actual, (int, float)):
        return expected == actual or (tolerance > 0 and _close(float(expected), float(actual), tolerance))
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
    """Run ``program`` on every test of ``problem`` in one sandbox and compare the outputs here."""
    started = time.perf_counter()
    cpu_s = min(problem.time_limit_s or cfg.max_cpu_s, cfg.max_cpu_s)
    test_wall_s = 2 * cpu_s + 1  # a program that sleeps or waits uses no CPU: bound its wall time too
    total = len(problem.inputs)
    spec = {
        "kind": problem.kind,
        "func_name": problem.func_name,
        "tests": list(problem.inputs),
        "cpu_s": cpu_s,
        "wall_s": test_wall_s,
        "output_bytes": cfg.output_bytes,
        "stop_at_first_failure": cfg.stop_at_first_failure,
    }
    limits = Limits(
        cpu_s=total * cpu_s + JAIL_OVERHEAD_S,
        wall_s=total * test_wall_s + JAIL_OVERHEAD_S,
        memory_mib=min(problem.memory_limit_mib or cfg.max_memory_mib, cfg.max_memory_mib),
        processes=cfg.processes,
        output_bytes=16 * cfg.output_bytes + 4096 * total,
        scratch_mib=cfg.scratch_mib,
    )
    files = {"main.py": program.encode(), "runner.py": RUNNER.read_bytes(), "tests.json": json.dumps(spec).encode()}

    def failed(stdout: bytes) -> bool:  # expected outputs never enter the sandbox: stop from here
        results = _runner_results(stdout, total)
        return any(_test_status(problem, i, r, cfg.float_tolerance) != "ok" for i, r in enumerate(results))

    stop = failed if cfg.stop_at_first_failure else None
    run = box.run(files, ["runner.py"], stdin=b"", limits=limits, stop=stop)
    results = _runner_results(run.stdout, total)
    passed, reason = 0, "correct"
    for index, result in enumerate(results):
        status = _test_status(problem, index, result, cfg.float_tolerance)
        if status == "ok":
            passed += 1
        elif reason == "correct":
            reason = status
    if len(results) < total and reason == "correct":
        reason = _jail_reason(run)
    reward = 1.0 if passed == total else (passed / total if cfg.partial else 0.0)
    return CodeScore(reward, reason, passed, total, time.perf_counter() - started)


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


def _runner_results(stdout: bytes, total: int) -> list[dict[str, str]]:
    """The runner's JSON lines, in test order; stops at the first line that is not one (a program that
    wrote into the runner's output spoils only its own score)."""
    results = []
    for line in stdout.decode(errors="replace").split("\n")[:total]:
        try:
            result = json.loads(line)
        except json.JSONDecodeError:
            break
        if not isinstance(result, dict) or result.get("status") not in RUNNER_STATUSES:
            break
        results.append({"status": result["status"], "output": str(result.get("output", ""))})
    return results


def _jail_reason(run: RunResult) -> str:
    """Why the sandbox ended before every test ran (the runner itself stopped)."""
    if run.status == "stopped":
        return "wrong_answer"
    if run.status in ("timeout", "memory_limit", "output_limit", "sandbox_error"):
        return run.status
    return "runtime_error"


def _test_status(problem: CodeProblem, index: int, result: dict[str, str], tolerance: float) -> str:
    """'ok', 'wrong_answer', or the runner's status for test ``index``."""
    if result["status"] != "ok":
        return result["status"]
    return "ok" if _matches(problem.kind, problem.outputs[index], result["output"], tolerance) else "wrong_answer"


def _matches(kind: str, expected: str, actual: str, tolerance: float) -> bool:
    if kind == "stdin":
        return outputs_match(expected, actual, tolerance)
    try:
        return values_match(json.loads(expected), json.loads(actual), tolerance)
    except json.JSONDecodeError:
        return False


def _lines(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def _token_match(a: str, b: str, tolerance: float) -> bool:
    if a == b:
        return True
    if tolerance <= 0:
        return False
    try:
        return _close(float(a), float(b), tolerance)
    except ValueError:
        return False


def _close(a: float, b: float, tolerance: float) -> bool:
    return math.isclose(a, b, rel_tol=tolerance, abs_tol=tolerance)
