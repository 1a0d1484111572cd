"""Coding problems from local files: code_contests and LiveCodeBench rows into ``CodeProblem``s.

Both read from local JSONL or Parquet (``datafiles.read_rows``: a malformed JSONL line is an
error naming its number), and a row that cannot become a problem is an error naming the file, the
row and the field.

* **code_contests** (DeepMind): ``description``; ``public_tests`` / ``private_tests`` /
  ``generated_tests`` as ``{"input": [...], "output": [...]}``; ``time_limit`` (seconds, or
  ``{"seconds", "nanos"}``); ``memory_limit_bytes``. All tests are stdin/stdout, public ones first.
* **LiveCodeBench**: ``question_content``, ``starter_code``; ``public_test_cases`` /
  ``private_test_cases`` as JSON lists of ``{"input", "output", "testtype": "stdin" | "functional"}``
  (the release compresses the private ones: base64 of zlib of a pickled JSON string, read here with
  an unpickler that accepts a plain string and nothing else); ``metadata`` (JSON) with ``func_name``.
  A functional test's input holds one JSON value per line, the entry point's arguments. Its programs
  run after LiveCodeBench's import prelude (``harness="livecodebench"``), as its own runner does.

    problems = load_code_problems("data/code_contests_train.jsonl", "code_contests")
    problems[0].prompt, problems[0].problem.inputs[0]
"""

from __future__ import annotations

import base64
import io
import json
import pickle
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_mugrpo.datafiles import read_rows
from megatron_mugrpo.errors import InputError
from megatron_mugrpo.rewards.code import CodeProblem

FORMATS = ("code_contests", "livecodebench")
CODE_INSTRUCTION = (
    "Solve the problem in Python 3. Read the input from standard input and write the answer to standard "
    "output. Reply with one complete program in a single ```python code block."
)
FUNCTIONAL_INSTRUCTION = (
    "Solve the problem in Python 3 by completing the starter code below. Reply with the complete code in a "
    "single ```python code block."
)


class CodeDataError(InputError, ValueError):
    """A coding problem file or row cannot be used; the message names the file, row and field."""


@dataclass(frozen=True)
class CodeRecord:
    """One coding problem: its id, the prompt text shown to the model, and its tests."""

    problem_id: str
    """The row's own id (code_contests ``name``, LiveCodeBench ``question_id``), else its row index."""
    prompt: str
    problem: CodeProblem


def load_code_problems(path: str | Path, fmt: str) -> list[CodeRecord]:
    """Every problem of a local code_contests or LiveCodeBench file."""
    return code_records(read_rows(path), fmt, str(path))


def code_records(rows: Sequence[dict[str, Any]], fmt: str, origin: str) -> list[CodeRecord]:
    """Rows of a ``fmt`` file (``origin`` names it in errors) as coding problems."""
    if fmt not in FORMATS:
        raise CodeDataError(f"code data format {fmt!r} is not one of {FORMATS}")
    parse = code_contests_record if fmt == "code_contests" else livecodebench_record
    records = [parse(row, where=f"{origin} row {number}") for number, row in enumerate(rows, start=1)]
    # A problem without an id of its own is named by its row (0-based, as prompt ids are).
    records = [r if r.problem_id else CodeRecord(str(i), r.prompt, r.problem) for i, r in enumerate(records)]
    if not records:
        raise CodeDataError(f"{origin} holds no problem")
    return records


def code_contests_record(row: dict[str, Any], *, where: str) -> CodeRecord:
    """A code_contests row: stdin/stdout tests, public first, then private and generated."""
    description = _field(row, "description", str, where)
    inputs: list[str] = []
    outputs: list[str] = []
    for name in ("public_tests", "private_tests", "generated_tests"):
        tests = row.get(name) or {"input": [], "output": []}
        if not isinstance(tests, dict) or len(tests.get("input", [])) != len(tests.get("output", [])):
            raise CodeDataError(f"{where}: {name} must be {{'input': [...], 'output': [...]}} of equal lengths")
        inputs += [str(x) for x in tests["input"]]
        outputs += [str(x) for x in tests["output"]]
    if not inputs:
        raise CodeDataError(f"{where}: no test in public_tests, private_tests or generated_tests")
    problem = CodeProblem(
        inputs=tuple(inputs),
        outputs=tuple(outputs),
        time_limit_s=_seconds(row.get("time_limit"), where),
        memory_limit_mib=int(row["memory_limit_bytes"]) >> 20 if row.get("memory_limit_bytes") else None,
    )
    name = str(row.get("name") or row.get("problem_id") or "")
    return CodeRecord(name, f"{description.strip()}\n\n{CODE_INSTRUCTION}", problem)


