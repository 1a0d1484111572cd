"""`mugrpo score`: responses scored through the configured reward, the real sandbox included.

The hostile programs of the sandbox's own tests run here again through the command line, as a
user's check of a data set would run them. Each problem's expected output is what the program
would print if it escaped (the secret it read, "connected", ...), so a reward of 0 shows that it
did not: a leak would score 1.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest

from megatron_mugrpo.cli import main

SECRET = "mugrpo-fake-secret-9d2e"
PROJECT = Path(__file__).resolve().parents[2]


def _fenced(source: str) -> str:
    return f"Here is my solution.\n```python\n{source}```\n"


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _config(tmp_path: Path, **code: object) -> Path:
    options = {"max_cpu_s": 1.0, "max_memory_mib": 256, "output_bytes": 1 << 16, "scratch_mib": 8} | code
    lines = ["reward:", "  kind: code", "  workers: 2", "  code:"] + [f"    {k}: {v}" for k, v in options.items()]
    path = tmp_path / "score.yaml"
    path.write_text("\n".join(["data:", "  format: code_contests", *lines]) + "\n")
    return path


def _problem(name: str, expected: str, stdin: str = "\n") -> dict:
    tests = {"input": [stdin], "output": [expected]}
    return {"name": name, "description": name, "public_tests": tests, "private_tests": {"input": [], "output": []}}


def _score(capsys, config: Path, data: Path, responses: Path) -> tuple[int, list[dict], str]:
    code = main(["score", "--config", str(config), "--data", str(data), "--responses", str(responses)])
    out, err = capsys.readouterr()
    return code, [json.loads(line) for line in out.splitlines() if line.startswith("{")], err


DAEMON_MARKER = "mugrpo-daemon-7c41"
"""In the command line of the daemon the hostile program starts, so the test can look for it by name
(other runs' sandboxed programs may be alive on a shared machine; this one must not be)."""


def _marked_processes() -> list[int]:
    """Live processes whose command line carries ``DAEMON_MARKER``."""
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                cmdline = Path(entry.path, "cmdline").read_bytes()
                if DAEMON_MARKER.encode() in cmdline and " Z " not in Path(entry.path, "stat").read_text():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def test_hostile_programs_are_contained_when_scored_from_the_command_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MUGRPO_FAKE_TOKEN", SECRET)
    run_file = tmp_path / "run" / "checkpoint.json"
    run_file.parent.mkdir()
    run_file.write_text(SECRET)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    injected = PROJECT / "INJECTED_BY_SCORE"
    hostile = {  # name: (program, what it would print had it escaped, the reason it must get)
        "infinite_loop": ("while True:\n    pass\n", "done", "timeout"),
        "fork_bomb": ("import os\nwhile True:\n    os.fork()\n", "done", "runtime_error"),
        "allocate_4gb": ("x = bytearray(4 << 30)\nprint('done')\n", "done", "memory_limit"),
        "file_1gb_tmp": (
            "f = open('/tmp/big', 'wb')\nfor _ in range(1024):\n    f.write(b'0' * (1 << 20))\nprint('done')\n",
            "done",
            "output_limit",  # no file of a program may pass reward.code.output_bytes
        ),
        "stdout_100mb": (
            "import sys\nfor _ in range(100):\n    sys.stdout.write('x' * (1 << 20))\n",
            "done",
            "output_limit",
        ),
        "host_loopback": (
            f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')\n",
            "connected",
            "runtime_error",
        ),
        "read_shadow": ("print(open('/etc/shadow').read())\n", "root", "runtime_error"),
        "read_run_dir": (f"print(open({str(run_file)!r}).read())\n", SECRET, "runtime_error"),
        "read_environment": ("import os\nprint(os.environ.get('MUGRPO_FAKE_TOKEN'))\n", SECRET, "wrong_answer"),
        "kill_parent": ("import os\nos.kill(os.getppid(), 9)\nprint('done')\n", "killed", None),
        "daemon": (
            "import os, sys\nif os.fork() == 0:\n    os.setsid()\n"
            f"    os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(120)', {DAEMON_MARKER!r}])\n"
            "print('done')\n",
            "outlived",
            "wrong_answer",
        ),
        "write_project": (f"open({str(injected)!r}, 'w').write('x')\nprint('written')\n", "written", "runtime_error"),
        "deep_recursion": (
            "import sys\nsys.setrecursionlimit(10**9)\ndef f(n):\n    return f(n + 1)\nf(0)\n",
            "done",
            ("runtime_error", "timeout", "memory_limit"),  # a crashed stack, or the limits first
        ),
    }
    data = _write_jsonl(tmp_path / "problems.jsonl", [_problem(name, out) for name, (_, out, _) in hostile.items()])
    responses = _write_jsonl(
        tmp_path / "responses.jsonl", [{"id": name, "response": _fenced(src)} for name, (src, _, _) in hostile.items()]
    )
    code, lines, _ = _score(capsys, _config(tmp_path), data, responses)
    assert code == 0 and [line["id"] for line in lines] == list(hostile)
    for line in lines:
        _, _, reason = hostile[line["id"]]
        assert line["reward"] == 0.0, line
        assert line["tests_passed"] == 0 and line["tests_total"] == 1, line
        if reason is not None:
            assert line["reason"] in ((reason,) if isinstance(reason, str) else reason), line
    with pytest.raises(TimeoutError):
        listener.accept()  # nothing ever connected to the host's loopback
    listener.close()
    assert run_file.read_text() == SECRET and not injected.exists()
    assert os.environ["MUGRPO_FAKE_TOKEN"] == SECRET
    assert _marked_processes() == []  # the daemon did not outlive its test

    # The next batch runs normally.
    data = _write_jsonl(tmp_path / "sum.jsonl", [_problem("sum", "5\n", stdin="2 3\n")])
    good = "a, b = map(int, input().split())\nprint(a + b)\n"
    responses = _write_jsonl(tmp_path / "good.jsonl", [{"id": "sum", "response": _fenced(good)}])
    code, lines, _ = _score(capsys, _config(tmp_path), data, responses)
    assert code == 0 and lines[0]["reward"] == 1.0 and lines[0]["reason"] == "correct" and lines[0]["tests_passed"] == 1


def test_math_responses_are_scored_with_the_configured_answer_format(tmp_path, capsys):
    data = _write_jsonl(tmp_path / "math.jsonl", [{"problem": "1+1", "answer": "2"}, {"problem": "gsm", "answer": "7"}])
    responses = _write_jsonl(
        tmp_path / "r.jsonl", [{"id": 0, "response": "so #### 2"}, {"id": "1", "response": "the answer is 7"}]
    )
    config = tmp_path / "math.yaml"
    config.write_text("reward:\n  kind: math\n  workers: 1\n  math:\n    answer_format: gsm8k\n")
    code, lines, _ = _score(capsys, config, data, responses)
    assert code == 0
    assert [(x["id"], x["reward"], x["reason"]) for x in lines] == [
        ("0", 1.0, "correct"),
        ("1", 0.0, "no_answer_marker"),
    ]


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([{"id": "sum"}], r"responses\.jsonl:1: expected \{\"id\""),
        (
            [{"id": "sum", "response": "x"}, {"id": "nope", "response": "x"}],
            r"responses\.jsonl:2: no problem with id 'nope'",
        ),
    ],
)
def test_bad_response_rows_are_one_error_naming_the_line(tmp_path, capsys, rows, message):
    data = _write_jsonl(tmp_path / "sum.jsonl", [_problem("sum", "5\n", stdin="2 3\n")])
    responses = _write_jsonl(tmp_path / "responses.jsonl", rows)
    code, lines, err = _score(capsys, _config(tmp_path), data, responses)
    assert code == 2 and lines == [] and err.startswith("error: ")
    assert __import__("re").search(message, err), err


