"""End to end, async mode: a trainer rank and a rollout worker rank through the `mugrpo` CLI (CPU).

Runs go through torchrun with two processes (rank 0 trains, rank 1 generates), as a user launches
them; the resume test SIGKILLs either side at named points ($MUGRPO_CRASH_AT) and continues with
`--resume`; the dead-worker test launches the two ranks by hand, as separate nodes would be, so that
nothing but the trainer itself notices that the worker is gone. One run has two rollout workers
(three processes), one of them SIGKILLed and the run resumed. Weights go from memory
(async.publish=memory, the default) in every run; the bounded-lag run also runs with async.publish=disk.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatron_mugrpo.commands import train_argv

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "demo_async_cpu.yaml"
MINI_GROUPS = 4
UPDATES = 8
SMALL = [
    "stages.num_stages=2",
    "stages.train_groups=16",
    f"stages.mini_groups={MINI_GROUPS}",
    "parallel.micro_batch_size=16",
    "rollout.max_new_tokens=40",
    "async.batch_groups=4",
    "async.first_batch_groups=2",  # batches of 2, then 4 groups: the ramp's prompt ranges across crashes too
    "async.queue_groups=8",
    "eval.benchmarks.0.limit=16",
    "eval.benchmarks.0.k=2",
    "checkpoint.every_updates=2",
    "logging.progress_bars=false",
    "logging.report=false",  # drawn by the bounded-lag run only
    "optim.lr=1e-4",
]
TIMEOUT_S = 900


def _env(crash_at: str | None = None, **extra: str) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", **extra)
    env.pop("MUGRPO_CRASH_AT", None)
    if crash_at:
        env["MUGRPO_CRASH_AT"] = crash_at
    return env


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun(*args: str, crash_at: str | None = None, nproc: int = 2) -> subprocess.CompletedProcess:
    """`mugrpo train ARGS` on ``nproc`` processes: rank 0 trains, the others are rollout workers."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc)]
    cmd += ["--master_port", str(_free_port())]
    cmd += ["-m", "megatron_mugrpo.cli", "train", *args]
    return subprocess.run(cmd, cwd=ROOT, env=_env(crash_at), capture_output=True, text=True, timeout=TIMEOUT_S)


def start(
    run_dir: Path, base: Path, *extra: str, crash_at: str | None = None, nproc: int = 2
) -> subprocess.CompletedProcess:
    args = ["--config", str(CONFIG), "--run-dir", str(run_dir), f"model.hf_dir={base}", *SMALL, *extra]
    return torchrun(*args, crash_at=crash_at, nproc=nproc)


def resume(run_dir: Path, crash_at: str | None = None, nproc: int = 2) -> subprocess.CompletedProcess:
    return torchrun("--resume", str(run_dir), crash_at=crash_at, nproc=nproc)


def ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def queue_records(run_dir: Path) -> dict[str, dict]:
    queue = run_dir / "rollouts" / "queue"
    return {p.stem: json.loads(p.read_text()) for p in queue.glob("w*_b*.json")}


def final_cursor(run_dir: Path) -> dict:
    ckpts = run_dir / "checkpoints"
    meta = json.loads((ckpts / (ckpts / "latest").read_text().strip() / "metadata.json").read_text())
    return meta["trainer_state"]["queue"]


def check_exactly_once(run_dir: Path, unread: int = 2 * 4) -> list[dict]:
    """Every update logged once; each consumed B_mini groups plus what it dropped, from where the last
    one stopped; everything written is consumed or still in the queue, no shard twice. ``unread``:
    admitted groups the trainer may have left unconsumed at the end."""
    updates = [r for r in records(run_dir) if "train/loss" in r]
    assert [r["step"] for r in updates] == list(range(1, UPDATES + 1))
    position = 0
    for r in updates:
        position += MINI_GROUPS + r["rollout/dropped_groups"]
        assert r["rollout/queue_position"] == position, f"update {r['step']} consumed out of turn"
    cursor, written = final_cursor(run_dir), queue_records(run_dir)
    assert cursor["position"] == position
    assert len(set(cursor["shards"])) == len(cursor["shards"]) and set(cursor["shards"]) <= set(written)
    consumed_shards = sum(written[name]["groups"] for name in cursor["shards"])
    assert cursor["position"] <= consumed_shards <= cursor["position"] + unread
    assert cursor["dropped"] == sum(r["rollout/dropped_groups"] for r in updates)
    return updates


