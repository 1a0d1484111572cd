"""Prompt data: local JSONL / Parquet problem files (or the built-in task) → tokenized prompts.

Real datasets (DeepScaleR: fields ``problem`` / ``answer``) get the paper's instruction appended
and, when the tokenizer has one and ``data.use_chat_template`` is set, the chat template with a
generation prompt. The built-in task uses its own short template (``23+58=``).

Rows with a missing field, empty text or a prompt longer than ``max_prompt_tokens`` are skipped
and counted; one warning reports the counts. A file with no usable row is an error that names the
file and the fields. Nothing is shuffled here: prompt order is the stage sampler's business.

    prompts = load_prompts(cfg.data, tokenizer, cfg.rollout.max_prompt_tokens)
    evals = load_benchmark(cfg.eval.benchmarks[0], tokenizer, cfg.rollout.max_prompt_tokens)
"""

from __future__ import annotations

import logging
import random
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from megatron_mugrpo.datafiles import PromptDataError, read_rows
from megatron_mugrpo.errors import require
from megatron_mugrpo.rewards.code_data import FORMATS as CODE_FORMATS
from megatron_mugrpo.rewards.code_data import code_records
from megatron_mugrpo.rewards.qa import qa_prompt, qa_rows
from megatron_mugrpo.rollout.tasks import builtin_problems, builtin_reward_kind, builtin_template

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."
"""The paper's instruction, appended to every problem of a real dataset."""

DEFAULT_BUILTIN_EVAL_SIZE = 256
"""Problems in the built-in task's eval split when a 'builtin' benchmark sets no limit."""

REJECT_REASONS = ("missing_prompt", "missing_answer", "empty_prompt", "empty_answer", "too_long")
DATA_FORMATS = ("problems", *CODE_FORMATS, "qa")
"""How a data file's rows are read: 'problems' (a problem and a reference answer per row, read through
``prompt_field`` / ``answer_field``: math), 'code_contests' or 'livecodebench' (coding problems with
their tests, ``rewards/code_data.py``), 'qa' (``{"question", "answers": [...]}``, ``rewards/qa.py``)."""


def format_reward_kind(data_format: str) -> str:
    """The reward kind that can score a data format's reference answers."""
    return {"problems": "math", "qa": "qa"}.get(data_format, "code")


@dataclass(kw_only=True)
class DataConfig:
    """``data.*``: training prompts, a local JSONL/Parquet file or the built-in procedural math task."""

    train_path: str = ""
    """Local JSONL or Parquet file of problems; empty uses the built-in task."""
    format: str = "problems"
    """How the file's rows are read: 'problems' (prompt_field / answer_field), 'code_contests',
    'livecodebench' or 'qa'. The reward (reward.kind) must be able to score them: math, code or qa."""
    prompt_field: str = "problem"
    """Column holding the problem text (DeepScaleR: 'problem')."""
    answer_field: str = "answer"
    """Column holding the reference answer."""
    use_chat_template: bool = True
    """Wrap prompts with the tokenizer's chat template when it has one."""
    builtin_task: str = "arithmetic"
    """Built-in procedural task used when train_path is empty."""
    builtin_size: int = 4096
    """Problems generated for the built-in task."""
    seed: int = 0
    """Seed of the prompt order and of the built-in task generator."""

    def __post_init__(self) -> None:
        if self.train_path:
            path = Path(self.train_path)
            require(
                path.is_file(), f"data.train_path={self.train_path!r} does not exist; give a local JSONL/Parquet file"
            )
            require(
                path.suffix in (".jsonl", ".json", ".parquet"),
                f"data.train_path={self.train_path!r}: expected a .jsonl, .json or .parquet file",
            )
        require(self.builtin_size >= 1, f"data.builtin_size={self.builtin_size} must be >= 1")
        require(self.format in DATA_FORMATS, f"data.format={self.format!r} is not one of {DATA_FORMATS}")

    @property
    def reward_kind(self) -> str:
        """The reward kind this data needs: the built-in task's, or the file format's."""
        return format_reward_kind(self.format) if self.train_path else builtin_reward_kind(self.builtin_task)


class BenchmarkFile(Protocol):
    """What loading reads of one ``eval.benchmarks`` entry (``evaluation.BenchmarkConfig``)."""

    name: str
    path: str
    """Local file, or 'builtin' for the built-in task's eval split."""
    format: str
    """How the file's rows are read (``DATA_FORMATS``)."""
    prompt_field: str
    answer_field: str
    limit: int
    """Keep the first N usable problems (0: all)."""


