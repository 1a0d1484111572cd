"""A multi-turn search run in async mode through the CLI: the search demo's config under torchrun, rank 0
training and rank 1 a rollout worker that holds the environment (its corpus served on loopback).

The base model's weights are set so that it writes searches (a character Markov chain: attention and MLP
outputs zeroed, every token's embedding picks its successor's logits): an untrained tiny model never writes
``<search>…</search>``, and the run must carry observations to show that their tokens are masked out.
Every trained group is consumed once (the queue cursor, the updates' queue positions), each update's loss
counts exactly the policy tokens of its groups (``train/response_tokens`` is the sum of their policy masks,
fewer than their tokens), the env metrics come with the updates, and the trainer evaluates held-out
questions as trajectories too.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from search_models import searching_model

from megatron_mugrpo.envs.fictional import write_task
from megatron_mugrpo.rollout.queue import RecordIndex, read_shard

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "demo_search_cpu.yaml"
MINI_GROUPS, UPDATES = 2, 2


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def torchrun(*args: str) -> subprocess.CompletedProcess:
    """``mugrpo train ARGS`` on 2 processes (rank 0 trains, rank 1 is the rollout worker), which must exit 0."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_free_port())]
    cmd += ["-m", "megatron_mugrpo.cli", "train", *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env.pop("MUGRPO_CRASH_AT", None)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc


def queue_cursor(run_dir: Path) -> dict:
    """The trainer's queue cursor in the latest checkpoint: ``position``, ``dropped`` and the ``shards`` read."""
    ckpts = run_dir / "checkpoints"
    meta = json.loads((ckpts / (ckpts / "latest").read_text().strip() / "metadata.json").read_text())
    return meta["trainer_state"]["queue"]


def consumed_groups(run_dir: Path, cursor: dict) -> tuple[dict, list]:
    """The queue's shard records by name, and the groups the trainer consumed, in its cursor's order."""
    queue = run_dir / "rollouts" / "queue"
    index = RecordIndex(queue)
    index.refresh()
    consumed = [g for name in cursor["shards"] for g in read_shard(queue, index.records[name])]
    return index.records, consumed[: cursor["position"]]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_an_async_search_run_trains_each_group_once_on_its_policy_tokens(tmp_path: Path, search_run_overrides):
    data = tmp_path / "data"
    write_task(data, 0, people=12, cities=4)
    base, run_dir = searching_model(tmp_path / "base"), tmp_path / "run"
    overrides = search_run_overrides(
        data, base, mini_groups=MINI_GROUPS, updates=UPDATES, mode="async", eval_questions=2
    )
    overrides.append("checkpoint.every_updates=2")
    torchrun("--config", str(CONFIG), "--run-dir", str(run_dir), *overrides)

    updates = [r for r in records(run_dir) if "train/loss" in r]
    assert [r["step"] for r in updates] == list(range(1, UPDATES + 1))
    assert [r["rollout/queue_position"] for r in updates] == [MINI_GROUPS * (u + 1) for u in range(UPDATES)]
    cursor = queue_cursor(run_dir)
    assert cursor["position"] == MINI_GROUPS * UPDATES and cursor["dropped"] == 0
    assert len(set(cursor["shards"])) == len(cursor["shards"])

    # The groups consumed, in the cursor's order: each once, each a batch of trajectories.
    shards, consumed = consumed_groups(run_dir, cursor)
    assert all(record.trajectories and record.env is not None for record in shards.values())
    assert len({g.prompt_id for g in consumed}) == len(consumed)
    samples = [s for g in consumed for s in g.samples]
    assert all(s.policy_mask is not None and len(s.env_seconds) >= 1 for s in samples)
    assert sum(s.policy_mask.count(0) for s in samples) > 0, "no trajectory searched: nothing to mask"
    for s in samples:  # behaviour log-probs exist for policy tokens only
        assert all(lp == 0.0 for lp, m in zip(s.behaviour_logprobs, s.policy_mask) if not m)

    # Observation tokens give no loss terms: each update counts its groups' policy tokens only.
    for u, r in enumerate(updates):
        groups = consumed[u * MINI_GROUPS : (u + 1) * MINI_GROUPS]
        policy = sum(sum(s.policy_mask) for g in groups for s in g.samples)
        assert r["train/response_tokens"] == policy
    assert sum(r["train/response_tokens"] for r in updates) < sum(len(s.response_ids) for s in samples)

    logged = [r for r in updates if "rollout/turns_mean" in r]
    assert logged and all(r["rollout/turns_mean"] >= 1.0 and r["rollout/env_errors"] == 0.0 for r in logged)
    assert any(r["rollout/tool_calls_mean"] > 0 and r["rollout/observation_tokens_mean"] > 0 for r in logged)
    evals = [r for r in records(run_dir) if "eval/search/pass@1" in r]
    assert [r["step"] for r in evals] == [0, UPDATES]  # before training and at the stage's end
