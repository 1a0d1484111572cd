"""The run directory's guarantees, end to end through the `mugrpo` CLI (CPU).

Evaluation only appends to metrics.jsonl; `--resume` changes only safe keys (recorded in
config.yaml's history) and refuses the rest before touching anything; one process writes a run
directory at a time; a directory is a run only once set-up succeeded; `convert megatron-to-hf` from
a run's checkpoint brings the tokenizer along.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from e2e_runs import DEMO, ROOT, SMALL, mugrpo, records, train

from megatron_mugrpo.rundir import LOCK_FILE

Finished = tuple[Path, subprocess.CompletedProcess]


def _copy(run: Finished, tmp_path: Path) -> Path:
    target = tmp_path / "copy"
    shutil.copytree(run[0], target)
    return target


def _error_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-4000:])
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-4000:]
    return lines[0]


def _snapshot(run_dir: Path) -> dict[str, tuple[int, int]]:
    """Every file under run_dir with its size and modification time (to prove nothing was touched).

    Except the lock file: every verb takes the lock (writing its pid there) before it judges the directory.
    """
    return {
        str(p.relative_to(run_dir)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in run_dir.rglob("*")
        if p.name != LOCK_FILE
    }


@pytest.mark.slow
def test_eval_appends_and_keeps_every_training_record(uninterrupted: Finished, tmp_path: Path):
    """D1: `mugrpo eval` on a finished run used to cut metrics.jsonl back to the evaluated checkpoint."""
    run_dir = _copy(uninterrupted, tmp_path)
    before = (run_dir / "metrics.jsonl").read_bytes()
    config = (run_dir / "config.yaml").read_bytes()
    step_dir = run_dir / "checkpoints" / "step_00000006"
    proc = mugrpo("eval", "--run-dir", str(run_dir), "--checkpoint", str(step_dir), "eval.benchmarks.0.limit=8")
    assert "eval/avg_pass@1 = " in proc.stdout
    after = (run_dir / "metrics.jsonl").read_bytes()
    assert after.startswith(before), "records were dropped or changed"
    added = [json.loads(line) for line in after[len(before) :].splitlines()]
    assert [r["step"] for r in added if "eval/avg_pass@1" in r] == [6]  # and the weight sync's perf/ record
    assert {r["source"] for r in added} == {"mugrpo eval of step_00000006"}
    assert (run_dir / "tensorboard" / "eval_step_00000006").is_dir()
    assert (run_dir / "config.yaml").read_bytes() == config, "eval overrides apply to that evaluation only"

    # `generate` of a complete stage regenerates nothing and logs nothing; it never drops records either.
    mugrpo("generate", "--run-dir", str(run_dir), "--stage", "1")
    assert (run_dir / "metrics.jsonl").read_bytes() == after


@pytest.mark.slow
def test_resume_extends_the_run_and_records_the_change(uninterrupted: Finished, tmp_path: Path):
    """D3: `train --resume D stages.num_stages=3` ran 2 stages and kept the old config."""
    run_dir = _copy(uninterrupted, tmp_path)
    mugrpo("train", "--resume", str(run_dir), "stages.num_stages=3")
    assert [r["step"] for r in records(run_dir) if "train/loss" in r] == list(range(1, 13))
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_00000012"
    config = (run_dir / "config.yaml").read_text()
    assert "num_stages: 3" in config
    assert "train --resume: stages.num_stages=3" in config.split("model:")[0], "history entry in the header"
    history = json.loads((run_dir / "config_history.json").read_text())
    assert [e["event"].split(":")[0] for e in history["entries"]] == ["train", "train --resume"]
    assert history["config"]["stages"]["num_stages"] == 3


@pytest.mark.slow
def test_resume_refuses_unsafe_changes_before_touching_anything(uninterrupted: Finished, tmp_path: Path):
    """D3: unsafe overrides and hand edits (loss clip, group size, model shape) are refused with the key
    and the reason; the run directory is left exactly as it was."""
    run_dir = _copy(uninterrupted, tmp_path)
    snapshot = _snapshot(run_dir)
    line = _error_line(mugrpo("train", "--resume", str(run_dir), "algo.mu_grpo.clip_high=3", check=False))
    assert "algo.mu_grpo.clip_high cannot be overridden on resume" in line and "new run" in line
    line = _error_line(
        mugrpo("optimize", "--run-dir", str(run_dir), "--stage", "1", "rollout.group_size=4", check=False)
    )
    assert "rollout.group_size" in line and "stored rollout datasets" in line
    line = _error_line(mugrpo("train", "--resume", str(run_dir), "stages.num_stages=1", check=False))
    assert "already finished 2 stages" in line
    assert _snapshot(run_dir) == snapshot

    config = run_dir / "config.yaml"
    original = config.read_text()
    for old, new, key in (
        ("clip_high: 5.0", "clip_high: 3.0", "algo.mu_grpo.clip_high"),
        ("hidden_size: 64", "hidden_size: 128", "model.tiny.hidden_size"),
    ):
        config.write_text(original.replace(old, new))
        snapshot = _snapshot(run_dir)
        line = _error_line(mugrpo("train", "--resume", str(run_dir), check=False))
        assert key in line and "edited by hand" in line, line
        assert _snapshot(run_dir) == snapshot


def _hold_lock(run_dir: Path) -> subprocess.Popen:
    """A second real process that takes the run directory's lock and keeps it until killed."""
    code = (
        "import sys, time; from pathlib import Path; from megatron_mugrpo.rundir import RunLock; "
        "lock = RunLock.acquire(Path(sys.argv[1])); print('locked', flush=True); time.sleep(600)"
    )
    holder = subprocess.Popen([sys.executable, "-c", code, str(run_dir)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    return holder


def test_a_second_writer_is_refused_with_the_holders_pid_and_host(tmp_path: Path):
    """D4: two `train` processes on one directory both started; the second now exits 2 at once."""
    run_dir = tmp_path / "run"
    holder = _hold_lock(run_dir)
    try:
        args = ["train", "--config", str(DEMO), "--run-dir", str(run_dir), *SMALL]
        line = _error_line(mugrpo(*args, check=False))
        assert f"pid {holder.pid} on host {socket.gethostname()}" in line
        assert sorted(p.name for p in run_dir.iterdir()) == [".lock"], "the refused process wrote nothing"
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()


def test_every_verb_takes_the_lock_before_it_judges_the_directory(tmp_path: Path):
    """A first start still setting up holds the lock and has no config.yaml yet: `train --resume` said
    "not a run (no config.yaml)" instead of naming the process that holds the directory."""
    run_dir = tmp_path / "run"
    holder = _hold_lock(run_dir)
    try:
        for verb in (
            ["train", "--resume", str(run_dir)],
            ["optimize", "--run-dir", str(run_dir), "--stage", "0"],
            ["eval", "--run-dir", str(run_dir)],
        ):
            line = _error_line(mugrpo(*verb, check=False))
            assert f"pid {holder.pid} on host {socket.gethostname()}" in line, (verb, line)
        assert sorted(p.name for p in run_dir.iterdir()) == [LOCK_FILE], "the refused processes wrote nothing"
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()


def test_bad_data_fails_before_any_model_is_built(tmp_path: Path):
    """The demo builds its base model (a 1,500-step warm start, minutes) and the policy; a data file
    without one usable row must fail before that, with one error line and nothing left behind."""
    run_dir, data = tmp_path / "run", tmp_path / "bad.jsonl"
    data.write_text('{"question": "1+1", "solution": "2"}\n{"question": "2+3", "solution": "5"}\n')
    started = time.monotonic()
    args = ["train", "--config", str(DEMO), "--run-dir", str(run_dir), f"data.train_path={data}"]
    line = _error_line(mugrpo(*args, check=False))
    assert "bad.jsonl" in line and "usable" in line, line
    assert time.monotonic() - started < 120, "set-up built models before it read the data"
    assert not run_dir.exists(), "a failed first start leaves no directory"


@pytest.mark.slow
def test_a_failed_first_start_does_not_block_the_retry(base_model: Path, tmp_path: Path):
    """D8: a start that failed left config.yaml behind and the retry was refused ('already holds a run')."""
    run_dir, data = tmp_path / "run", tmp_path / "problems.jsonl"
    data.write_text('{"problem": "1+1", "answer": "2"}\n{"problem": "2+2", "answer": \n')
    one_stage = ["stages.num_stages=1", "checkpoint.every_updates=0", "logging.tensorboard=false"]
    proc = train(run_dir, base_model, f"data.train_path={data}", *one_stage, check=False)
    assert "problems.jsonl:2" in _error_line(proc), "a bad data line is named by its number (D9)"
    assert not run_dir.exists(), "a failed first start leaves no directory"

    # A start that failed after set-up, before any rollout or checkpoint: only its config and metrics.
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("stages:\n  num_stages: 7\n")
    (run_dir / "metrics.jsonl").write_text('{"step": 0, "wall_s": 1.0, "time": 0.0, "eval/avg_pass@1": 0.5}\n')
    proc = train(run_dir, base_model, *one_stage)
    assert "replacing it" in proc.stderr
    assert [r["step"] for r in records(run_dir) if "train/loss" in r] == [1, 2, 3, 4]
    assert "num_stages: 1" in (run_dir / "config.yaml").read_text()
    assert records(run_dir)[0]["time"] > 0, "the failed start's metrics are gone"


@pytest.mark.slow
def test_convert_a_run_checkpoint_brings_the_tokenizer(uninterrupted: Finished, base_model: Path, tmp_path: Path):
    """D10: `convert megatron-to-hf` from a run checkpoint wrote no tokenizer files."""
    run_dir, out = uninterrupted[0], tmp_path / "hf"
    mugrpo("convert", "megatron-to-hf", "--ckpt", str(run_dir / "checkpoints"), "--out", str(out))
    tokenizer_files = {p.name for p in base_model.iterdir() if p.name.startswith(("tokenizer", "special_tokens"))}
    assert tokenizer_files and tokenizer_files <= {p.name for p in out.iterdir()}
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(str(out))("1+2=")["input_ids"]