@dataclass(frozen=True)
class PromptRecord:
    """One tokenized prompt."""

    prompt_id: str
    """Stable id: '<source>-<row index>' (the row index in the file, rejected rows included)."""
    prompt_ids: list[int]
    """Token ids of ``text`` (special tokens / chat template included)."""
    answer: str
    """Reference answer for the verifier."""
    text: str
    """The prompt text the model sees (instruction and chat template applied)."""


@dataclass
class PromptLoadReport:
    """What happened to the rows of one source."""

    source: str
    """Prefix of the prompt ids (file stem, benchmark name or built-in task)."""
    origin: str
    """Where the rows came from (the file path), for messages."""
    total: int = 0
    kept: int = 0
    columns: set[str] = field(default_factory=set)
    """Field names seen in the rows."""
    rejected: Counter[str] = field(default_factory=Counter)


def load_prompts(
    data_cfg: DataConfig, tokenizer: PreTrainedTokenizerBase, max_prompt_tokens: int
) -> list[PromptRecord]:
    """Training prompts from ``data.train_path``, or the built-in task's train split when it is empty."""
    if data_cfg.train_path:
        return load_file(
            data_cfg.train_path,
            data_cfg.format,
            source=Path(data_cfg.train_path).stem,
            fields=(data_cfg.prompt_field, data_cfg.answer_field),
            tokenizer=tokenizer,
            max_prompt_tokens=max_prompt_tokens,
            use_chat_template=data_cfg.use_chat_template,
        )
    task = data_cfg.builtin_task
    records, _ = build_records(
        builtin_problems(task, data_cfg.builtin_size, data_cfg.seed, "train"),
        source=f"builtin-{task}-train",
        origin=f"built-in task {task!r}",
        prompt_field="problem",
        answer_field="answer",
        tokenizer=tokenizer,
        max_prompt_tokens=max_prompt_tokens,
        use_chat_template=data_cfg.use_chat_template,
        template=builtin_template(task),
    )
    return records


def load_benchmark(
    bench: BenchmarkFile,
    tokenizer: PreTrainedTokenizerBase,
    max_prompt_tokens: int,
    *,
    builtin_task: str = "arithmetic",
    seed: int = 0,
    use_chat_template: bool = True,
) -> list[PromptRecord]:
    """Evaluation problems of one benchmark (``path == 'builtin'``: the built-in task's eval split).

    ``bench.limit`` keeps the first N usable problems (0: all).
    """
    if bench.path == "builtin":
        records, _ = build_records(
            builtin_problems(builtin_task, bench.limit or DEFAULT_BUILTIN_EVAL_SIZE, seed, "eval"),
            source=bench.name,
            origin=f"built-in task {builtin_task!r} (eval split)",
            prompt_field="problem",
            answer_field="answer",
            tokenizer=tokenizer,
            max_prompt_tokens=max_prompt_tokens,
            use_chat_template=use_chat_template,
            template=builtin_template(builtin_task),
        )
    else:
        records = load_file(
            bench.path,
            bench.format,
            source=bench.name,
            fields=(bench.prompt_field, bench.answer_field),
            tokenizer=tokenizer,
            max_prompt_tokens=max_prompt_tokens,
            use_chat_template=use_chat_template,
        )
    return records[: bench.limit] if bench.limit else records


def load_file(
    path: str,
    data_format: str,
    *,
    source: str,
    fields: tuple[str, str],
    tokenizer: PreTrainedTokenizerBase,
    max_prompt_tokens: int,
    use_chat_template: bool,
) -> list[PromptRecord]:
    """The prompts of a local data file in ``data_format``. Math problems get the paper's instruction;
    a coding problem's prompt is built by its format (instruction, starter code) and its reference
    answer is its tests (``CodeProblem.to_json``)."""
    rows = read_rows(path)
    if data_format == "problems":
        prompt_field, answer_field = fields
        template = instruction_prompt
    elif data_format == "qa":
        rows, prompt_field, answer_field, template = qa_rows(rows, path), "problem", "answer", qa_prompt
    else:
        rows = [{"problem": r.prompt, "answer": r.problem.to_json()} for r in code_records(rows, data_format, path)]
        prompt_field, answer_field, template = "problem", "answer", str.strip
    records, _ = build_records(
        rows,
        source=source,
        origin=path,
        prompt_field=prompt_field,
        answer_field=answer_field,
        tokenizer=tokenizer,
        max_prompt_tokens=max_prompt_tokens,
        use_chat_template=use_chat_template,
        template=template,
    )
    return records


