"""The question-answering reward (``reward.kind: qa``): exact match after SQuAD normalisation, F1 beside it.

The response's answer is the content of its LAST ``<answer>…</answer>`` (Search-R1's format). The
reference is the row's list of accepted answers (``data.format: qa`` stores it as a JSON list; a plain
string is one answer). Both sides are normalised as SQuAD's evaluation script does: lower case,
punctuation removed, the articles a / an / the removed, whitespace collapsed. The reward is 1.0 when
the normalised answer equals a normalised reference, else 0.0, with a reason:

    correct        exact match with one of the references
    wrong_answer   an answer that matches none
    no_answer      no complete <answer>…</answer> in the response
    env_error      the environment failed during the trajectory (raised, garbage), scored 0
    env_timeout    the environment ran past env.timeout_s, scored 0
    max_turns      the trajectory used its last turn without answering, scored 0

The last three come from a multi-turn rollout's end reason (``score_episodes``): a trajectory the
environment or a limit cut short never earns a reward, whatever text it holds. Token-level F1 against
the best reference is computed for every answer and carried on the score (``QaScore.f1``), so
``rollout/answer_f1`` is logged beside the exact-match reward.

    reward = QaReward(workers=1, timeout_s=5.0, options=QaOptions())
    reward.score(["<answer>The Eiffel Tower</answer>"], ['["Eiffel Tower"]'])   # [(1.0, 'correct')]
"""

from __future__ import annotations

import json
import re
import string
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from megatron_mugrpo.datafiles import PromptDataError
from megatron_mugrpo.rewards.score import Score

REASONS = ("correct", "wrong_answer", "no_answer", "env_error", "env_timeout", "max_turns")
"""Every reason a qa score can carry."""
ENV_REASONS = ("env_error", "env_timeout", "max_turns")
"""End reasons of a trajectory that score 0 whatever its text (see the module docstring)."""

QA_INSTRUCTION = (
    "Answer the question. To look something up, write <search>query</search>; the results come back between "
    "<information> and </information>. Give the final answer as <answer>...</answer>."
)
"""Search-R1's instruction, shortened: the format of a search trajectory, nothing about how to reason."""

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


@dataclass(kw_only=True)
class QaOptions:
    """``reward.qa.*``: none yet; the answer format (the last <answer> tag) and SQuAD's normalisation are fixed,
    so that scores compare with Search-R1's."""


class QaScore(Score):
    """A qa ``Score`` with the token F1 of the answer against the best reference (0.0 without an answer)."""

    def __new__(cls, reward: float, reason: str, f1: float = 0.0) -> QaScore:
        score = super().__new__(cls, reward, reason)
        score.f1 = f1
        return score

    def __getnewargs__(self) -> tuple[Any, ...]:
        return (self[0], self[1], self.f1)


def normalize_answer(text: str) -> str:
    """SQuAD's normalisation: lower case, no punctuation, no articles, single spaces."""
    text = text.lower().translate(_PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(prediction: str, references: Sequence[str]) -> bool:
    """Whether the normalised prediction equals a normalised reference."""
    predicted = normalize_answer(prediction)
    return any(predicted == normalize_answer(r) for r in references)


def token_f1(prediction: str, references: Sequence[str]) -> float:
    """SQuAD's token F1 of the normalised prediction against the best reference."""
    predicted = normalize_answer(prediction).split()
    best = 0.0
    for reference in references:
        expected = normalize_answer(reference).split()
        common = sum((Counter(predicted) & Counter(expected)).values())
        if common:
            precision, recall = common / len(predicted), common / len(expected)
            best = max(best, 2 * precision * recall / (precision + recall))
    return best


def extract_answer(response: str) -> str | None:
    """The content of the response's last complete ``<answer>…</answer>``, or None."""
    matches = _ANSWER.findall(response)
    return matches[-1] if matches else None


def reference_answers(answer: str) -> list[str]:
    """The accepted answers of a reference: a JSON list of strings (``data.format: qa``) or one plain string."""
    try:
        parsed = json.loads(answer)
    except json.JSONDecodeError:
        return [answer]
    if isinstance(parsed, list) and parsed and all(isinstance(a, str) for a in parsed):
        return parsed
    return [answer]


def score_answer(response: str, answer: str, end_reason: str | None = None) -> QaScore:
    """The score of one response (``end_reason``: how its trajectory ended, None for a single turn)."""
    if end_reason in ENV_REASONS:
        return QaScore(0.0, end_reason)
    predicted = extract_answer(response)
    if predicted is None:
        return QaScore(0.0, "no_answer")
    references = reference_answers(answer)
    f1 = token_f1(predicted, references)
    if exact_match(predicted, references):
        return QaScore(1.0, "correct", f1)
    return QaScore(0.0, "wrong_answer", f1)


class QaReward:
    """``reward.kind: qa``. Scoring is a few string operations per response: it runs in the caller."""

    def __init__(self, *, workers: int, timeout_s: float, options: QaOptions) -> None:
        self.options = options

    def score(self, responses: list[str], answers: list[str]) -> list[QaScore]:
        return [score_answer(r, a) for r, a in zip(responses, answers, strict=True)]

    def score_episodes(
        self, responses: list[str], answers: list[str], end_reasons: Sequence[str | None]
    ) -> list[QaScore]:
        """Score multi-turn trajectories: an environment failure or the turn limit scores 0 with its reason."""
        return [score_answer(r, a, e) for r, a, e in zip(responses, answers, end_reasons, strict=True)]

    def start(self) -> None:
        return None

    def close(self) -> None:
        return None


def qa_prompt(question: str) -> str:
    """A ``data.format: qa`` row's prompt: the instruction, then the question."""
    return f"{QA_INSTRUCTION}\nQuestion: {question.strip()}\n"


def qa_rows(rows: Sequence[dict[str, Any]], origin: str) -> list[dict[str, str]]:
    """``{"question": str, "answers": [str, ...]}`` rows as ``{"problem", "answer"}`` (the answers as a JSON
    list); a row without a question or with no answer string is an error naming the row and the fix."""
    out = []
    for number, row in enumerate(rows, start=1):
        question, answers = row.get("question"), row.get("answers")
        if not isinstance(question, str) or not question.strip():
            raise PromptDataError(f"{origin} row {number}: 'question' must be a non-empty string (data.format: qa)")
        if isinstance(answers, str):  # one answer written without its list
            answers = [answers]
        if not isinstance(answers, list) or not answers or not all(isinstance(a, str) and a.strip() for a in answers):
            raise PromptDataError(
                f"{origin} row {number}: 'answers' must be a non-empty list of non-empty strings (data.format: qa)"
            )
        out.append({"problem": question, "answer": json.dumps(answers)})
    return out