def test_a_reward_that_cannot_read_the_data_is_refused(tmp_path, capsys):
    data = _write_jsonl(tmp_path / "sum.jsonl", [_problem("sum", "5\n", stdin="2 3\n")])
    responses = _write_jsonl(tmp_path / "responses.jsonl", [{"id": "sum", "response": "x"}])
    config = tmp_path / "math.yaml"
    config.write_text("data:\n  format: code_contests\nreward:\n  kind: math\n")
    code, _, err = _score(capsys, config, data, responses)
    assert code == 2 and "reward.kind='math' cannot score the training data" in err and "set reward.kind=code" in err


def test_a_code_contests_file_is_scored_as_its_rows_format_with_the_code_demo_config(tmp_path, capsys):
    """The code demo's config names no data format (its data are a built-in task, so data.format is the
    default 'problems'); a code_contests file scored with it is read as code_contests, and stderr says so."""
    data = _write_jsonl(tmp_path / "problems.jsonl", [_problem("sum", "5\n", stdin="2 3\n")])
    good = "a, b = map(int, input().split())\nprint(a + b)\n"
    responses = _write_jsonl(
        tmp_path / "r.jsonl",
        [{"id": "sum", "response": _fenced(good)}, {"id": "sum", "response": _fenced("print(6)\n")}],
    )
    demo = PROJECT / "configs" / "demo_code_cpu.yaml"
    code, lines, err = _score(capsys, demo, data, responses)
    assert code == 0, err
    assert [(x["reward"], x["reason"]) for x in lines] == [(1.0, "correct"), (0.0, "wrong_answer")]
    assert "scored as data.format=code_contests" in err and "the config says data.format=problems" in err

    # data.format on the command line is obeyed: the reward then cannot read the file, and the error names
    # the likely fix first (the file's coding-problem format), then the reward.
    code = main(
        ["score", "--config", str(demo), "--data", str(data), "--responses", str(responses), "data.format=problems"]
    )
    _, err = capsys.readouterr()
    assert code == 2 and "reward.kind='code' cannot score the training data (data.format='problems'" in err
    fixes = err.index("set data.format=code_contests or data.format=livecodebench"), err.index("set reward.kind=math")
    assert fixes[0] < fixes[1], err


def test_row_formats_read_the_fields_of_each_format() -> None:
    from megatron_mugrpo.scoring import row_formats

    fields = {"prompt_field": "problem", "answer_field": "answer"}
    assert row_formats(_problem("x", "1\n"), **fields) == ["code_contests"]
    lcb = {"question_content": "q", "public_test_cases": "[]", "question_id": "1"}
    assert row_formats(lcb, **fields) == ["livecodebench"]
    assert row_formats({"problem": "1+1", "answer": "2"}, **fields) == ["problems"]
    assert row_formats({"question": "1+1", "answer": "2"}, **fields) == []
    assert row_formats({"description": "d"}, **fields) == []  # no test field: not a code_contests row
