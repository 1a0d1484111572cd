"""The resume policy (which keys may change on an existing run) and the run directory's bookkeeping:
the lock between two real processes, config.yaml written with its history, failed starts."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_mugrpo.config import load_config, save_config
from megatron_mugrpo.resume import (
    ResumeError,
    changed_keys,
    check_same_model,
    continue_config,
    flatten,
    is_safe,
    why_unsafe,
)
from megatron_mugrpo.rundir import (
    CONFIG_FILE,
    HISTORY_FILE,
    RunDirError,
    RunLock,
    RunLockedError,
    claim,
    is_run,
    produced_nothing,
    record_config,
)

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "configs" / "demo_cpu.yaml"


@pytest.mark.parametrize(
    ("key", "safe"),
    [
        ("stages.num_stages", True),
        ("eval.every_updates", True),
        ("eval.benchmarks.0.k", True),
        ("eval", True),
        ("logging.tensorboard", True),
        ("checkpoint.every_updates", True),
        ("checkpoint.every_stages", True),
        ("checkpoint.keep_last", True),
        ("stages.num_stagesX", False),
        ("stages.train_groups", False),
        ("evaluation.x", False),
        ("algo.clip_high", False),
        ("model.tiny.hidden_size", False),
        ("seed", False),
    ],
)
def test_safe_keys_are_prefixes_with_boundaries(key: str, safe: bool) -> None:
    assert is_safe(key) is safe


def test_every_unsafe_section_says_why() -> None:
    assert "stored rollout datasets" in why_unsafe("rollout.group_size")
    assert "weights no longer fit" in why_unsafe("model.tiny.hidden_size")
    assert "old objective" in why_unsafe("algo.mu_grpo.clip_high")  # a section moved under its loss
    assert why_unsafe("seed")  # anything else gets the general reason


def test_changed_keys_compares_shared_keys_only() -> None:
    before = {"algo": {"clip_high": 5.0, "old_name": 1}, "eval": {"benchmarks": [{"k": 4}]}}
    after = {"algo": {"clip_high": 3.0, "new_name": 1}, "eval": {"benchmarks": [{"k": 16}, {"k": 2}]}}
    assert flatten(after)["eval.benchmarks.1.k"] == 2
    # A key renamed by a newer schema is not a change; a list that grew shows in its shared elements.
    assert changed_keys(before, after) == ["algo.clip_high", "eval.benchmarks.0.k"]


def _make_run(run_dir: Path, *overrides: str) -> None:
    run_dir.mkdir()
    record_config(load_config(DEMO, list(overrides)), run_dir, event="train: created")


def test_continue_config_applies_safe_overrides_and_refuses_the_rest(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    _make_run(run_dir, "stages.num_stages=2")
    cfg, changes = continue_config(run_dir, ["stages.num_stages=3", "eval.benchmarks.0.k=8"], load=load_config)
    assert cfg.stages.num_stages == 3 and cfg.eval.benchmarks[0].k == 8
    assert changes == ["stages.num_stages=3", "eval.benchmarks.0.k=8"]
    with pytest.raises(
        ResumeError, match=r"algo\.mu_grpo\.clip_high, rollout\.group_size cannot be overridden on resume"
    ):
        continue_config(
            run_dir, ["algo.mu_grpo.clip_high=3", "rollout.group_size=4", "stages.num_stages=3"], load=load_config
        )
    assert continue_config(run_dir, [], load=load_config)[1] == [], "nothing changed, nothing to record"


def test_hand_edits_are_checked_against_the_recorded_config(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    _make_run(run_dir)
    config = run_dir / CONFIG_FILE
    original = config.read_text()
    config.write_text(original.replace("every_updates: 0", "every_updates: 5", 1))  # eval.every_updates: safe
    cfg, changes = continue_config(run_dir, [], load=load_config)
    assert cfg.eval.every_updates == 5 and changes == ["eval.every_updates edited in config.yaml"]
    config.write_text(original.replace("group_size: 8", "group_size: 16"))
    with pytest.raises(ResumeError, match=r"rollout\.group_size differ in .*config\.yaml.*edited by hand"):
        continue_config(run_dir, [], load=load_config)


def test_without_history_the_latest_checkpoint_is_the_reference(tmp_path: Path, monkeypatch) -> None:
    """Runs written before config_history.json existed: the checkpoint's run_config is compared, and
    the stage count may not drop below the stages the checkpoint finished."""
    from megatron_mugrpo.training import checkpoint

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cfg = load_config(DEMO)
    save_config(cfg, run_dir / CONFIG_FILE)
    step = run_dir / "checkpoints" / "step_00000004"
    metadata = {"run_config": cfg.to_dict(), "trainer_state": {"stage": 2}}
    monkeypatch.setattr(checkpoint, "latest_checkpoint", lambda root: step)
    monkeypatch.setattr(checkpoint, "read_metadata", lambda step_dir: metadata)
    config = run_dir / CONFIG_FILE
    original = config.read_text()
    config.write_text(original.replace("clip_high: 5.0", "clip_high: 3.0"))
    with pytest.raises(ResumeError, match=r"algo\.mu_grpo\.clip_high differ"):
        continue_config(run_dir, [], load=load_config)
    config.write_text(original)
    with pytest.raises(ResumeError, match=r"stages\.num_stages=1: the run has already finished 2 stages"):
        continue_config(run_dir, ["stages.num_stages=1"], load=load_config)
    assert continue_config(run_dir, ["stages.num_stages=2"], load=load_config)[0].stages.num_stages == 2


def test_model_shape_change_is_named() -> None:
    saved = {"model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 100}
    check_same_model(dict(saved), saved, Path("step_1"))
    with pytest.raises(ResumeError, match=r"hidden_size 64 → 128"):
        check_same_model(saved | {"hidden_size": 128}, saved, Path("step_1"))


def test_config_yaml_carries_its_history_and_still_loads(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    _make_run(run_dir)
    cfg = load_config(run_dir / CONFIG_FILE, ["stages.num_stages=9"])
    record_config(cfg, run_dir, event="train --resume: stages.num_stages=9")
    text = (run_dir / CONFIG_FILE).read_text()
    header = text.split("model:")[0]
    assert "train: created" in header and "train --resume: stages.num_stages=9" in header
    assert load_config(run_dir / CONFIG_FILE).stages.num_stages == 9
    history = json.loads((run_dir / HISTORY_FILE).read_text())
    assert [e["event"] for e in history["entries"]] == ["train: created", "train --resume: stages.num_stages=9"]
    assert not list(run_dir.glob("*.tmp")) and not list(run_dir.glob("*.draft"))


# ------------------------------------------------------------------------------------------ lock


def _hold(run_dir: Path) -> subprocess.Popen:
    code = (
        "import sys, time; from pathlib import Path; from megatron_mugrpo.rundir import RunLock; "
        "lock = RunLock.acquire(Path(sys.argv[1])); print('locked', flush=True); time.sleep(600)"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    holder = subprocess.Popen([sys.executable, "-c", code, str(run_dir)], env=env, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    return holder


def test_lock_between_two_processes_names_the_holder_and_dies_with_it(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    holder = _hold(run_dir)
    try:
        with pytest.raises(RunLockedError, match=rf"pid {holder.pid} on host {socket.gethostname()}"):
            RunLock.acquire(run_dir)
    finally:
        os.kill(holder.pid, signal.SIGKILL)  # killed, as a crashed run: the kernel drops its lock
        holder.wait()
    lock = RunLock.acquire(run_dir)
    assert f"pid {os.getpid()}" in (run_dir / ".lock").read_text()
    lock.release()
    lock.release()


def test_claim_replaces_only_a_start_that_produced_nothing(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    _make_run(run_dir)
    (run_dir / "metrics.jsonl").write_text("{}\n")
    (run_dir / "base_model").mkdir()
    assert is_run(run_dir) and produced_nothing(run_dir)
    claimed = claim(run_dir, replace_failed_start=True)
    assert sorted(p.name for p in run_dir.iterdir()) == [".lock", "base_model"], "the cache is kept"
    claimed.abandon()
    assert run_dir.is_dir(), "abandon removes only a directory that set-up created"

    _make_run(tmp_path / "progressed")
    shard = tmp_path / "progressed" / "rollouts" / "stage_000" / "shard_00000.parquet"
    shard.parent.mkdir(parents=True)
    shard.write_bytes(b"x")
    assert not produced_nothing(tmp_path / "progressed")
    with pytest.raises(RunDirError, match="already holds a run"):
        claim(tmp_path / "progressed", replace_failed_start=True)

    fresh = claim(tmp_path / "new")
    fresh.abandon()
    assert not (tmp_path / "new").exists()
