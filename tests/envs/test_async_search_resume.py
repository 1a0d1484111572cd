"""An async multi-turn search run whose rollout worker is SIGKILLed with a half-written queue shard, then resumed.

The worker (rank 1, holding the loopback search server) dies after its second shard's data (batch 1, with its
routes) is in place but before the shard's record is (``MUGRPO_CRASH_AT=worker:0:shard:2``: the count of shards
the process wrote, from 1); the trainer is then SIGKILLed too, as when the node holding both dies. (The ranks are
launched by hand for that: under torchrun the trainer would get SIGTERM, which it takes as a preemption to
checkpoint at its next update, which cannot come without the worker, and torchrun waits 30 s before its SIGKILL.) The
resumed run rewrites that batch, leaves no orphan, and trains every group exactly once: the trainer's cursor
covers each update's groups in order, no shard twice, no prompt twice, and each update's loss counts exactly
the policy tokens of the groups it consumed.

The base model is the tiny Qwen3-MoE that writes searches (``test_moe_search_run``), under
moe.routing_replay=rollout: the worker records every trajectory position's experts (observations included),
each queue shard carries them in its ``.routes.arrow``, and the trainer replays them; the first update trains
on β's own weights, so its routing agrees with the recorded experts everywhere (train/routing_agreement 1.0).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
from search_models import searching_model
from test_async_search_run import CONFIG, ROOT, _free_port, consumed_groups, queue_cursor, records, torchrun

from megatron_mugrpo.commands import train_argv
from megatron_mugrpo.envs.fictional import write_task

MINI_GROUPS, UPDATES = 2, 2


def run_killed(cmd: list[str], crash_at: str) -> int:
    """Rank 0 (trainer) and rank 1 (worker, crashing at ``crash_at``) of ``cmd``; once the worker has died, the
    trainer is SIGKILLed. Returns the worker's exit code."""
    ranks = dict(WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", **ranks)
    env.pop("MUGRPO_CRASH_AT", None)
    quiet = {"cwd": ROOT, "stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    trainer = subprocess.Popen(cmd, env=dict(env, RANK="0", LOCAL_RANK="0"), **quiet)
    try:
        worker = subprocess.Popen(cmd, env=dict(env, RANK="1", LOCAL_RANK="1", MUGRPO_CRASH_AT=crash_at), **quiet)
        try:
            return worker.wait(timeout=600)
        finally:
            worker.kill()
            worker.wait()
    finally:
        trainer.kill()
        trainer.wait()


def orphans(queue: Path) -> list[str]:
    """Shards (data or routes file) of worker 0 in place without their record."""
    names = {p.name.split(".")[0] for p in queue.glob("w000_*.arrow")}
    return sorted(name for name in names if not (queue / f"{name}.json").exists())


@pytest.mark.slow
@pytest.mark.multiprocess
def test_an_async_search_run_resumes_a_killed_worker_and_trains_each_group_once(tmp_path: Path, search_run_overrides):
    data = tmp_path / "data"
    write_task(data, 0, people=12, cities=4)
    base, run_dir = searching_model(tmp_path / "base", moe=True), tmp_path / "run"
    overrides = search_run_overrides(data, base, mini_groups=MINI_GROUPS, updates=UPDATES, mode="async")
    overrides += ["moe.routing_replay=rollout", "checkpoint.every_updates=1"]
    worker_rc = run_killed(train_argv(CONFIG, run_dir, overrides), crash_at="worker:0:shard:2")
    assert worker_rc == -signal.SIGKILL
    queue = run_dir / "rollouts" / "queue"
    assert orphans(queue) == ["w000_b0000001"], "expected batch 1 half-written"
    assert (queue / "w000_b0000001.routes.arrow").is_file()  # its routes too, as the shard, before the record

    torchrun("--resume", str(run_dir))
    assert orphans(queue) == []
    assert not list(queue.glob("*.tmp"))
    batches = sorted(json.loads(p.read_text())["batch"] for p in queue.glob("w*_b*.json"))
    assert batches == list(range(len(batches))), "a batch index was skipped or written twice"

    updates = [r for r in records(run_dir) if "train/loss" in r]
    assert [r["step"] for r in updates] == list(range(1, UPDATES + 1))  # each update logged once across the kill
    assert [r["rollout/queue_position"] for r in updates] == [MINI_GROUPS * (u + 1) for u in range(UPDATES)]
    cursor = queue_cursor(run_dir)
    assert cursor["position"] == MINI_GROUPS * UPDATES and cursor["dropped"] == 0
    assert len(set(cursor["shards"])) == len(cursor["shards"])
    shards, consumed = consumed_groups(run_dir, cursor)
    assert all(shards[name].trajectories and shards[name].routes for name in cursor["shards"])
    assert len({g.prompt_id for g in consumed}) == len(consumed) == MINI_GROUPS * UPDATES
    samples = [s for g in consumed for s in g.samples]
    assert sum(s.policy_mask.count(0) for s in samples) > 0, "no trajectory searched: nothing to mask"
    for group in consumed:  # routes of every position the trainer forwards, observations included
        assert all(s.routes.shape == (len(group.prompt_ids) + len(s.response_ids) - 1, 2, 2) for s in group.samples)
    assert updates[0]["train/routing_agreement"] == 1.0
    assert all(0.0 < r["train/routing_agreement"] <= 1.0 for r in updates)
    for u, r in enumerate(updates):  # each update trained exactly its own groups' policy tokens
        groups = consumed[u * MINI_GROUPS : (u + 1) * MINI_GROUPS]
        assert r["train/response_tokens"] == sum(sum(s.policy_mask) for g in groups for s in g.samples)
