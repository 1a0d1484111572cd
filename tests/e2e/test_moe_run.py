"""A tiny Qwen3-MoE (4 experts, top-2) through the whole staged loop on CPU.

The trainer builds Megatron MoE layers from the model's config.json, the transformers engine samples
the HF model, and every weight sync exports the trainer's experts through the converter's mappings
into the engine, whose transformers 5 model keeps each layer's experts fused
(``experts.gate_up_proj`` / ``experts.down_proj``). The engine's log-probs at the first update of
stage 2 show that the sync after training carried every expert over.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from e2e_runs import final_weights, records, train
from safetensors.torch import load_file

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


def test_moe_run_trains_syncs_and_evaluates(tmp_path: Path, moe_dir: Path):
    run_dir = tmp_path / "run"
    train(
        run_dir,
        moe_dir,
        "stages.train_groups=8",
        "rollout.max_new_tokens=24",
        "eval.max_new_tokens=24",
        "eval.benchmarks.0.limit=8",
        "moe.aux_loss_coeff=1e-3",
    )
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
