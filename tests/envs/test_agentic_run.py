"""A multi-turn search run through the CLI, SIGKILLed in the middle of a stage's generation and resumed.

The run serves its corpus on loopback (no env.search.url), rolls out trajectories into the store, trains
on them, logs the env metrics, and evaluates held-out questions as trajectories too. Killed after stage
1's first shard, the resumed run generates the missing shard only and ends with the same weights, bit for
bit, and the same trajectories (tokens, behaviour log-probs, policy masks, turns, rewards) as an
uninterrupted run. The environment's seconds, also stored, are wall-clock measurements and are the one
field allowed to differ.
"""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

import pytest
import torch

from megatron_mugrpo.envs.fictional import write_task
from megatron_mugrpo.rollout.store import RolloutStore

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from e2e_runs import DEMO, final_weights, mugrpo, records

RUN = [
    "data.format=qa",
    "reward.kind=qa",
    "eval.benchmarks.0.name=search",
    "eval.benchmarks.0.format=qa",
    "eval.benchmarks.0.limit=4",
    "eval.benchmarks.0.k=2",
    "eval.max_new_tokens=12",
    "env.enabled=true",
    "env.search.topk=2",
    "env.max_total_tokens=448",
    "env.max_observation_tokens=128",
    "model.tiny.max_position_embeddings=448",
    "warmstart.steps=0",
    "rollout.max_prompt_tokens=320",
    "rollout.max_new_tokens=12",
    "rollout.group_size=4",
    "rollout.shard_groups=2",
    "stages.num_stages=2",
    "stages.train_groups=4",
    "stages.mini_groups=2",
    "parallel.micro_batch_size=8",
    "checkpoint.every_updates=2",
    "optim.lr=1e-3",
    "logging.progress_bars=false",
    "logging.report=false",
    "rollout.cpu_threads=1",
]


def trajectories(run_dir: Path, stage: int) -> list[tuple]:
    store = RolloutStore.open(run_dir / "rollouts" / f"stage_{stage:03d}")
    return [
        (s.response_ids, s.behaviour_logprobs, s.policy_mask, [tuple(t) for t in s.turns], s.reward, s.reward_reason)
        for g in store.groups()
        for s in g.samples
    ]


@pytest.mark.slow
def test_a_search_run_killed_mid_stage_resumes_bitwise(tmp_path: Path):
    data = tmp_path / "data"
    write_task(data, 0, people=12, cities=4)
    run = [f"data.train_path={data / 'train.jsonl'}", f"env.search.corpus={data / 'corpus.jsonl'}", *RUN]
    run.append(f"eval.benchmarks.0.path={data / 'test.jsonl'}")  # held-out questions, solved with the env
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    mugrpo("train", "--config", str(DEMO), "--run-dir", str(whole), *run)
    proc = mugrpo("train", "--config", str(DEMO), "--run-dir", str(killed), *run, crash_at="shard:1:0", check=False)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    stage_1 = killed / "rollouts" / "stage_001"
    assert not json.loads((stage_1 / "manifest.json").read_text())["complete"]
    assert (stage_1 / "shard_00000.arrow").is_file() and not (stage_1 / "shard_00001.arrow").exists()
    mugrpo("train", "--resume", str(killed))

    expected, got = final_weights(whole), final_weights(killed)
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[name], got[name]) for name in expected), "weights differ after resume"
    for stage in (0, 1):
        assert trajectories(killed, stage) == trajectories(whole, stage)
    sample = RolloutStore.open(whole / "rollouts" / "stage_000").groups([0])[0].samples[0]
    assert sample.policy_mask is not None and len(sample.env_seconds) == len(sample.turns) >= 1
    logged = [r for r in records(whole) if "rollout/turns_mean" in r]
    assert len(logged) == 2 and all(r["rollout/turns_mean"] >= 1.0 and r["rollout/env_errors"] == 0 for r in logged)
    evals = [r for r in records(whole) if "eval/search/pass@1" in r]
    assert [r["step"] for r in evals] == [0, 2, 4]  # before training and after each stage, multi-turn
    manifest = json.loads((whole / "rollouts" / "stage_000" / "manifest.json").read_text())
    assert manifest["sampling"]["env"]["search"]["topk"] == 2  # another env never completes this store
