"""Prompt data: JSONL / Parquet loading, field mapping, rejected rows, templates, benchmarks."""

from __future__ import annotations

import json
import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_mugrpo.char_tokenizer import build_char_tokenizer
from megatron_mugrpo.evaluation import BenchmarkConfig
from megatron_mugrpo.rollout.prompts import (
    INSTRUCTION,
    DataConfig,
    PromptDataError,
    build_records,
    instruction_prompt,
    load_benchmark,
    load_prompts,
    read_rows,
)

MAX_TOKENS = 120
# One good row of each kind plus one row per rejection reason (the long one exceeds MAX_TOKENS).
ROWS = [
    {"question": "What is 2+3?", "solution": "5"},
    {"question": "Compute 7*6.", "solution": 42},
    {"question": None, "solution": "1"},
    {"question": "No answer here", "solution": None},
    {"question": "   ", "solution": "3"},
    {"question": "Empty answer", "solution": ""},
    {"question": "x" * 200, "solution": "9"},
]
EXPECTED_REJECTS = {
    "missing_prompt": 1,
    "missing_answer": 1,
    "empty_prompt": 1,
    "empty_answer": 1,
    "too_long": 1,
}


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _write_parquet(path, rows):
    pq.write_table(
        pa.Table.from_pylist([{k: (None if v is None else str(v)) for k, v in r.items()} for r in rows]), path
    )
    return path


@pytest.mark.parametrize("writer", [_write_jsonl, _write_parquet], ids=["jsonl", "parquet"])
def test_file_rows_mapped_templated_and_rejected_with_counts(tmp_path, tokenizer, writer, caplog):
    path = writer(tmp_path / ("data.jsonl" if writer is _write_jsonl else "data.parquet"), ROWS)
    cfg = DataConfig(train_path=str(path), prompt_field="question", answer_field="solution")
    with caplog.at_level(logging.WARNING, logger="megatron_mugrpo.rollout.prompts"):
        records = load_prompts(cfg, tokenizer, MAX_TOKENS)
    assert [r.answer for r in records] == ["5", "42"]
    assert [r.prompt_id for r in records] == ["data-0", "data-1"]
    assert records[0].text == f"What is 2+3?\n{INSTRUCTION}"
    assert records[0].prompt_ids == tokenizer(records[0].text)["input_ids"]
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "skipped 5 of 7 rows" in warnings[0]

    _, report = build_records(
        read_rows(path),
        source="data",
        origin=str(path),
        prompt_field="question",
        answer_field="solution",
        tokenizer=tokenizer,
        max_prompt_tokens=MAX_TOKENS,
        use_chat_template=True,
        template=instruction_prompt,
    )
    assert (report.total, report.kept, dict(report.rejected)) == (7, 2, EXPECTED_REJECTS)


def test_file_without_usable_rows_names_file_and_fields(tmp_path, tokenizer):
    path = _write_jsonl(tmp_path / "bad.jsonl", ROWS)
    cfg = DataConfig(train_path=str(path))  # default fields 'problem' / 'answer' are not in the file
    with pytest.raises(PromptDataError, match=r"bad\.jsonl.*'problem'.*'answer'.*found \['question', 'solution'\]"):
        load_prompts(cfg, tokenizer, MAX_TOKENS)


def test_chat_template_applied_when_present_and_enabled(tmp_path, tokenizer):
    path = _write_jsonl(tmp_path / "chat.jsonl", ROWS[:1])
    chat_tokenizer = build_char_tokenizer()
    chat_tokenizer.chat_template = "{% for m in messages %}U:{{ m['content'] }}\n{% endfor %}A:"
    on = load_prompts(
        DataConfig(train_path=str(path), prompt_field="question", answer_field="solution"),
        chat_tokenizer,
        200,
    )
    assert on[0].text == f"U:What is 2+3?\n{INSTRUCTION}\nA:"
    assert on[0].prompt_ids == chat_tokenizer(on[0].text, add_special_tokens=False)["input_ids"]
    off_cfg = DataConfig(
        train_path=str(path), prompt_field="question", answer_field="solution", use_chat_template=False
    )
    assert load_prompts(off_cfg, chat_tokenizer, 200)[0].text == f"What is 2+3?\n{INSTRUCTION}"


def test_builtin_task_when_no_file(tokenizer):
    records = load_prompts(DataConfig(builtin_size=40, seed=3), tokenizer, MAX_TOKENS)
    assert len(records) == 40 and len({r.prompt_id for r in records}) == 40
    first = records[0]
    assert first.text.endswith("=") and first.prompt_ids[0] == tokenizer.bos_token_id
    assert first.prompt_ids == tokenizer(first.text)["input_ids"] and first.answer.isdigit()


def test_benchmarks_builtin_and_file(tmp_path, tokenizer):
    builtin = load_benchmark(BenchmarkConfig(name="arith", path="builtin", limit=25), tokenizer, MAX_TOKENS)
    assert len(builtin) == 25 and builtin[0].prompt_id.startswith("arith-")
    train = {r.text for r in load_prompts(DataConfig(builtin_size=2000), tokenizer, MAX_TOKENS)}
    assert not train & {r.text for r in builtin}
    path = _write_jsonl(tmp_path / "aime.jsonl", ROWS)
    bench = BenchmarkConfig(name="aime", path=str(path), prompt_field="question", answer_field="solution", limit=1)
    records = load_benchmark(bench, tokenizer, MAX_TOKENS)
    assert [r.answer for r in records] == ["5"]


def test_a_bad_jsonl_line_is_named_by_its_number(tmp_path):
    path = tmp_path / "bad.jsonl"
    good = '{"problem": "1+1", "answer": "2"}\n'
    path.write_text(good + "\n" + '{"problem": "2+2", "answer": \n' + good)
    with pytest.raises(PromptDataError, match=r"bad\.jsonl:3: not a JSON object"):
        read_rows(path)
    path.write_text('{"problem": "1+1", "answer": "2"}\n[1, 2]\n')
    with pytest.raises(PromptDataError, match=r"bad\.jsonl:2: expected a JSON object.*got list"):
        read_rows(path)


@pytest.mark.parametrize(("name", "text"), [("empty.jsonl", ""), ("blank.jsonl", "\n  \n"), ("empty.json", "")])
def test_an_empty_file_says_so(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(PromptDataError, match=rf"{name} (is empty|holds only blank lines)"):
        read_rows(path)
