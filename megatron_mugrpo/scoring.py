"""``mugrpo score``: score given responses through a run's reward, sandbox included, without training.

A user checks a data set, an answer format or the sandbox before a run this way. The problems are
read as the run would read them (``data.format``, ``data.prompt_field`` / ``data.answer_field``);
each response row names its problem by ``id``: the problem's own id when its format has one
(code_contests ``name``, LiveCodeBench ``question_id``, a math row's ``id`` field), else its row
number in the data file (0-based, blank lines not counted). Every bad row is an error naming its line, found
before anything is run.

The rows' fields say their format (``detect_format``): a code_contests or LiveCodeBench file scored with
a config that names no such format (the code demo's, whose data are its built-in task) is read as the
format its rows have, and the command says so on stderr; ``data.format=...`` on the command line
overrides the detection.

    mugrpo score --config configs/demo_cpu.yaml --data problems.jsonl --responses responses.jsonl
    {"id": "0", "reward": 1.0, "reason": "correct", "tests_passed": null, "tests_total": null, "seconds": 0.001}
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_mugrpo.datafiles import PromptDataError, read_rows
from megatron_mugrpo.rewards.code_data import code_records
from megatron_mugrpo.rewards.registry import RewardFn


@dataclass(frozen=True)
class Scored:
    """One output line of ``mugrpo score``."""

    id: str
    reward: float
    reason: str
    tests_passed: int | None
    tests_total: int | None
    seconds: float

    def to_json(self) -> str:
        return json.dumps(self.__dict__)


FORMAT_FIELDS: dict[str, tuple[str, tuple[str, ...]]] = {
    "code_contests": ("description", ("public_tests", "private_tests", "generated_tests")),
    "livecodebench": ("question_content", ("public_test_cases", "private_test_cases")),
}
"""Code formats by their fields: the problem text, and at least one of the test fields (``rewards.code_data``)."""


def row_formats(row: Mapping[str, Any], *, prompt_field: str, answer_field: str) -> list[str]:
    """The data formats (``data.format``) whose fields ``row`` has, in ``FORMAT_FIELDS`` order, 'problems' last."""
    fits = [fmt for fmt, (text, tests) in FORMAT_FIELDS.items() if text in row and any(t in row for t in tests)]
    if prompt_field in row and answer_field in row:
        fits.append("problems")
    return fits


def detect_format(path: str | Path, configured: str, *, prompt_field: str, answer_field: str) -> tuple[str, str]:
    """(the format to read ``path`` with, a note saying why when it is not ``configured``).

    ``configured`` stands when the first row fits it, or fits no format at all (the config's own error
    then names the file). Otherwise the one format the row fits is used: a code_contests file scored
    with the code demo's config (whose data.format is the default 'problems') is read as code_contests.
    """
    rows = read_rows(path)
    fits = row_formats(rows[0], prompt_field=prompt_field, answer_field=answer_field) if rows else []
    if configured in fits or len(fits) != 1:
        return configured, ""
    return fits[0], (
        f"{path} scored as data.format={fits[0]} (its rows have that format's fields; the config says "
        f"data.format={configured}). Pass data.format=... to read it otherwise"
    )


def reference_answers(path: str | Path, data_format: str, answer_field: str) -> dict[str, str]:
    """Problem id → the reference answer the reward reads (math: the answer text; code: the tests)."""
    rows = read_rows(path)
    if data_format == "problems":
        answers = {}
        for index, row in enumerate(rows):
            if row.get(answer_field) is None:
                raise PromptDataError(f"{path} row {index}: no {answer_field!r} field (data.answer_field)")
            answers[str(row.get("id", index))] = str(row[answer_field]).strip()
        return answers
    return {record.problem_id: record.problem.to_json() for record in code_records(rows, data_format, str(path))}


def read_responses(path: str | Path, answers: Mapping[str, str]) -> list[tuple[str, str]]:
    """(problem id, response) per row of a responses file; rows are ``{"id": ..., "response": "..."}``."""
    out = []
    for number, row in enumerate(read_rows(path), start=1):
        where = f"{path}:{number}" if Path(path).suffix == ".jsonl" else f"{path} row {number}"
        if "id" not in row or not isinstance(row.get("response"), str):
            raise PromptDataError(
                f'{where}: expected {{"id": <problem id or row number>, "response": "<text>"}}, got keys {sorted(row)}'
            )
        problem_id = str(row["id"])
        if problem_id not in answers:
            known = ", ".join(list(answers)[:5])
            raise PromptDataError(
                f"{where}: no problem with id {problem_id!r} in the data file (ids look like: {known}, ...)"
            )
        out.append((problem_id, row["response"]))
    return out


def score_responses(
    reward: RewardFn, answers: Mapping[str, str], responses: Sequence[tuple[str, str]]
) -> Iterator[Scored]:
    """Every response scored by ``reward`` against its problem's reference answer, in file order."""
    started = time.perf_counter()
    scores = reward.score([text for _, text in responses], [answers[pid] for pid, _ in responses])
    mean_s = (time.perf_counter() - started) / max(len(responses), 1)
    for (problem_id, _), score in zip(responses, scores, strict=True):
        seconds: Any = getattr(score, "seconds", None)
        yield Scored(
            id=problem_id,
            reward=float(score[0]),
            reason=score[1],
            tests_passed=getattr(score, "passed", None),
            tests_total=getattr(score, "total", None),
            seconds=round(seconds if seconds is not None else mean_s, 6),
        )
