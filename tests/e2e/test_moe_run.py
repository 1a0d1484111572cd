"""A tiny Qwen3-MoE (4 experts, top-2) through the whole staged loop on CPU.

The trainer builds Megatron MoE layers from the model's config.json, the transformers engine samples
the HF model, and every weight sync exports the trainer's experts through the converter's mappings
into the engine, whose transformers 5 model keeps each layer's experts fused
(``experts.gate_up_proj`` / ``experts.down_proj``). The engine's log-probs at the first update of
stage 2 show that the sync after training carried every expert over. With ``moe.routing_replay=rollout``
the engine's routes go through the store into every update (and across a resume).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from e2e_runs import final_weights, mugrpo, records, train
from safetensors.torch import load_file

from megatron_mugrpo.durable import Checksum
from megatron_mugrpo.loop.actions import GAP_KEY
from megatron_mugrpo.rollout.store import RolloutStore
from megatron_mugrpo.rollout.transformers_engine import copy_weights
from megatron_mugrpo.training.tiny import tiny_hf_dir


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Tied embeddings, as the demo's warm-started model has them.
    return tiny_hf_dir(tmp_path_factory.mktemp("moe") / "model", "qwen3_moe", seed=0, tie_word_embeddings=True)


def test_engine_loads_per_expert_tensors_into_fused_experts(moe_dir: Path):
    from transformers import AutoConfig, AutoModelForCausalLM

    saved = load_file(str(moe_dir / "model.safetensors"))
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in saved  # released-checkpoint names
    reference = AutoModelForCausalLM.from_pretrained(str(moe_dir)).eval()
    fresh = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(moe_dir))).eval()
    copy_weights(fresh, saved.items())
    ids = torch.tensor([[1, 7, 9, 11, 13]])
    with torch.no_grad():
        assert torch.equal(fresh(ids).logits, reference(ids).logits)
    partial = {k: v for k, v in saved.items() if k != "model.layers.1.mlp.experts.2.gate_proj.weight"}
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.experts\.gate_up_proj"):
        copy_weights(fresh, partial.items())
    with pytest.raises(KeyError, match=r"experts\.9\.down_proj"):
        copy_weights(fresh, [("model.layers.0.mlp.experts.9.down_proj.weight", saved["model.embed_tokens.weight"])])


MOE_RUN = (
    "stages.train_groups=8",
    "rollout.max_new_tokens=24",
    "eval.max_new_tokens=24",
    "eval.benchmarks.0.limit=8",
    "moe.aux_loss_coeff=1e-3",
)
"""Two stages of two updates on the tiny MoE (``e2e_runs.SMALL`` otherwise)."""


@pytest.fixture(scope="module")
def fresh_routing_run(tmp_path_factory: pytest.TempPathFactory, moe_dir: Path) -> Path:
    """The small MoE run with moe.routing_replay=none: every forward routes afresh."""
    run_dir = tmp_path_factory.mktemp("fresh") / "run"
    train(run_dir, moe_dir, *MOE_RUN)
    return run_dir


def test_moe_run_trains_syncs_and_evaluates(fresh_routing_run: Path, moe_dir: Path):
    run_dir = fresh_routing_run
    recs = records(run_dir)
    updates = [r for r in recs if "train/update_successful" in r]
    assert len(updates) == 4 and all(r["train/update_successful"] == 1.0 for r in updates)
    for r in updates:
        assert 0.0 <= r["train/moe_load_min"] <= 0.25 <= r["train/moe_load_max"] <= 1.0  # shares of 4 experts
        assert r["train/moe_aux_loss"] > 0
    # Stage 2's first update scores the data the engine sampled after the sync: same weights, same log-probs.
    first_of_stage_2 = min((r for r in updates if r["train/stage"] == 1), key=lambda r: r["step"])
    assert first_of_stage_2["train/rollout_logprob_abs_diff_max"] < 1e-4
    evals = [r["step"] for r in recs if "eval/avg_pass@1" in r]
    assert evals[0] == 0 and evals[-1] == 4
    before, after = load_file(str(moe_dir / "model.safetensors")), final_weights(run_dir)
    assert set(after) == set(before)
    for name in ("model.layers.0.mlp.experts.1.down_proj.weight", "model.layers.1.mlp.gate.weight"):
        assert not torch.equal(after[name], before[name]), name


def first_updates(recs: list[dict]) -> dict[int, dict]:
    """Each stage's first update record, by stage."""
    updates = sorted((r for r in recs if "train/update_successful" in r), key=lambda r: r["step"])
    return {int(stage): next(r for r in updates if r["train/stage"] == stage) for stage in (0, 1)}


