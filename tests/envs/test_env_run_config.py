"""The ``env`` section inside a run's config: off by default, and refused, with the key to change, wherever
the run could not roll out multi-turn trajectories."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_mugrpo.config import load_config
from megatron_mugrpo.errors import ConfigError


def test_the_env_section_is_off_by_default():
    cfg = load_config("configs/demo_cpu.yaml")
    assert cfg.env.enabled is False and cfg.env.kind == "search" and cfg.env.max_turns == 4


def test_a_qa_run_with_a_corpus_accepts_the_env_section(qa_overrides):
    cfg = load_config("configs/demo_cpu.yaml", [*qa_overrides, "env.max_turns=3", "env.search.topk=2"])
    assert cfg.env.enabled and cfg.env.max_turns == 3 and cfg.env.search.topk == 2


def test_the_sglang_engine_rolls_out_trajectories(qa_overrides):
    cfg = load_config("configs/demo_cpu.yaml", [*qa_overrides, "rollout.engine=sglang"])
    assert cfg.env.enabled and cfg.rollout.engine == "sglang"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["rollout.allocation=vigor"], r"rollout\.allocation=fixed only"),
        (["env.search.corpus="], r"env\.search\.url .* or env\.search\.corpus"),
        (["env.max_turns=0"], r"env\.max_turns=0 must be >= 1"),
        (["env.max_total_tokens=16"], r"env\.max_total_tokens=16 leaves no room .*max_prompt_tokens=16"),
        (["env.max_total_tokens=300"], r"env\.max_total_tokens=300 is more than .*max_position_embeddings=256"),
    ],
)
def test_runs_that_cannot_roll_out_trajectories_are_refused(qa_overrides, extra, message):
    with pytest.raises(ConfigError, match=message):
        load_config("configs/demo_cpu.yaml", qa_overrides + extra)


def test_an_env_needs_the_qa_reward():
    with pytest.raises(ConfigError, match=r"env\.enabled needs questions scored by the qa reward.*'math'"):
        load_config("configs/demo_cpu.yaml", ["env.enabled=true"])


PAPER_SEARCH = "configs/paper/qwen2.5_7b__search_mu_grpo.yaml"


def test_the_paper_search_config_refuses_its_placeholder_url_until_it_is_set(tmp_path):
    from megatron_mugrpo.plan.inputs import planning_overrides

    with planning_overrides(Path(PAPER_SEARCH), []) as (resolved, notes):
        real_paths = [o for o in resolved if not o.startswith("env.search.url=")]
        with pytest.raises(ConfigError, match=r"env\.search\.url='http://retriever\.invalid:8000' is a placeholder"):
            load_config(PAPER_SEARCH, real_paths)
        cfg = load_config(PAPER_SEARCH, [*real_paths, "env.search.url=http://10.0.0.7:8000"])
        assert any("env.search.url" in note for note in notes)  # `mugrpo plan` plans it with a stand-in
    assert (cfg.env.enabled, cfg.env.max_turns, cfg.env.search.topk) == (True, 4, 3)
    assert (cfg.data.format, cfg.reward.kind, cfg.rollout.engine) == ("qa", "qa", "sglang")
    assert (cfg.algo.loss, cfg.algo.mu_grpo.clip_high, cfg.stages.updates_per_stage) == ("mu_grpo", 5.0, 1024)
    assert cfg.env.max_total_tokens < 4096  # below Qwen2.5-Math-7B's context window (SGLang refuses reaching it)
