"""Multi-turn rollouts in async mode, in one process: a rollout worker holding an environment generates
trajectories into a queue shard (the rollout store's trajectory columns, under the shard's checksum) with
the batch's environment counts in its record; the trainer's reader hands back the policy masks, which
collate turns into the response mask, and logs the env metrics of the shards an update admitted. A batch
failing beyond env.max_error_frac stops the worker before anything is written, and its error, naming the
environment, reaches the trainer through the worker's failed heartbeat. The config accepts env.enabled with
mode=async and still refuses it with partial rollouts."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pytest

from megatron_mugrpo.asynchronous.config import AsyncConfig
from megatron_mugrpo.asynchronous.files import AsyncPaths
from megatron_mugrpo.asynchronous.liveness import FAILED, Heartbeat, Peer, RankFailedError, read_beat
from megatron_mugrpo.asynchronous.publish import Publication
from megatron_mugrpo.asynchronous.worker import Worker, generate_batch
from megatron_mugrpo.config import load_config
from megatron_mugrpo.envs.base import EnvError, EnvLimits
from megatron_mugrpo.envs.episodes import StageEnv
from megatron_mugrpo.envs.trajectory import Trajectory
from megatron_mugrpo.errors import ConfigError
from megatron_mugrpo.loop.asynchronous import Feed
from megatron_mugrpo.records import RolloutGroup, RolloutSample, collate
from megatron_mugrpo.rewards.qa import QaOptions, QaReward
from megatron_mugrpo.rollout.config import RolloutConfig
from megatron_mugrpo.rollout.prompts import PromptRecord
from megatron_mugrpo.rollout.queue import QueueReader, QueueWriter, RecordIndex, read_shard
from megatron_mugrpo.rollout.shards import StoreError, shard_schema

VOCAB = 128
OBSERVATION = "<information>Paris</information>"
REWARD = QaReward(workers=1, timeout_s=1.0, options=QaOptions())


def ids(text: str) -> list[int]:
    return [ord(c) for c in text]


class _Env:
    stop_strings = ("</answer>",)

    def start(self, problem):
        return object()

    def close(self):
        pass


class _Engine:
    """Scripted trajectories, one per row: (policy text, end reason, error); a search turn, an observation,
    then the scripted turn."""

    name = "scripted"

    def __init__(self, script):
        self.script = script

    def generate_trajectories(self, prompts, episodes, params, *, limits, decode, stop_strings=()):
        search, obs = ids("<search>Ada</search>"), ids(OBSERVATION)
        out = []
        for (text, reason, error), _ in zip(self.script, prompts, strict=True):
            turn = ids(text)
            out.append(
                Trajectory(
                    token_ids=search + obs + turn,
                    policy_mask=[1] * len(search) + [0] * len(obs) + [1] * len(turn),
                    logprobs=[-0.5] * (len(search) + len(turn)),
                    turns=[(0, len(search)), (len(search) + len(obs), len(search) + len(obs) + len(turn))],
                    end_reason=reason,
                    env_seconds=[0.25],
                    tool_calls=1,
                    error=error,
                )
            )
        return out


class _Subscribed:
    current = Publication(name="v00000003-test", version=3, digest="")


class _NoTrainer:
    done = False

    def check(self) -> None:
        pass


def _worker(tmp_path: Path, script, max_error_frac: float = 0.5) -> Worker:
    cfg = SimpleNamespace(
        rollout=RolloutConfig(group_size=2, max_new_tokens=32),
        async_=AsyncConfig(batch_groups=2),
        data=SimpleNamespace(seed=0),
        stages=SimpleNamespace(seed=0, updates_per_stage=4),
        algo=SimpleNamespace(adv_eps=1e-6),
        seed=0,
    )
    role = SimpleNamespace(worker_index=0, describe=lambda: "rollout worker 0")
    worker = Worker(
        cfg=cfg, role=role, paths=AsyncPaths(tmp_path / "run"), trainer=_NoTrainer(), subscription=_Subscribed()
    )
    worker.paths.make()
    worker.engine = _Engine(script)
    worker.env = StageEnv(env=_Env(), name="search", limits=EnvLimits(), max_error_frac=max_error_frac)
    worker.prompts = [
        PromptRecord(prompt_id=f"q{i}", prompt_ids=[1, 2 + i], answer='["Paris"]', text=f"question {i}")
        for i in range(2)
    ]
    worker.tokenizer = SimpleNamespace(decode=lambda token_ids, skip_special_tokens=True: "".join(map(chr, token_ids)))
    worker.reward_fn = REWARD
    worker.queue = QueueWriter(worker.paths.queue, worker=0, vocab_size=VOCAB)
    return worker


GOOD = [("<answer>Paris</answer>", "answered", None), ("<answer>Rome</answer>", "answered", None)] * 2


def _fields(group: RolloutGroup) -> list[tuple]:
    return [
        (s.response_ids, s.behaviour_logprobs, s.policy_mask, [tuple(t) for t in s.turns], s.env_seconds, s.reward)
        for s in group.samples
    ]


def test_a_worker_batch_of_trajectories_reaches_the_trainer_with_its_masks_and_env_counts(tmp_path: Path):
    worker = _worker(tmp_path, GOOD)
    generated = generate_batch(worker, 0)
    assert [s.reward for g in generated for s in g.samples] == [1.0, 0.0, 1.0, 0.0]
    assert all(g.policy_version == 3 and g.samples[0].advantage > 0 > g.samples[1].advantage for g in generated)
    counts = worker.env.tally.counts(2.0)
    record = worker.queue.append(0, generated, publication=worker.holds.name, generate_s=2.0, env=counts)
    assert record.trajectories and record.env["trajectories"] == 4.0 and record.env["turns"] == 8.0

    queue = worker.paths.queue
    on_disk = json.loads((queue / "w000_b0000000.json").read_text())
    assert on_disk["trajectories"] is True and on_disk["env"] == counts
    schema = pa.ipc.open_file(str(queue / "w000_b0000000.arrow")).schema
    assert schema.equals(shard_schema(trajectories=True))  # the rollout store's shard columns, not a copy
    reader = QueueReader(queue)
    reader.admit()
    taken = reader.take(update=3, count=2, max_lag=4).groups
    assert [_fields(g) for g in taken] == [_fields(g) for g in generated]

    # The observation's tokens give no loss terms: collate's response mask is the policy mask.
    batch = collate(taken, pad_id=0)
    sample, start = taken[0].samples[0], len(taken[0].prompt_ids) - 1
    n = len(sample.response_ids)
    assert batch.response_mask[0, start : start + n].tolist() == [float(m) for m in sample.policy_mask]
    assert batch.response_mask[0].sum().item() == sum(sample.policy_mask) == n - len(OBSERVATION)

    # The next batch's record counts that batch only.
    generate_batch(worker, 1)
    assert worker.env.tally.trajectories == 4


def test_the_trainer_logs_the_env_metrics_of_the_shards_an_update_admitted(tmp_path: Path):
    worker = _worker(tmp_path, GOOD)
    for batch in range(2):
        generated = generate_batch(worker, batch)
        worker.queue.append(batch, generated, publication="p", generate_s=2.0, env=worker.env.tally.counts(2.0))
    feed = Feed(paths=worker.paths, is_writer=True, hosts=None, reader=QueueReader(worker.paths.queue))
    feed.admitted = feed.reader.admit()
    taken = feed.reader.take(update=3, count=2, max_lag=4)
    metrics = feed.update_metrics(taken, started=0.0)
    assert metrics["rollout/turns_mean"] == 2.0 and metrics["rollout/tool_calls_mean"] == 1.0
    assert metrics["rollout/env_seconds"] == 8 * 0.25 and metrics["rollout/env_errors"] == 0.0
    assert metrics["rollout/observation_tokens_mean"] == len(OBSERVATION)
    assert "rollout/turns_mean" not in feed.update_metrics(taken, started=0.0)  # nothing new admitted


def test_a_batch_failing_beyond_the_budget_stops_the_worker_naming_the_env_through_its_heartbeat(tmp_path: Path):
    failing = [("x", "env_error", "ConnectionError: refused")] * 2 + GOOD[:2]
    worker = _worker(tmp_path, failing, max_error_frac=0.25)
    beat = worker.paths.worker_heartbeat(0)
    trainer_view = Peer(beat, "rollout worker 0 (rank 1)", timeout_s=60, startup_s=60)
    with pytest.raises(EnvError), Heartbeat(beat, interval_s=0.01):  # as run_worker holds it
        generate_batch(worker, 0)
    assert read_beat(beat).status == FAILED
    with pytest.raises(RankFailedError, match=r"failed: EnvError: 2 of 4 trajectories failed in environment 'search'"):
        trainer_view.check()
    assert not list(worker.paths.queue.iterdir())  # nothing written for the failed batch


def test_a_queue_shard_holds_trajectories_for_every_response_or_none(tmp_path: Path):
    worker = _worker(tmp_path, GOOD)
    groups = generate_batch(worker, 0)
    groups[1].samples.append(
        RolloutSample(response_ids=[5, 6], behaviour_logprobs=[-1.0, -1.0], finish_reason="stop", reward=0.0)
    )
    with pytest.raises(StoreError, match=r"worker 0 batch 0: 1 of 5 responses are single-turn"):
        worker.queue.append(0, groups)
    assert not list(worker.paths.queue.glob("*.arrow"))


def test_a_record_that_disowns_its_trajectory_columns_is_refused(tmp_path: Path):
    worker = _worker(tmp_path, GOOD)
    worker.queue.append(0, generate_batch(worker, 0))
    queue = worker.paths.queue
    record = RecordIndex(queue).refresh()[0]
    record.trajectories = False
    with pytest.raises(StoreError, match=r"rollout queue: .* has columns .*policy_mask"):
        read_shard(queue, record)


def test_async_mode_accepts_an_environment_but_not_with_partial_rollouts(qa_overrides: list[str]):
    cfg = load_config("configs/demo_async_cpu.yaml", qa_overrides)
    assert cfg.mode == "async" and cfg.env.enabled
    with pytest.raises(ConfigError, match=r"env\.enabled cannot be combined with async\.partial_rollout=true"):
        load_config("configs/demo_async_cpu.yaml", [*qa_overrides, "async.partial_rollout=true"])
