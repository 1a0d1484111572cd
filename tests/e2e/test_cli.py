"""The `mugrpo` command line: every verb documents itself, bad input is one clear error with exit 2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VERBS = ["train", "generate", "optimize", "eval", "report", "convert"]
CONVERT_VERBS = ["hf-to-megatron", "megatron-to-hf", "verify"]


def mugrpo(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    return subprocess.run(
        [sys.executable, "-m", "megatron_mugrpo.cli", *args],
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
    (tmp_path / "config.yaml").write_text("{}\n")
    line = _error_line(mugrpo("train", "--config", "configs/demo_cpu.yaml", "--run-dir", str(tmp_path)))
    assert "--resume" in line


def test_phase_verbs_need_a_run(tmp_path: Path):
    line = _error_line(mugrpo("optimize", "--run-dir", str(tmp_path / "none"), "--stage", "0"))
    assert "--config" in line


def test_report_on_a_dir_without_metrics(tmp_path: Path):
    line = _error_line(mugrpo("report", str(tmp_path)))
    assert "metrics.jsonl" in line
