"""End to end: the staged loop through the real engine, converter and Megatron backend (CPU).

A small base model is warm-started once per session (``base_model`` in conftest.py); runs point
`model.hf_dir` at it so each test pays only for its stages. Runs go through the `mugrpo` CLI in
subprocesses, as a user would (under torchrun for several ranks), so the resume tests can SIGKILL
them at named points ($MUGRPO_CRASH_AT) and continue with `--resume`.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from dist_utils import free_port
from e2e_runs import DEMO, EASY_TASK, ROOT, SMALL, built_once, final_weights, mugrpo, records, torchrun, train
from safetensors.torch import load_file


@pytest.mark.slow
def test_end_to_end_run_writes_everything(uninterrupted: tuple[Path, subprocess.CompletedProcess], base_model: Path):
    run_dir, proc = uninterrupted
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("acc_before=") and " acc_after=" in last and " t_total_s=" in last
    for stage in (0, 1):
        manifest = json.loads((run_dir / "rollouts" / f"stage_{stage:03d}" / "manifest.json").read_text())
        assert manifest["complete"] is True and manifest["num_groups"] == 16
    ckpts = run_dir / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step_00000008"
    best = json.loads((run_dir / "best.json").read_text())
    kept = {p.name for p in ckpts.iterdir() if p.name.startswith("step_")}
    # keep_last = 2 newest, plus the best evaluated step, which is never pruned
    assert (
        {"step_00000006", "step_00000008"}
        <= kept
        <= {"step_00000006", "step_00000008", f"step_{best['global_update']:08d}"}
    )
    assert best["checkpoint"] is not None and Path(best["checkpoint"]).is_dir()
    assert (run_dir / "config.yaml").is_file() and any((run_dir / "tensorboard").iterdir())
    assert {p.name for p in (run_dir / "report").glob("*.png")} >= {"eval_accuracy.png", "reward_per_stage.png"}

    recs = records(run_dir)
    updates = [r for r in recs if "train/loss" in r]
    assert [r["step"] for r in updates] == list(range(1, 9))
    # μ = B_train / B_mini = 4 updates per stage; the first update of each stage sees π_θ = β.
    for first in (updates[0], updates[4]):
        assert first["train/rollout_logprob_abs_diff_max"] < 1e-4
    assert any(abs(r["train/loss"]) > 0 for r in updates), "no update had a non-zero advantage"
    for key in (
        "train/clip_frac_low",
        "train/clip_frac_high",
        "train/nav_vetoed_frac",
        "train/nav_trigger_count",
        "train/ratio_mean_neg_adv",
        "train/ratio_p99",
        "train/grad_norm",
        "perf/t_total_s",
    ):
        assert any(key in r for r in recs), key
    for key in (
        "rollout/reward_mean",
        "rollout/solve_all_frac",
        "rollout/solve_none_frac",
        "rollout/response_len_mean",
        "eval/avg_pass@1",
        "perf/t_rollout_s",
        "perf/weight_sync_s",
        "perf/weight_sync_gb_per_s",
        "perf/rollout_tokens_per_s",
    ):
        assert any(key in r for r in recs), key

    start, end = load_file(str(base_model / "model.safetensors")), final_weights(run_dir)
    assert start.keys() == end.keys()
    assert any(not torch.equal(start[k], end[k]) for k in start), "parameters did not change"


@pytest.mark.slow
def test_resume_after_sigkill_equals_uninterrupted(
    tmp_path: Path, base_model: Path, uninterrupted: tuple[Path, subprocess.CompletedProcess]
):
    """Killed after stage 0's generation, then at the first update of stage 1 (after the stage-end
    checkpoint and stage 1's rollout summary, both at step 4): same final weights, every record once,
    and the run's clock (perf/t_total_s) accumulating across the three processes.

    While the run is down, a shard of the complete D_1 is corrupted: the resumed run regenerates that
    shard alone, with D_1's behaviour policy, bit for bit, and says so.
    """
    run_dir = tmp_path / "killed"
    proc = train(run_dir, base_model, crash_at="rollout:0")
    assert proc.returncode == -signal.SIGKILL
    assert json.loads((run_dir / "rollouts" / "stage_000" / "manifest.json").read_text())["complete"]
    proc = mugrpo("train", "--resume", str(run_dir), crash_at="update:5", check=False)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    checkpoint = json.loads((run_dir / "checkpoints" / "step_00000004" / "metadata.json").read_text())
    stage_1 = run_dir / "rollouts" / "stage_001"
    manifest_before, kept = (stage_1 / "manifest.json").read_bytes(), (stage_1 / "shard_00000.arrow").stat()
    damaged = stage_1 / "shard_00001.arrow"
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0xFF
    damaged.write_bytes(bytes(data))
    proc = mugrpo("train", "--resume", str(run_dir))
    assert "Regenerating shard 1 only" in proc.stderr and "does not match its recorded xxh3_128 checksum" in proc.stderr
    # The regenerated shard is the same bytes (so is the manifest that records its checksum); the intact
    # shard was kept as it was.
    assert (stage_1 / "manifest.json").read_bytes() == manifest_before
    assert (stage_1 / "shard_00000.arrow").stat().st_mtime_ns == kept.st_mtime_ns

    expected, got = final_weights(uninterrupted[0]), final_weights(run_dir)
    assert expected.keys() == got.keys()
    for name in expected:
        assert torch.equal(expected[name], got[name]), f"{name} differs after resume"
    recs = records(run_dir)
    steps = [r["step"] for r in recs if "train/loss" in r]
    assert steps == list(range(1, 9)), "each update is logged exactly once after resume"
    assert [r["rollout/stage"] for r in recs if "rollout/stage" in r] == [0.0, 1.0], "one summary per stage"
    assert [r["step"] for r in recs if "eval/avg_pass@1" in r] == [0, 4, 8]
    totals = [r["perf/t_total_s"] for r in recs if "perf/t_total_s" in r]
    assert totals == sorted(totals), f"perf/t_total_s went backwards: {totals}"
    assert totals[-1] > checkpoint["trainer_state"]["timers"]["perf/t_total_s"] > 0
    assert not (run_dir / "report").exists(), "logging.report=false (e2e_runs.SMALL) draws nothing"


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_ranks_with_tensor_parallelism(tmp_path: Path, base_model: Path):
    """torchrun with TP=2: rank 0 owns the engine and the store, both ranks train; π_θ = β at update 1."""
    run_dir = tmp_path / "tp2"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(free_port()),
        "-m",
        "megatron_mugrpo.cli",
        "train",
        "--config",
        str(DEMO),
        "--run-dir",
        str(run_dir),
        f"model.hf_dir={base_model}",
        "parallel.tensor_parallel=2",
        "stages.num_stages=1",
        *SMALL[1:],
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("acc_before=")
    updates = [r for r in records(run_dir) if "train/loss" in r]
    assert [r["step"] for r in updates] == [1, 2, 3, 4]
    assert updates[0]["train/rollout_logprob_abs_diff_max"] < 1e-4
    assert (run_dir / "hf_final" / "model.safetensors").is_file()


@pytest.mark.slow
def test_phase_verbs_replay_one_stage(tmp_path: Path, base_model: Path):
    """`generate` writes D_0 only; `optimize` then makes μ updates on it and checkpoints."""
    run_dir = tmp_path / "phases"
    common = ["--run-dir", str(run_dir), "--stage", "0"]
    mugrpo("generate", "--config", str(DEMO), *common, f"model.hf_dir={base_model}", *SMALL)
    assert json.loads((run_dir / "rollouts" / "stage_000" / "manifest.json").read_text())["complete"]
    assert not (run_dir / "checkpoints").exists()
    mugrpo("optimize", *common)
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_00000004"
    assert [r["step"] for r in records(run_dir) if "train/loss" in r] == [1, 2, 3, 4]


def shard_hashes(store_dir: Path) -> dict[str, str]:
    from megatron_mugrpo.durable import Checksum

    return {p.name: Checksum.of_file(p).hexdigest for p in sorted(store_dir.glob("shard_*.arrow"))}


@pytest.mark.slow
@pytest.mark.multiprocess
def test_generate_on_two_engines_survives_sigkill_and_equals_one_engine(tmp_path: Path, base_model: Path):
    """`mugrpo generate` under torchrun: 2 ranks host 2 engines sharing D_0's 4 shards. The hosts that
    write shards 1 and 2 are SIGKILLed right after (so shard 3, claimed in index order, is never
    reached); the resumed run regenerates only the missing shards, and D_0 is bitwise the one a
    single engine generates."""
    gen = ["--config", str(DEMO), "--stage", "0", f"model.hf_dir={base_model}", *SMALL, "rollout.shard_groups=4"]
    reference = tmp_path / "one_engine"
    mugrpo("generate", "--run-dir", str(reference), *gen)
    expected = shard_hashes(reference / "rollouts" / "stage_000")
    assert len(expected) == 4

    run_dir = tmp_path / "two_engines"
    store = run_dir / "rollouts" / "stage_000"
    proc = torchrun("generate", "--run-dir", str(run_dir), *gen, crash_at="shard:0:1,shard:0:2")
    assert proc.returncode != 0 and not json.loads((store / "manifest.json").read_text())["complete"]
    finished = {p.name: p.stat().st_mtime_ns for p in store.glob("shard_*.arrow") if p.with_suffix(".json").exists()}
    # A host died right after writing shard 1 or 2; torchrun then stopped the other wherever it was.
    assert finished and set(finished) <= {"shard_00000.arrow", "shard_00001.arrow", "shard_00002.arrow"}

    proc = torchrun("generate", "--run-dir", str(run_dir), "--stage", "0")  # the run's own config.yaml
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert proc.stdout.count("rollout dataset complete") == 1  # rank 0 reports
    assert shard_hashes(store) == expected
    assert {name: (store / name).stat().st_mtime_ns for name in finished} == finished  # kept, not regenerated
    assert not list(store.glob("*.claim")) and not list(store.glob("*.tmp"))
    last = [r for r in records(run_dir) if "perf/rollout_engines" in r][-1]
    assert last["perf/rollout_engines"] == 2 and last["perf/rollout_shards_resumed"] == len(finished)


REPLAY = [f"data.builtin_task={EASY_TASK}", "replay.enabled=true", "replay.groups_per_step=4", "replay.tau=1e6"]
"""Headroom-Drift Replay on the small run: K_rep = 4 of the 16 fresh groups per stage. The gate is
opened wide so that stage 1 certainly replays; ``test_replay_gate_rejects_drifted_groups_and_rechecks_slots``
closes it to a τ that rejects some of the same groups."""


@pytest.fixture(scope="session")
def replay_uninterrupted(tmp_path_factory: pytest.TempPathFactory, easy_base_model: Path) -> Path:
    with built_once(tmp_path_factory, "replay_uninterrupted") as shared:
        run_dir, done = shared / "replay_full", shared / "done"
        if not done.is_file():
            shutil.rmtree(run_dir, ignore_errors=True)  # a worker's failed attempt
            train(run_dir, easy_base_model, *REPLAY)
            done.touch()
        return run_dir


@pytest.mark.slow
def test_replay_run_replays_earlier_groups_and_checkpoints_the_buffer(replay_uninterrupted: Path):
    from megatron_mugrpo.algorithms.replay import is_mixed_outcome
    from megatron_mugrpo.rollout.store import RolloutStore

    run_dir = replay_uninterrupted
    recs = records(run_dir)
    plans = [r for r in recs if "replay/accepted" in r]
    assert [r["step"] for r in plans] == [1, 5]  # one decision per stage, at its first update
    assert plans[0]["replay/buffer_groups"] == 0 and plans[0]["replay/accepted"] == 0
    assert plans[1]["replay/accepted"] == min(4, plans[1]["replay/buffer_groups"]) > 0
    assert plans[1]["replay/age_mean"] == 4.0  # generated before update 1, replayed from update 5 on
    gaps = {r["step"]: r["train/rollout_logprob_abs_diff_max"] for r in recs if "train/loss" in r}
    assert gaps[5] < 1e-4, "the first update of a stage stays on-policy"
    # Replayed groups keep their stage-0 log-probs, so updates 6–8 see the policy's drift from them.
    assert max(gaps[s] for s in (6, 7, 8)) > 1e-3

    # The final checkpoint's FIFO: exactly the mixed-outcome groups of D_0 then D_1, in store order.
    mixed = [
        (stage, index)
        for stage in (0, 1)
        for index, group in enumerate(RolloutStore.open(run_dir / "rollouts" / f"stage_{stage:03d}").groups())
        if is_mixed_outcome(group.rewards)
    ]
    state = json.loads((run_dir / "checkpoints" / "step_00000008" / "replay" / "state.json").read_text())
    assert [tuple(entry["key"]) for entry in state["buffer"]["entries"]] == mixed and state["plan"] is None
    assert plans[1]["replay/buffer_groups"] == sum(stage == 0 for stage, _ in mixed)
    mid_stage = json.loads((run_dir / "checkpoints" / "step_00000006" / "replay" / "state.json").read_text())
    assert mid_stage["plan"]["stage"] == 1 and len(mid_stage["plan"]["accepted"]) == plans[1]["replay/accepted"]


@pytest.mark.slow
def test_replay_gate_rejects_drifted_groups_and_rechecks_slots(
    tmp_path: Path, easy_base_model: Path, replay_uninterrupted: Path
):
    """The same run with a gate that bites: τ = the mean drift of the groups the wide-open run scored at
    stage 1. Up to that decision the two runs are identical (same stage 0, same buffer, same order), so
    the same groups are scored with the same drifts, and τ at their mean rejects some and admits some.
    recheck_updates=0 re-checks every slot of stage 1 against the policy of that update."""
    wide = next(r for r in records(replay_uninterrupted) if r["step"] == 5 and "replay/accepted" in r)
    tau = wide["replay/drift_mean"]
    run_dir = tmp_path / "replay_gated"
    overrides = [*REPLAY[:-1], f"replay.tau={tau:.17e}", "replay.max_scored_per_step=4", "replay.recheck_updates=0"]
    train(run_dir, easy_base_model, *overrides)
    recs = records(run_dir)
    plan = next(r for r in recs if r["step"] == 5 and "replay/accepted" in r)
    assert plan["replay/scored"] == wide["replay/scored"] >= 2
    assert plan["replay/drift_mean"] == pytest.approx(wide["replay/drift_mean"], rel=1e-6)  # the same groups
    assert 0 < plan["replay/accepted"] < plan["replay/scored"], "the gate rejected some groups and kept some"
    assert plan["replay/drift_mean_rejected"] > tau >= plan["replay/drift_mean_accepted"]
    rechecks = [r for r in recs if "replay/recheck_scored" in r]
    assert [r["step"] for r in rechecks] == [6, 7, 8][: len(rechecks)] and rechecks
    assert sum(r["replay/recheck_scored"] for r in rechecks) == plan["replay/accepted"]
    assert all(r["replay/recheck_age"] >= 1 for r in rechecks)
    assert [r["step"] for r in recs if "train/loss" in r] == list(range(1, 9))


@pytest.mark.slow
def test_replay_resume_after_sigkill_equals_uninterrupted(
    tmp_path: Path, easy_base_model: Path, replay_uninterrupted: Path
):
    """Killed before stage 1's decision, then mid-stage after it: the restored buffer and decision give
    the same final weights as the uninterrupted run."""
    run_dir = tmp_path / "replay_killed"
    proc = train(run_dir, easy_base_model, *REPLAY, crash_at="rollout:1")
    assert proc.returncode == -signal.SIGKILL
    proc = mugrpo("train", "--resume", str(run_dir), crash_at="update:7", check=False)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    mugrpo("train", "--resume", str(run_dir))

    expected, got = final_weights(replay_uninterrupted), final_weights(run_dir)
    assert expected.keys() == got.keys()
    for name in expected:
        assert torch.equal(expected[name], got[name]), f"{name} differs after resume"
    recs = records(run_dir)
    assert [r["step"] for r in recs if "replay/accepted" in r] == [1, 5], "each decision is logged once"
    assert [r["step"] for r in recs if "train/loss" in r] == list(range(1, 9))
    for key in ("replay/accepted", "replay/scored", "replay/drift_mean", "replay/headroom_mean"):
        want = [r[key] for r in records(replay_uninterrupted) if key in r]
        assert [r[key] for r in recs if key in r] == pytest.approx(want, nan_ok=True), key
