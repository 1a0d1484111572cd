"""Coding data (code_contests, LiveCodeBench) and the pass@k estimator."""

from __future__ import annotations

import base64
import json
import pickle
import zlib
from math import comb

import pytest

from megatron_mugrpo.algorithms.pass_at_k import pass_at_k, pass_at_ks
from megatron_mugrpo.rewards.code_data import CodeDataError, load_code_problems


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_pass_at_k_hand_computed():
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - comb(3, 2) / comb(4, 2))  # 0.5
    assert pass_at_k(4, 1, 4) == 1.0
    assert pass_at_k(10, 0, 5) == 0.0
    assert pass_at_k(10, 3, 5) == pytest.approx(1 - comb(7, 5) / comb(10, 5))
    assert pass_at_ks(4, 2) == pytest.approx({1: 0.5, 2: 1 - 1 / 6, 3: 1.0, 4: 1.0})
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(4, 1, 5)


def test_code_contests_rows(tmp_path):
    row = {
        "name": "1_A",
        "description": "Add two numbers.",
        "public_tests": {"input": ["1 2\n"], "output": ["3\n"]},
        "private_tests": {"input": ["5 5\n"], "output": ["10\n"]},
        "generated_tests": {"input": ["0 0\n"], "output": ["0\n"]},
        "time_limit": {"seconds": 2, "nanos": 500000000},
        "memory_limit_bytes": 256 << 20,
    }
    (record,) = load_code_problems(write_jsonl(tmp_path / "cc.jsonl", [row]), "code_contests")
    assert record.problem_id == "1_A" and "```python" in record.prompt and record.prompt.startswith("Add two")
    assert record.problem.inputs == ("1 2\n", "5 5\n", "0 0\n")  # public first
    assert record.problem.time_limit_s == 2.5 and record.problem.memory_limit_mib == 256
    assert record.problem.harness == "plain"  # code_contests programs run as written
    bad = dict(row, public_tests={"input": ["1"], "output": []}, private_tests=None, generated_tests=None)
    with pytest.raises(CodeDataError, match=r"cc2\.jsonl row 1: public_tests must be"):
        load_code_problems(write_jsonl(tmp_path / "cc2.jsonl", [bad]), "code_contests")


def test_livecodebench_rows_stdin_functional_and_compressed(tmp_path):
    private = [{"input": "[4, 5]\n2", "output": "9", "testtype": "functional"}]
    compressed = base64.b64encode(zlib.compress(pickle.dumps(json.dumps(private)))).decode()
    functional = {
        "question_id": "lc1",
        "question_content": "Sum the list, then add k.",
        "starter_code": "class Solution:\n    def total(self, xs, k):\n        ",
        "public_test_cases": json.dumps([{"input": "[1, 2]\n0", "output": "3", "testtype": "functional"}]),
        "private_test_cases": compressed,
        "metadata": json.dumps({"func_name": "total"}),
    }
    stdin = {
        "question_id": "lc2",
        "question_content": "Echo.",
        "starter_code": "",
        "public_test_cases": json.dumps([{"input": "a\n", "output": "a\n", "testtype": "stdin"}]),
    }
    records = load_code_problems(write_jsonl(tmp_path / "lcb.jsonl", [functional, stdin]), "livecodebench")
    assert records[0].problem.kind == "functional" and records[0].problem.func_name == "total"
    assert records[0].problem.inputs == ([[1, 2], 0], [[4, 5], 2]) and records[0].problem.outputs == ("3", "9")
    assert "def total" in records[0].prompt
    assert records[1].problem.kind == "stdin" and records[1].problem.inputs == ("a\n",)
    # LiveCodeBench's runner puts its import prelude before every solution, functional and stdin alike
    assert {r.problem.harness for r in records} == {"livecodebench"}


def test_a_pickle_that_names_a_class_is_refused(tmp_path):
    """LiveCodeBench's compressed tests are a pickle: only a plain string may come out of one."""

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    payload = base64.b64encode(zlib.compress(pickle.dumps(Evil()))).decode()
    row = {"question_content": "x", "public_test_cases": payload}
    with pytest.raises(CodeDataError, match="only a pickled string is accepted"):
        load_code_problems(write_jsonl(tmp_path / "evil.jsonl", [row]), "livecodebench")


def test_unknown_format_and_missing_fields(tmp_path):
    path = write_jsonl(tmp_path / "x.jsonl", [{"question_content": ""}])
    with pytest.raises(CodeDataError, match="is not one of"):
        load_code_problems(path, "apps")
    with pytest.raises(CodeDataError, match="question_content"):
        load_code_problems(path, "livecodebench")
