"""The `mugrpo` command line: every verb documents itself, bad input is one clear error with exit 2."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from megatron_mugrpo.commands import mugrpo_argv

ROOT = Path(__file__).resolve().parents[2]
VERBS = ["train", "generate", "optimize", "eval", "report", "sweep", "convert"]
CONVERT_VERBS = ["hf-to-megatron", "megatron-to-hf", "verify"]


def mugrpo(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    return subprocess.run(
        mugrpo_argv(*args),
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_top_level_help_lists_every_verb():
    proc = mugrpo("--help")
    assert proc.returncode == 0
    for verb in VERBS:
        assert verb in proc.stdout


@pytest.mark.parametrize("verb", VERBS)
def test_each_verb_has_help(verb: str):
    proc = mugrpo(verb, "--help")
    assert proc.returncode == 0, proc.stderr
    assert "usage: mugrpo " + verb in proc.stdout


@pytest.mark.parametrize("verb", CONVERT_VERBS)
def test_each_convert_verb_has_help(verb: str):
    proc = mugrpo("convert", verb, "--help")
    assert proc.returncode == 0, proc.stderr
    assert "--out" in proc.stdout or "--ckpt" in proc.stdout


def _error_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-4000:])
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, proc.stderr[-4000:]
    return lines[0]


def test_bad_config_value_is_one_clear_error(tmp_path: Path):
    line = _error_line(
        mugrpo(
            "train", "--config", "configs/demo_cpu.yaml", "--run-dir", str(tmp_path / "r"), "algo.mu_grpo.clip_low=7"
        )
    )
    assert "algo.mu_grpo.clip_low" in line and "clip_high" in line
    assert not (tmp_path / "r").exists(), "nothing is written for a rejected config"


def test_unknown_override_key(tmp_path: Path):
    line = _error_line(
        mugrpo(
            "train", "--config", "configs/demo_cpu.yaml", "--run-dir", str(tmp_path / "r"), "algo.mu_grpo.clip_hgh=5"
        )
    )
    assert "algo.mu_grpo.clip_hgh" in line


def test_missing_config_file(tmp_path: Path):
    line = _error_line(mugrpo("train", "--config", str(tmp_path / "nope.yaml"), "--run-dir", str(tmp_path / "r")))
    assert "nope.yaml" in line


def test_resume_missing_run_dir(tmp_path: Path):
    line = _error_line(mugrpo("train", "--resume", str(tmp_path / "missing")))
    assert "missing" in line


def test_resume_dir_without_config(tmp_path: Path):
    line = _error_line(mugrpo("train", "--resume", str(tmp_path)))
    assert "config.yaml" in line


def test_train_refuses_an_existing_run(tmp_path: Path):
    """A run that produced something (here a rollout shard); one that produced nothing is replaced."""
    (tmp_path / "config.yaml").write_text("{}\n")
    (tmp_path / "rollouts" / "stage_000").mkdir(parents=True)
    (tmp_path / "rollouts" / "stage_000" / "shard_00000.parquet").write_bytes(b"x")
    line = _error_line(mugrpo("train", "--config", "configs/demo_cpu.yaml", "--run-dir", str(tmp_path)))
    assert "--resume" in line


def test_phase_verbs_need_a_run(tmp_path: Path):
    line = _error_line(mugrpo("optimize", "--run-dir", str(tmp_path / "none"), "--stage", "0"))
    assert "--config" in line


def test_report_on_a_dir_without_metrics(tmp_path: Path):
    line = _error_line(mugrpo("report", str(tmp_path)))
    assert "metrics.jsonl" in line


# ------------------------------------------------------------------ bad input: no traceback, no output
# In-process (cheap): these fail before any process group or file is created.


def _main_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    from megatron_mugrpo.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("model: [\n", r"is not valid YAML: .* at line 2, column 1"),
        ("- model\n- rollout\n", "the top level must be a mapping of sections"),
    ],
)
def test_malformed_yaml_is_one_error(tmp_path: Path, text: str, message: str, capsys: pytest.CaptureFixture[str]):
    import re

    config = tmp_path / "run.yaml"
    config.write_text(text)
    line = _main_error(["train", "--config", str(config), "--run-dir", str(tmp_path / "r")], capsys)
    assert "run.yaml" in line and re.search(message, line), line
    assert not (tmp_path / "r").exists()


def test_override_value_that_is_not_yaml(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    argv = ["train", "--config", "configs/demo_cpu.yaml", "--run-dir", str(tmp_path / "r"), "algo.mu_grpo.clip_high=["]
    line = _main_error(argv, capsys)
    assert "algo.mu_grpo.clip_high=[" in line and "not valid YAML" in line
    assert not (tmp_path / "r").exists()


def test_report_on_a_corrupt_metrics_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    record = '{"step": 1, "wall_s": 1.0, "time": 1.0, "train/loss": 1.0}\n'
    (tmp_path / "metrics.jsonl").write_text(record + "GARBAGE\n" + record)
    assert "metrics.jsonl:2 is not a JSON record" in _main_error(["report", str(tmp_path)], capsys)
    (tmp_path / "metrics.jsonl").write_text(record)
    (tmp_path / "out").write_text("")
    assert "--out" in _main_error(["report", str(tmp_path), "--out", str(tmp_path / "out")], capsys)


def test_run_dir_that_is_a_file(tmp_path: Path):
    (tmp_path / "file").write_text("")
    line = _error_line(mugrpo("train", "--config", "configs/demo_cpu.yaml", "--run-dir", str(tmp_path / "file")))
    assert "cannot use" in line and "file" in line


def test_eval_of_a_checkpoint_that_does_not_exist(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    (tmp_path / "config.yaml").write_text("eval:\n  benchmarks:\n  - {name: a, path: builtin}\n")
    line = _main_error(["eval", "--run-dir", str(tmp_path), "--checkpoint", str(tmp_path / "step_9")], capsys)
    assert "step_9 is not a checkpoint step directory" in line