@pytest.fixture(scope="module")
def base_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from megatron_mugrpo.config import load_config
    from megatron_mugrpo.warmstart import prepare_base_model

    cfg = load_config(ROOT / "configs" / "demo_cpu.yaml", ["warmstart.steps=150"])
    return prepare_base_model(cfg, tmp_path_factory.mktemp("base") / "model")


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("publish", ["memory", "disk"])
def test_async_run_streams_groups_with_bounded_lag(tmp_path: Path, base_model: Path, publish: str):
    """max_lag = sync_every (async GRPO's setting): no trained group is older than one sync interval,
    the worker's weights equal each publication, and every group is accounted for; with weights
    broadcast from memory (the default) and written to disk."""
    run_dir = tmp_path / "async"
    extra = ["async.sync_every=2", "async.max_lag=2", "async.verify_weights=true", f"async.publish={publish}"]
    proc = ok(start(run_dir, base_model, *extra, "logging.report=true"))
    assert proc.stdout.strip().splitlines()[-1].startswith("acc_before=")
    assert "rollout queue:" in proc.stdout

    updates = check_exactly_once(run_dir)
    assert max(r["rollout/lag_max"] for r in updates) <= 2
    assert all(0 <= r["rollout/lag_mean"] <= r["rollout/lag_max"] for r in updates)
    assert updates[0]["train/rollout_logprob_abs_diff_max"] < 1e-4  # fresh weights: π_θ = β at update 1
    assert all(0.0 <= r["perf/trainer_idle_ratio"] <= 1.0 for r in updates)
    assert any("perf/rollout_idle_ratio" in r for r in updates)
    assert sum("perf/weight_sync_s" in r for r in updates) == UPDATES // 2
    sent = [r["perf/weight_sync_mib"] for r in updates if "perf/weight_sync_mib" in r]  # memory publications
    assert len(sent) == (UPDATES // 2 if publish == "memory" else 0) and all(mib > 0 for mib in sent)
    directories = [p for p in (run_dir / "async" / "weights").iterdir() if p.is_dir()]
    assert len(directories) == (1 if publish == "memory" else min(1 + UPDATES // 2, 4))  # memory: the first only
    ack = json.loads((run_dir / "async" / "acks" / "worker_000.json").read_text())
    assert ack["version"] >= 2 and ack["digest"]  # what the worker serves, acknowledged
    assert [r["rollout/stage"] for r in records(run_dir) if "rollout/stage" in r] == [0.0, 1.0]

    # The worker's weights equal the trainer's publication for every batch (the trainer checks it too).
    digests = {}
    for line in (run_dir / "async" / "weights" / "publications.jsonl").read_text().splitlines():
        entry = json.loads(line)
        digests[entry["name"]] = entry["digest"]
    written = queue_records(run_dir).values()
    assert all(r["weights_digest"] and r["weights_digest"] == digests[r["publication"]] for r in written)
    assert len({r["policy_version"] for r in written}) > 1, "the worker never picked up new weights"
    sizes = {r["batch"]: r["groups"] for r in written}  # async.first_batch_groups=2, then batch_groups=4
    assert sizes[0] == 2 and all(groups == 4 for batch, groups in sizes.items() if batch > 0), sizes

    assert {p.name for p in (run_dir / "report").glob("*.png")} >= {"async_lag.png", "idle_ratio.png"}
    start_w, end_w = (
        load_file(str(base_model / "model.safetensors")),
        load_file(str(run_dir / "hf_final" / "model.safetensors")),
    )
    assert any(not torch.equal(start_w[k], end_w[k]) for k in start_w), "parameters did not change"


@pytest.mark.slow
@pytest.mark.multiprocess
def test_partial_rollouts_switch_weights_mid_batch(tmp_path: Path, base_model: Path):
    """async.partial_rollout=true with a publication after every update: the worker applies some in the
    middle of a batch, so responses span two versions; every token's version reaches the trainer, whose
    drops and lags use a group's oldest token, and every group is still accounted for."""
    from megatron_mugrpo.rollout.queue import RecordIndex, read_shard

    run_dir = tmp_path / "partial"
    extra = ["async.sync_every=1", "async.max_lag=3", "async.verify_weights=true", "async.partial_rollout=true"]
    ok(start(run_dir, base_model, *extra, "eval.benchmarks=[]"))
    updates = check_exactly_once(run_dir)
    assert all(r["rollout/lag_max"] <= 3 for r in updates)  # max_lag holds for the oldest token
    assert all(0 <= r["rollout/token_lag_mean"] <= r["rollout/token_lag_max"] <= r["rollout/lag_max"] for r in updates)
    queue = run_dir / "rollouts" / "queue"
    shards = RecordIndex(queue).refresh()
    assert shards and all(record.token_versions for record in shards)
    spans = [
        sorted(set(sample.versions))
        for record in shards
        for group in read_shard(queue, record)
        for sample in group.samples
    ]
    assert all(spans) and any(len(span) > 1 for span in spans), "no response spanned two publications"


@pytest.mark.slow
@pytest.mark.multiprocess
def test_async_moe_run_replays_the_routes_its_worker_recorded(tmp_path: Path):
    """A tiny Qwen3-MoE (4 experts, top-2) in async mode with moe.routing_replay=rollout: the worker's
    engine records every token's experts, each queue shard carries them in its .routes.arrow, and every
    update replays them (train/routing_agreement says how often fresh routing would have agreed)."""
    from megatron_mugrpo.rollout.queue import ROUTES_SUFFIX
    from megatron_mugrpo.training.tiny import tiny_hf_dir

    base = tiny_hf_dir(tmp_path / "moe" / "model", "qwen3_moe", seed=0, tie_word_embeddings=True)
    run_dir = tmp_path / "moe_async"
    ok(start(run_dir, base, "moe.routing_replay=rollout", "rollout.max_new_tokens=24", "eval.benchmarks=[]"))
    updates = check_exactly_once(run_dir)
    queue = run_dir / "rollouts" / "queue"
    shards = sorted(p.name.removesuffix(".json") for p in queue.glob("w*_b*.json"))
    assert shards and sorted(p.name.removesuffix(ROUTES_SUFFIX) for p in queue.glob(f"*{ROUTES_SUFFIX}")) == shards
    assert all(0.0 < r["train/routing_agreement"] <= 1.0 for r in updates)
    start_w = load_file(str(base / "model.safetensors"))
    end_w = load_file(str(run_dir / "hf_final" / "model.safetensors"))
    assert any(not torch.equal(start_w[k], end_w[k]) for k in start_w if ".mlp.experts." in k), "experts unchanged"


@pytest.mark.slow
@pytest.mark.multiprocess
def test_exactly_once_across_sigkill_of_each_side(tmp_path: Path, base_model: Path):
    """The trainer is killed after update 3 (checkpoint at 2); resumed, the worker is killed with a
    half-written shard; resumed again, the run ends with every group trained once or still queued."""
    run_dir = tmp_path / "killed"
    proc = start(run_dir, base_model, "eval.benchmarks=[]", crash_at="update:3")  # evaluation: tested elsewhere
    assert proc.returncode != 0 and "exitcode  : -9" in proc.stderr, proc.stderr[
        -3000:
    ]  # torchrun reports the SIGKILLed trainer

    proc = resume(run_dir, crash_at="worker:0:shard:1")
    assert proc.returncode != 0 and "exitcode  : -9" in proc.stderr, proc.stderr[-3000:]
    queue = run_dir / "rollouts" / "queue"
    orphans = [p.name for p in queue.glob("w000_*.arrow") if not p.with_suffix(".json").exists()]
    assert len(orphans) == 1, f"expected one half-written shard, got {orphans}"

    ok(resume(run_dir))
    assert not [p for p in queue.glob("w000_*.arrow") if not p.with_suffix(".json").exists()]
    assert not list(queue.glob("*.tmp"))
    batches = sorted(r["batch"] for r in queue_records(run_dir).values())
    assert batches == list(range(len(batches))), "a batch index was skipped or written twice"
    check_exactly_once(run_dir)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_dead_worker_stops_the_trainer_with_its_name(tmp_path: Path, base_model: Path):
    """Ranks launched by hand (as on separate nodes): the worker dies, the trainer says so and exits."""
    run_dir, port = tmp_path / "dead", str(_free_port())
    cmd = train_argv(
        CONFIG,
        run_dir,
        [
            f"model.hf_dir={base_model}",
            *SMALL,
            "async.worker_timeout_s=20",
            "async.startup_timeout_s=120",
            "eval.benchmarks=[]",
        ],
    )
    ranks = dict(WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    worker = subprocess.Popen(
        cmd, cwd=ROOT, env=_env("worker:0:shard:1", RANK="1", LOCAL_RANK="1", **ranks), stderr=subprocess.PIPE
    )
    try:
        trainer = subprocess.run(
            cmd,
            cwd=ROOT,
            env=_env(RANK="0", LOCAL_RANK="0", **ranks),
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
        )
    finally:
        worker.kill()
        worker.communicate()
    assert worker.returncode == -signal.SIGKILL
    assert trainer.returncode == 1, trainer.stderr[-3000:]
    last = trainer.stderr.strip().splitlines()[-1]
    assert last.startswith("error: rollout worker 0 (rank 1) has sent no heartbeat for"), last
    assert "Traceback" not in trainer.stderr


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_trainer_signalled_while_it_waits_for_groups_checkpoints_and_stops_at_once(tmp_path: Path, base_model: Path):
    """SIGTERM reaches the trainer while it waits for groups that will not come (its worker died, as
    torchrun then signals the survivors): it stops at that update boundary (at update 0 without a
    checkpoint: the base model is one) and exits 75 with the marker, instead of waiting for an update
    that never comes (or for async.worker_timeout_s)."""
    from megatron_mugrpo.loop.preemption import EXIT_PREEMPTED, MARKER

    run_dir, port = tmp_path / "signalled", str(_free_port())
    patient = [f"model.hf_dir={base_model}", *SMALL, "async.worker_timeout_s=600", "eval.benchmarks=[]"]
    cmd = train_argv(CONFIG, run_dir, patient)
    ranks = dict(WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    worker = subprocess.Popen(
        cmd, cwd=ROOT, env=_env("worker:0:shard:1", RANK="1", LOCAL_RANK="1", **ranks), stderr=subprocess.DEVNULL
    )
    trainer = subprocess.Popen(
        cmd, cwd=ROOT, env=_env(RANK="0", LOCAL_RANK="0", **ranks), stderr=subprocess.PIPE, text=True
    )
    try:
        assert worker.wait(timeout=TIMEOUT_S) == -signal.SIGKILL  # died at its first shard: no group comes
        trainer.send_signal(signal.SIGTERM)
        _, stderr = trainer.communicate(timeout=TIMEOUT_S)
    finally:
        for proc in (worker, trainer):
            proc.kill()
            proc.wait()
    assert trainer.returncode == EXIT_PREEMPTED, stderr[-3000:]
    assert "preempted by SIGTERM" in stderr and "Traceback" not in stderr
    assert json.loads((run_dir / MARKER).read_text())["signal"] == "SIGTERM"
    # Update 0: nothing to save (a resume starts from the base model); a step-0 optimizer checkpoint has no
    # state to load and made the resume of a SIGKILLed worker's run fail (test below)
    assert not (run_dir / "checkpoints" / "latest").exists()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_workers_feed_one_trainer_exactly_once_across_a_sigkill(tmp_path: Path, base_model: Path):
    """Three processes: the trainer and rollout workers 0 and 1 (async.rollout_ranks=2). Worker 1 is
    SIGKILLed with its second shard half-written; resumed, the run consumes every group once, in
    arrival order, from both workers; the weights each worker sampled with equal a publication (hashed
    and checked); no trained group is older than max_lag, so with max_lag < the run's updates the
    workers together picked up new weights; every prompt was generated once, by one worker.

    Which worker generates which batch at which version depends on timing (a loaded machine may let one
    worker write every late batch), so only what the protocol guarantees is asserted per worker."""
    from megatron_mugrpo.rollout.queue import RecordIndex, read_shard

    run_dir = tmp_path / "two"
    extra = ["async.rollout_ranks=2", "async.sync_every=2", "async.max_lag=4", "async.verify_weights=true"]
    proc = start(run_dir, base_model, *extra, "eval.benchmarks=[]", crash_at="worker:1:shard:2", nproc=3)
    assert proc.returncode != 0 and "exitcode  : -9" in proc.stderr, proc.stderr[-3000:]
    ok(resume(run_dir, nproc=3))

    # Each worker may have a batch admitted beyond the queue bound when the run ends.
    updates = check_exactly_once(run_dir, unread=8 + 2 * 4)
    assert max(r["rollout/lag_max"] for r in updates) <= 4  # async.max_lag, whoever generated the group
    queue = run_dir / "rollouts" / "queue"
    assert not [p for p in queue.glob("w*.arrow") if not p.with_suffix(".json").exists()]
    written = queue_records(run_dir).values()
    digests = {}
    for line in (run_dir / "async" / "weights" / "publications.jsonl").read_text().splitlines():
        entry = json.loads(line)
        digests[entry["name"]] = entry["digest"]
    consumed = set(final_cursor(run_dir)["shards"])
    for worker in (0, 1):
        mine = [r for r in written if r["worker"] == worker]
        assert sorted(r["batch"] for r in mine) == list(range(len(mine))), f"worker {worker} skipped a batch"
        assert any(r["name"] in consumed for r in mine), f"nothing of worker {worker} was trained on"
        assert all(r["weights_digest"] == digests[r["publication"]] for r in mine)
    # The last update's groups are at most max_lag = 4 < 7 updates old, so some worker sampled them with
    # weights published after update 0; which worker did is up to the scheduler.
    consumed_versions = {r["policy_version"] for r in written if r["name"] in consumed}
    assert max(consumed_versions) > 0, f"no trained group was sampled with new weights: {consumed_versions}"
    index = RecordIndex(queue)
    index.refresh()
    prompts = [g.prompt_id for record in index.records.values() for g in read_shard(queue, record)]
    assert len(prompts) == len(set(prompts)), "a prompt was generated twice"


def test_async_on_a_single_process_is_a_clear_error(tmp_path: Path):
    cmd = train_argv(CONFIG, tmp_path / "r")
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("error: mode: async runs rollout workers and trainers on separate ranks")
    assert not (tmp_path / "r").exists()