def livecodebench_record(row: dict[str, Any], *, where: str) -> CodeRecord:
    """A LiveCodeBench row: stdin or functional tests (one kind per problem), public first."""
    question = _field(row, "question_content", str, where)
    starter = str(row.get("starter_code") or "")
    cases = _cases(row.get("public_test_cases"), where, "public_test_cases")
    cases += _cases(row.get("private_test_cases"), where, "private_test_cases")
    if not cases:
        raise CodeDataError(f"{where}: no test in public_test_cases or private_test_cases")
    kinds = {case.get("testtype", "stdin") for case in cases}
    if len(kinds) != 1 or not kinds <= {"stdin", "functional"}:
        raise CodeDataError(f"{where}: test cases must all be 'stdin' or all 'functional', got {sorted(kinds)}")
    kind = kinds.pop()
    metadata = row.get("metadata") or {}
    if isinstance(metadata, str):
        metadata = json.loads(metadata or "{}")
    func_name = metadata.get("func_name") if kind == "functional" else None
    if kind == "functional" and not func_name:
        raise CodeDataError(f"{where}: functional tests need metadata.func_name")
    inputs = tuple(_functional_args(c["input"], where) if kind == "functional" else c["input"] for c in cases)
    outputs = tuple(str(c["output"]) for c in cases)
    # LiveCodeBench's harness runs every solution after its import prelude; its starter code relies on it.
    problem = CodeProblem(inputs=inputs, outputs=outputs, kind=kind, func_name=func_name, harness="livecodebench")
    instruction = FUNCTIONAL_INSTRUCTION if starter else CODE_INSTRUCTION
    prompt = f"{question.strip()}\n\n{instruction}"
    if starter:
        prompt += f"\n\n```python\n{starter.rstrip()}\n```"
    return CodeRecord(str(row.get("question_id") or ""), prompt, problem)


def _field(row: dict[str, Any], name: str, kind: type, where: str) -> Any:
    value = row.get(name)
    if not isinstance(value, kind) or not value:
        raise CodeDataError(f"{where}: field {name!r} is missing or not a non-empty {kind.__name__}")
    return value


def _seconds(value: Any, where: str) -> float | None:
    if value in (None, "", 0):
        return None
    if isinstance(value, dict):
        return float(value.get("seconds", 0)) + float(value.get("nanos", 0)) / 1e9 or None
    try:
        return float(value)
    except (TypeError, ValueError):
        raise CodeDataError(f"{where}: time_limit {value!r} is not a number of seconds") from None


def _cases(value: Any, where: str, name: str) -> list[dict[str, Any]]:
    if value in (None, "", []):
        return []
    if isinstance(value, str):
        value = _decode_cases(value, where, name)
    if not isinstance(value, list) or not all(isinstance(c, dict) and "input" in c and "output" in c for c in value):
        raise CodeDataError(f"{where}: {name} must be a list of {{'input', 'output', 'testtype'}} objects")
    return value


def _decode_cases(text: str, where: str, name: str) -> Any:
    """JSON text, or LiveCodeBench's compressed form: base64(zlib(pickle(json string)))."""
    if text.lstrip().startswith("["):
        return json.loads(text)
    try:
        raw = zlib.decompress(base64.b64decode(text))
        return json.loads(_StringOnly(io.BytesIO(raw)).load())
    except Exception as exc:  # any decoding failure of untrusted data is the row's error
        raise CodeDataError(f"{where}: {name} is neither JSON nor LiveCodeBench's compressed form ({exc})") from exc


class _StringOnly(pickle.Unpickler):
    """Unpickles a plain string and nothing else: a pickle that names any class or function is refused."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refusing {module}.{name}: only a pickled string is accepted")


def _functional_args(text: str, where: str) -> list[Any]:
    try:
        return [json.loads(line) for line in str(text).split("\n") if line.strip()]
    except json.JSONDecodeError as exc:
        raise CodeDataError(f"{where}: a functional test's input must be one JSON value per line ({exc})") from exc
