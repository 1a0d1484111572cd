"""The ``env`` section inside a run's config: off by default, and refused, with the key to change, wherever
the run could not roll out multi-turn trajectories."""

from __future__ import annotations

import json

import pytest

from megatron_mugrpo.config import load_config
from megatron_mugrpo.errors import ConfigError


@pytest.fixture
def qa_overrides(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"question": "Where was Ada born?", "answers": ["Veloria"]}) + "\n")
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps({"id": "0", "title": "Ada", "text": "Ada was born in Veloria."}) + "\n")
    return [
        f"data.train_path={data}",
        "data.format=qa",
        "reward.kind=qa",
        "eval.benchmarks=[]",
        "env.enabled=true",
        f"env.search.corpus={corpus}",
    ]


def test_the_env_section_is_off_by_default():
    cfg = load_config("configs/demo_cpu.yaml")
    assert cfg.env.enabled is False and cfg.env.kind == "search" and cfg.env.max_turns == 4


def test_a_qa_run_with_a_corpus_accepts_the_env_section(qa_overrides):
    cfg = load_config("configs/demo_cpu.yaml", [*qa_overrides, "env.max_turns=3", "env.search.topk=2"])
    assert cfg.env.enabled and cfg.env.max_turns == 3 and cfg.env.search.topk == 2


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["rollout.engine=sglang"], r"rollout\.engine='sglang' cannot decode multi-turn"),
        (["rollout.allocation=vigor"], r"rollout\.allocation=fixed only"),
        (["env.search.corpus="], r"env\.search\.url .* or env\.search\.corpus"),
        (["env.max_turns=0"], r"env\.max_turns=0 must be >= 1"),
    ],
)
def test_runs_that_cannot_roll_out_trajectories_are_refused(qa_overrides, extra, message):
    with pytest.raises(ConfigError, match=message):
        load_config("configs/demo_cpu.yaml", qa_overrides + extra)


def test_an_env_needs_the_qa_reward():
    with pytest.raises(ConfigError, match=r"env\.enabled needs questions scored by the qa reward.*'math'"):
        load_config("configs/demo_cpu.yaml", ["env.enabled=true"])
