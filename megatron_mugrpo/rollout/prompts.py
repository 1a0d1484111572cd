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

import json
import logging
import random
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from megatron_mugrpo.errors import InputError, require
from megatron_mugrpo.rollout.tasks import builtin_problems, builtin_template

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."
"""The paper's instruction, appended to every problem of a real dataset."""

DEFAULT_BUILTIN_EVAL_SIZE = 256
"""Problems in the built-in task's eval split when a 'builtin' benchmark sets no limit."""

REJECT_REASONS = ("missing_prompt", "missing_answer", "empty_prompt", "empty_answer", "too_long")


@dataclass(kw_only=True)
class DataConfig:
    """``data.*``: training prompts, a local JSONL/Parquet file or the built-in procedural math task."""

    train_path: str = ""
    """Local JSONL or Parquet file of problems; empty uses the built-in task."""
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


class BenchmarkFile(Protocol):
    """What loading reads of one ``eval.benchmarks`` entry (``evaluation.BenchmarkConfig``)."""

    name: str
    path: str
    """Local file, or 'builtin' for the built-in task's eval split."""
    prompt_field: str
    answer_field: str
    limit: int
    """Keep the first N usable problems (0: all)."""


class PromptDataError(InputError, ValueError):
    """A prompt file has no usable row (or cannot be read); the message names the file and fields."""


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
        rows = read_rows(data_cfg.train_path)
        source, origin, template = Path(data_cfg.train_path).stem, data_cfg.train_path, instruction_prompt
        prompt_field, answer_field = data_cfg.prompt_field, data_cfg.answer_field
    else:
        rows = builtin_problems(data_cfg.builtin_task, data_cfg.builtin_size, data_cfg.seed, "train")
        source, template = f"builtin-{data_cfg.builtin_task}-train", builtin_template(data_cfg.builtin_task)
        origin = f"built-in task {data_cfg.builtin_task!r}"
        prompt_field, answer_field = "problem", "answer"
    records, _ = build_records(
        rows,
        source=source,
        origin=origin,
        prompt_field=prompt_field,
        answer_field=answer_field,
        tokenizer=tokenizer,
        max_prompt_tokens=max_prompt_tokens,
        use_chat_template=data_cfg.use_chat_template,
        template=template,
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
        rows = builtin_problems(builtin_task, bench.limit or DEFAULT_BUILTIN_EVAL_SIZE, seed, "eval")
        template, prompt_field, answer_field = builtin_template(builtin_task), "problem", "answer"
        origin = f"built-in task {builtin_task!r} (eval split)"
    else:
        rows = read_rows(bench.path)
        template, prompt_field, answer_field = instruction_prompt, bench.prompt_field, bench.answer_field
        origin = bench.path
    records, _ = build_records(
        rows,
        source=bench.name,
        origin=origin,
        prompt_field=prompt_field,
        answer_field=answer_field,
        tokenizer=tokenizer,
        max_prompt_tokens=max_prompt_tokens,
        use_chat_template=use_chat_template,
        template=template,
    )
    return records[: bench.limit] if bench.limit else records


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a local .jsonl / .json / .parquet file.

    JSONL is parsed here, line by line, so a malformed line is reported with its number; .json and
    .parquet go through the `datasets` library.
    """
    path = Path(path)
    builder = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}.get(path.suffix)
    if builder is None:
        raise PromptDataError(f"{path}: unsupported file type {path.suffix!r}; use .jsonl, .json or .parquet")
    if not path.is_file():
        raise PromptDataError(f"{path} does not exist")
    if path.stat().st_size == 0:
        raise PromptDataError(f"{path} is empty: expected one JSON object (or table row) per problem")
    if path.suffix == ".jsonl":
        return read_jsonl(path)
    from datasets import load_dataset

    try:
        dataset = load_dataset(builder, data_files=str(path), split="train")
    except Exception as exc:  # datasets raises many types for malformed files
        raise PromptDataError(f"{path} could not be read as {builder}: {str(exc) or type(exc).__name__}") from exc
    return list(dataset)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """One JSON object per non-blank line; a bad line is an error naming the file and line number."""
    rows = []
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as exc:  # JSONDecodeError, or UnicodeDecodeError from the file
                raise PromptDataError(f"{path}:{number}: not a JSON object ({exc}); fix or delete that line") from exc
            if not isinstance(row, dict):
                raise PromptDataError(
                    f"{path}:{number}: expected a JSON object with the problem and answer fields, "
                    f"got {type(row).__name__}"
                )
            rows.append(row)
    if not rows:
        raise PromptDataError(f"{path} holds only blank lines: expected one JSON object per problem")
    return rows


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