def test_routing_replay_stores_the_engines_routes_and_replays_them_through_a_resume(
    tmp_path: Path, moe_dir: Path, fresh_routing_run: Path
):
    """moe.routing_replay=rollout: the engine records every input token's experts, each stage's store
    keeps them per shard, and every update replays them. The run is killed once stage 1's store is
    written; while it is down the store's routes file is damaged, and the resumed run regenerates the
    shard (the same routes, bit for bit) and trains on routes read back from disk.

    At stage 0's first update the trainer's weights are β's and the data are the no-replay run's
    (recording routes does not change sampling): the trainer's fresh routing must choose the engine's
    experts for every (token, layer), so replay changes nothing and the first update's train/rollout
    gap equals the no-replay run's."""
    run_dir = tmp_path / "run"
    replay = "moe.routing_replay=rollout"
    proc = train(run_dir, moe_dir, *MOE_RUN, replay, crash_at="rollout:1")
    assert proc.returncode != 0
    stage_1 = run_dir / "rollouts" / "stage_001"
    routes_file = stage_1 / "routes_00000.arrow"
    written = Checksum.of_file(routes_file)
    routes_file.write_bytes(routes_file.read_bytes()[:-16] + bytes(16))
    mugrpo("train", "--resume", str(run_dir))
    assert Checksum.of_file(routes_file) == written  # regenerated by the same policy and seeds

    for stage in (0, 1):
        store = RolloutStore.open(run_dir / "rollouts" / f"stage_{stage:03d}")
        assert [info.routes.file for info in store.manifest.shards] == ["routes_00000.arrow"]
        assert store.manifest.sampling["routes"] is True
        for group in store.groups():
            for sample in group.samples:
                assert sample.routes.dtype == np.uint8  # 4 experts: one byte per id, 2 layers × top-2 per token
                assert sample.routes.shape == (len(group.prompt_ids) + len(sample.response_ids) - 1, 2, 2)
    recs = records(run_dir)
    updates = [r for r in recs if "train/update_successful" in r]
    assert sorted(r["step"] for r in updates) == [1, 2, 3, 4]  # each update once across the resume
    assert all(0.0 <= r["train/routing_agreement"] <= 1.0 for r in updates)
    stage_ends = [r for r in recs if "train/routing_agreement_stage_mean" in r]
    assert [r["step"] for r in stage_ends] == [2, 4] and all("train/routing_agreement_first" in r for r in stage_ends)

    with_replay, without = first_updates(recs)[0], first_updates(records(fresh_routing_run))[0]
    assert with_replay["train/routing_agreement"] == 1.0
    assert with_replay[GAP_KEY] == without[GAP_KEY] < 1e-5


def _export_at_ep2(rank: int, world_size: int, hf_dir: str, out: str) -> None:
    import json

    from megatron_mugrpo.conversion import export_hf, load_hf_into_model

    from megatron_mugrpo.training.parallel import initialize_parallel
    from megatron_mugrpo.training.setup import build_policy

    config = json.loads((Path(hf_dir) / "config.json").read_text())
    groups = initialize_parallel(1, 1, seed=0, ep=2)
    policy = build_policy(config, groups=groups, dtype=torch.float32, optim=None)
    experts = policy.unwrapped()[0].decoder.layers[0].mlp.local_expert_indices
    assert len(experts) == 2  # each rank holds half of the 4 experts
    load_hf_into_model(policy.unwrapped(), hf_dir, groups)
    exported = {name: tensor.clone() for name, tensor in export_hf(policy.unwrapped(), config, groups)}
    torch.save(exported, Path(out) / f"rank{rank}.pt")


def test_export_at_expert_parallel_2_gives_every_expert_on_every_rank(moe_dir: Path, tmp_path: Path):
    """The engine sync at EP > 1: each rank exports the whole model, other ranks' experts broadcast to it."""
    from dist_utils import run_distributed

    run_distributed(_export_at_ep2, 2, str(moe_dir), str(tmp_path))
    saved = load_file(str(moe_dir / "model.safetensors"))
    for rank in range(2):
        exported = torch.load(tmp_path / f"rank{rank}.pt")
        assert set(exported) == set(saved)
        for name, tensor in saved.items():
            assert torch.equal(exported[name], tensor), (rank, name)
