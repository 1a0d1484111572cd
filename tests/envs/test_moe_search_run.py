"""A staged multi-turn search run on a tiny Qwen3-MoE with routing replay (moe.routing_replay=rollout), through
the CLI.

The base model writes searches (``search_models.SEARCH_CHAIN``: its residual stream carries the current
token's embedding, attention and experts add nothing) and its routers are set decisive, so trajectories hold
observations. The transformers engine records the experts of every position it feeds (prompt, sampled tokens,
the observation tokens it prefills); the store keeps them beside each shard; the trainer replays them over
prompt + trajectory. At the first update the trainer's weights are β's, so its own routing must choose the
recorded experts at every (real token, MoE layer), observation positions included: train/routing_agreement is
exactly 1.0.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from search_models import searching_model
from test_async_search_run import CONFIG

from megatron_mugrpo.envs.fictional import write_task
from megatron_mugrpo.rollout.store import RolloutStore

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from e2e_runs import mugrpo, records


@pytest.mark.slow
def test_a_staged_moe_search_run_replays_the_routes_of_every_trajectory_position(tmp_path: Path, search_run_overrides):
    data = tmp_path / "data"
    write_task(data, 0, people=12, cities=4)
    base, run_dir = searching_model(tmp_path / "base", moe=True), tmp_path / "run"
    mugrpo(
        "train",
        "--config",
        str(CONFIG),
        "--run-dir",
        str(run_dir),
        *search_run_overrides(data, base, mini_groups=2, updates=1),
        "moe.routing_replay=rollout",
    )
    store = RolloutStore.open(run_dir / "rollouts" / "stage_000")
    assert store.manifest.sampling["routes"] is True and all(info.routes for info in store.manifest.shards)
    samples = [(g, s) for g in store.groups() for s in g.samples]
    assert sum(s.policy_mask.count(0) for _, s in samples) > 0, "no trajectory searched: no observation to route"
    for group, s in samples:
        assert s.routes.dtype == np.uint8 and s.routes.shape == (len(group.prompt_ids) + len(s.response_ids) - 1, 2, 2)
    (update,) = [r for r in records(run_dir) if "train/routing_agreement" in r]
    assert update["train/routing_agreement"] == 1.0
    assert update["train/response_tokens"] == sum(sum(s.policy_mask) for _, s in samples)
    manifest = json.loads((run_dir / "rollouts" / "stage_000" / "manifest.json").read_text())
    assert manifest["sampling"]["env"]["max_turns"] == 2
