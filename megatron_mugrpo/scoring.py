"""``mugrpo score``: score given responses through a run's reward, sandbox included, without training.

A user checks a data set, an answer format or the sandbox before a run this way. The problems are
read as the run would read them (``data.format``, ``data.prompt_field`` / ``data.answer_field``);
each response row names its problem by ``id``: the problem's own id when its format has one
(code_contests ``name``, LiveCodeBench ``question_id``, a math row's ``id`` field), else its row
number in the data file (0-based, blank lines not counted). Every bad row is an error naming its line, found
before anything is run.

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