def instruction_prompt(problem: str) -> str:
    """A real dataset's prompt: the problem followed by the paper's instruction."""
    return f"{problem.strip()}\n{INSTRUCTION}"


def encode_prompt(
    tokenizer: PreTrainedTokenizerBase, content: str, *, use_chat_template: bool
) -> tuple[str, list[int]]:
    """(text, token ids) of a user message: the chat template with a generation prompt when asked
    for and available, else the plain text with the tokenizer's own special tokens."""
    if use_chat_template and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
        )
        # The template already holds the special tokens (BOS, role markers): do not add them again.
        return text, list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return content, list(tokenizer(content)["input_ids"])


def build_records(
    rows: Iterable[Mapping[str, Any]],
    *,
    source: str,
    origin: str,
    prompt_field: str,
    answer_field: str,
    tokenizer: PreTrainedTokenizerBase,
    max_prompt_tokens: int,
    use_chat_template: bool,
    template: Callable[[str], str],
) -> tuple[list[PromptRecord], PromptLoadReport]:
    """Validate, template and tokenize rows; rejected rows are counted, not fatal (unless all are)."""
    report = PromptLoadReport(source=source, origin=origin)
    records = []
    for index, row in enumerate(rows):
        report.total += 1
        report.columns.update(row.keys())
        problem, answer = _text(row.get(prompt_field)), _text(row.get(answer_field))
        reason = _reject_reason(problem, answer)
        if reason is None:
            text, ids = encode_prompt(tokenizer, template(problem), use_chat_template=use_chat_template)
            reason = "too_long" if len(ids) > max_prompt_tokens else None
        if reason is not None:
            report.rejected[reason] += 1
            continue
        records.append(PromptRecord(prompt_id=f"{source}-{index}", prompt_ids=ids, answer=answer, text=text))
    report.kept = len(records)
    _check_report(report, prompt_field, answer_field, max_prompt_tokens)
    return records, report


def _text(value: Any) -> str | None:
    """A field as stripped text (numbers become strings); None when the field is absent."""
    if value is None:
        return None
    return str(value).strip()


def _reject_reason(problem: str | None, answer: str | None) -> str | None:
    if problem is None:
        return "missing_prompt"
    if answer is None:
        return "missing_answer"
    if not problem:
        return "empty_prompt"
    if not answer:
        return "empty_answer"
    return None


def _check_report(report: PromptLoadReport, prompt_field: str, answer_field: str, max_prompt_tokens: int) -> None:
    counts = ", ".join(f"{reason}={count}" for reason, count in sorted(report.rejected.items()))
    if report.kept == 0:
        raise PromptDataError(
            f"{report.origin}: none of its {report.total} rows is usable ({counts or 'the file is empty'}); "
            f"expected text fields {prompt_field!r} (problem) and {answer_field!r} (answer), found "
            f"{sorted(report.columns)} — set data.prompt_field / data.answer_field (or the benchmark's "
            f"prompt_field / answer_field) to the file's names — and prompts of at most "
            f"rollout.max_prompt_tokens={max_prompt_tokens} tokens"
        )
    if report.rejected:
        logger.warning(
            "%s: skipped %d of %d rows (%s); fields %r / %r, max_prompt_tokens=%d",
            report.origin,
            sum(report.rejected.values()),
            report.total,
            counts,
            prompt_field,
            answer_field,
            max_prompt_tokens,
        )


def stage_prompts(prompts: list[PromptRecord], stage: int, count: int, seed: int) -> list[PromptRecord]:
    """The ``count`` prompts of stage ``stage``: consecutive slices of seeded per-epoch permutations."""
    return prompt_slice(prompts, stage * count, count, seed)


def prompt_slice(prompts: list[PromptRecord], start: int, count: int, seed: int) -> list[PromptRecord]:
    """Prompts ``start`` .. ``start + count - 1`` of the seeded stream: each epoch a new permutation."""
    out: list[PromptRecord] = []
    position = start
    while len(out) < count:
        epoch, offset = divmod(position, len(prompts))
        order = list(range(len(prompts)))
        random.Random(f"prompts/{seed}/{epoch}").shuffle(order)
        take = min(count - len(out), len(prompts) - offset)
        out.extend(prompts[i] for i in order[offset : offset + take])
        position += take
    return out
