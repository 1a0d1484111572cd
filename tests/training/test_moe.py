"""Mixture-of-experts training: a Qwen3-MoE config builds Megatron MoE layers, and EP=2 reproduces EP=1.

A tiny Qwen3-MoE (2 layers, hidden 32, 4 experts top-2, vocab 100) with the load-balancing and
z-losses on. One single-rank reference run (EP=1) saves its initial weights, logits, log-probs, one
update's gradients and metrics, and the weights after that update. One 2-rank spawn loads those
weights at EP=2 (each rank holds 2 experts; attention is data-parallel) and repeats the run with
the all-to-all and then the all-gather dispatcher, then at PP=2 (one MoE layer per stage). The
EP=2 weights after the update go through a distributed checkpoint and load at EP=1 unchanged. With
routing replay on (moe.routing_replay=rollout, routes that are not the router's own), EP=2 and PP=2
reproduce the single-rank replaying run.

Measured (2 cores, torch 2.13, megatron-core 0.16.1, float32), both dispatchers alike: logits and
log-probs bit-identical (|Δ| = 0), |Δgrad| ≤ 2.3e-8, loss, aux loss and expert load identical,
relative |Δgrad_norm| 4e-8, |Δz_loss| 3e-8, |Δw| after one AdamW step at lr 1e-3 ≤ 2.6e-7 (Adam's
first step is lr · g / (|g| + ε): a gradient within a few ε of zero turns its 2e-8 difference into
weight differences of that order). PP=2: log-probs bit-identical, |Δgrad| ≤ 2.3e-8, |Δw| ≤ 1.4e-7,
relative |Δgrad_norm| 4e-8, the other metrics identical. Replaying routes the router would not
choose (agreement 0.34; log-probs move by up to 6.3e-3 against fresh routing): EP=2 and PP=2
log-probs (and EP=2 logits) bit-identical to one rank, |Δgrad| <= 1.9e-8, |Δw| <= 4.4e-7, routing
agreement identical, relative |Δgrad_norm| <= 8e-8. Bounds: 1e-6 on logits, 1e-5 on gradients,
5e-6 on weights (as in test_parallel_equivalence), 1e-6 relative on the metrics.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_utils import run_distributed

from megatron_mugrpo.records import TrainBatch
from megatron_mugrpo.training import checkpoint
from megatron_mugrpo.training.model import ModelConfigError, build_gpt_model, transformer_config_from_hf
from megatron_mugrpo.training.moe import MoeConfig, MoeConfigError, load_layer_key, moe_layer_pattern
from megatron_mugrpo.training.optimizer import OptimConfig
from megatron_mugrpo.training.parallel import destroy_parallel, initialize_parallel
from megatron_mugrpo.training.routing_replay import routes_for_schedule, set_micro_batch_routes
from megatron_mugrpo.training.setup import Policy, build_policy
from megatron_mugrpo.training.train_step import forward_logprobs

from .common import hf_config, make_batch, max_abs_diff, mu_grpo_step

LOGIT_ATOL = 1e-6
GRAD_ATOL = 1e-5
WEIGHT_ATOL = 5e-6
METRIC_RTOL = 1e-6
LR = 1e-3
MICRO_BATCH = 2
EXPERTS = 4
CONFIG = hf_config("qwen3_moe", num_experts=EXPERTS, num_experts_per_tok=2, moe_intermediate_size=32)
MOE_LOSSES = {"aux_loss_coeff": 1e-2, "z_loss_coeff": 1e-3}
DISPATCHERS = ("alltoall", "allgather")
_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
LAYOUTS = {
    "ep2_alltoall": (1, 2, "alltoall", "none"),
    "ep2_allgather": (1, 2, "allgather", "none"),
    "pp2": (2, 1, "alltoall", "none"),
    "ep2_replay": (1, 2, "alltoall", "rollout"),
    "pp2_replay": (2, 1, "alltoall", "rollout"),
}
"""name: (pp, ep, token dispatcher, moe.routing_replay) on 2 ranks; the replay layouts replay ``_routes``."""
CHECKPOINT_LAYOUT = "ep2_alltoall"
"""Its weights after the update are saved with the trainer's checkpoint code and loaded at EP=1."""


def _policy(pp: int, ep: int, seed: int, dispatcher: str, replay: str = "none") -> Policy:
    groups = initialize_parallel(1, pp, seed=seed, ep=ep)
    moe = MoeConfig(token_dispatcher=dispatcher, routing_replay=replay, **MOE_LOSSES)
    return build_policy(CONFIG, groups=groups, dtype=torch.float32, optim=OptimConfig(lr=LR), moe=moe)


def _global_name(name: str, groups: Any) -> str:
    """The single-rank name of a parameter: local expert j of EP rank r is global expert r × E/EP + j,
    local layer i of pipeline stage p is layer p × L/PP + i."""
    local_experts, local_layers = EXPERTS // groups.ep, CONFIG["num_hidden_layers"] // groups.pp
    name = _EXPERT.sub(lambda m: f".local_experts.{groups.ep_rank * local_experts + int(m.group(1))}.", name)
    return _LAYER.sub(lambda m: f"decoder.layers.{groups.pp_rank * local_layers + int(m.group(1))}.", name)


def _full(policy: Policy, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``values`` keyed by single-rank names, every rank's experts and layers (gathered over all ranks)."""
    groups = policy.groups
    mine = {_global_name(name, groups): value.detach().clone() for name, value in values.items()}
    return {name: value for part in groups.all_gather(mine) for name, value in part.items()}


def _params(policy: Policy) -> dict[str, torch.Tensor]:
    return _full(policy, dict(policy.unwrapped()[0].named_parameters()))


def _grads(policy: Policy) -> dict[str, torch.Tensor]:
    return _full(policy, {n: p.main_grad for n, p in policy.unwrapped()[0].named_parameters()})


def _routes(batch: TrainBatch) -> torch.Tensor:
    """Routes [B, L, 2 layers, k=2] for every input token, not the router's own choice: experts
    (t, t + 1 + layer) mod 4 of token id t (distinct, every expert used)."""
    first = batch.tokens % EXPERTS
    per_layer = [torch.stack([first, (first + 1 + layer) % EXPERTS], dim=-1) for layer in range(2)]
    return torch.stack(per_layer, dim=2).to(torch.uint8)


def _run(policy: Policy, replay: bool = False) -> dict[str, Any]:
    """Logits and log-probs of the initial weights, then one update: its metrics, gradients, new weights.
    ``replay``: the batch carries ``_routes`` (replayed by a policy built with moe.routing_replay=rollout)."""
    batch = make_batch(10, groups=2, group_size=4)
    if replay:
        batch = dataclasses.replace(batch, routes=_routes(batch))
    bare = policy.unwrapped()[0]
    logits = None
    if policy.groups.pp == 1:  # a pipeline stage alone has no logits
        bare.eval()
        with torch.no_grad(), routes_for_schedule([bare]):
            set_micro_batch_routes(bare, batch.routes, batch.response_mask)
            positions = torch.arange(batch.tokens.shape[1]).expand_as(batch.tokens)
            logits = bare(batch.tokens, positions, None)[..., : CONFIG["vocab_size"]].clone()
        bare.train()
    logprobs = forward_logprobs(policy, batch, temperature=1.0, micro_batch_size=MICRO_BATCH)
    metrics = mu_grpo_step(policy, batch, MICRO_BATCH)
    return {"logits": logits, "logprobs": logprobs, "metrics": metrics, "grads": _grads(policy)} | {
        "params": _params(policy)
    }


def _reference(rank: int, world_size: int, root: str) -> None:
    policy = _policy(1, 1, seed=0, dispatcher="alltoall")
    torch.save(_params(policy), Path(root) / "init.pt")
    torch.save(_run(policy), Path(root) / "ep1.pt")
    destroy_parallel()
    policy = _policy(1, 1, seed=1234, dispatcher="alltoall", replay="rollout")
    _load_init(policy, root)
    torch.save(_run(policy, replay=True), Path(root) / "ep1_replay.pt")


def _load_init(policy: Policy, root: str) -> None:
    init = torch.load(Path(root) / "init.pt")
    groups = policy.groups
    with torch.no_grad():
        for name, param in policy.unwrapped()[0].named_parameters():
            param.copy_(init[_global_name(name, groups)])
    policy.weights_loaded()


def _layouts(rank: int, world_size: int, root: str) -> None:
    torch.use_deterministic_algorithms(True)
    for name, (pp, ep, dispatcher, replay) in LAYOUTS.items():
        policy = _policy(pp, ep, seed=1234, dispatcher=dispatcher, replay=replay)  # weights must come from init
        assert (policy.groups.pp, policy.groups.ep, policy.groups.dp) == (pp, ep, 2 // pp)
        _load_init(policy, root)
        result = _run(policy, replay=replay == "rollout")
        if rank == 0:
            torch.save(result, Path(root) / f"{name}.pt")
        if name == CHECKPOINT_LAYOUT:
            checkpoint.save_checkpoint(
                Path(root) / name, 1, policy.model_chunks, groups=policy.groups, hf_config=CONFIG, save_rng=False
            )
        destroy_parallel()


def _load_at_ep1(rank: int, world_size: int, root: str) -> None:
    policy = _policy(1, 1, seed=99, dispatcher="alltoall")
    step_dir = checkpoint.latest_checkpoint(Path(root) / CHECKPOINT_LAYOUT)
    checkpoint.load_checkpoint(step_dir, policy.model_chunks, groups=policy.groups, load_rng=False)
    torch.save(_params(policy), Path(root) / f"{CHECKPOINT_LAYOUT}_at_ep1.pt")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    root = tmp_path_factory.mktemp("moe")
    run_distributed(_reference, 1, str(root))
    run_distributed(_layouts, 2, str(root))
    run_distributed(_load_at_ep1, 1, str(root))
    out = {name: torch.load(root / f"{name}.pt") for name in ("ep1", "ep1_replay", *LAYOUTS)}
    out["at_ep1"] = torch.load(root / f"{CHECKPOINT_LAYOUT}_at_ep1.pt")
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("dispatcher", DISPATCHERS)
def test_ep2_logits_and_logprobs_match_ep1(runs, dispatcher):
    ours, ref = runs[f"ep2_{dispatcher}"], runs["ep1"]
    torch.testing.assert_close(ours["logits"], ref["logits"], atol=LOGIT_ATOL, rtol=0)
    torch.testing.assert_close(ours["logprobs"], ref["logprobs"], atol=LOGIT_ATOL, rtol=0)


@pytest.mark.multiprocess
def test_pp2_logprobs_match_single_rank(runs):
    torch.testing.assert_close(runs["pp2"]["logprobs"], runs["ep1"]["logprobs"], atol=LOGIT_ATOL, rtol=0)


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", ["ep2_alltoall", "ep2_allgather", "pp2"])
def test_gradients_and_optimizer_step_match_single_rank(runs, layout):
    ours, ref = runs[layout], runs["ep1"]
    expert_grads = [name for name in ref["grads"] if ".local_experts." in name]
    assert len(expert_grads) == 2 * EXPERTS * 2  # 2 layers × 4 experts × (fc1, fc2), all gathered
    assert min(float(ref["grads"][n].abs().max()) for n in expert_grads) > 1e-4  # every expert learns
    grad_diff = max_abs_diff(ours["grads"], ref["grads"])
    assert grad_diff < GRAD_ATOL, f"max |Δgrad| {layout} vs one rank = {grad_diff:.3g}"
    weight_diff = max_abs_diff(ours["params"], ref["params"])
    assert weight_diff < WEIGHT_ATOL, f"max |Δw| after one step = {weight_diff:.3g}"


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", ["ep2_alltoall", "ep2_allgather", "pp2"])
def test_update_metrics_match_single_rank(runs, layout):
    ours, ref = runs[layout]["metrics"], runs["ep1"]["metrics"]
    for key in ("train/loss", "train/grad_norm", "train/moe_aux_loss", "train/moe_z_loss"):
        assert ours[key] == pytest.approx(ref[key], rel=METRIC_RTOL), key
    loads = sorted(key for key in ref if key.startswith("train/moe_load_"))
    assert sorted(key for key in ours if key.startswith("train/moe_load_")) == loads  # per layer across PP too
    for key in loads:
        assert ours[key] == pytest.approx(ref[key], abs=1e-12), key


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", ["ep2_replay", "pp2_replay"])
def test_routing_replay_at_ep2_and_pp2_matches_single_rank(runs, layout):
    ours, ref = runs[layout], runs["ep1_replay"]
    torch.testing.assert_close(ours["logprobs"], ref["logprobs"], atol=LOGIT_ATOL, rtol=0)
    if ours["logits"] is not None:
        torch.testing.assert_close(ours["logits"], ref["logits"], atol=LOGIT_ATOL, rtol=0)
    grad_diff = max_abs_diff(ours["grads"], ref["grads"])
    assert grad_diff < GRAD_ATOL, f"max |Δgrad| {layout} vs one rank, replaying = {grad_diff:.3g}"
    assert max_abs_diff(ours["params"], ref["params"]) < WEIGHT_ATOL
    for key in ("train/loss", "train/grad_norm", "train/routing_agreement"):
        assert ours["metrics"][key] == pytest.approx(ref["metrics"][key], rel=METRIC_RTOL), key
    # the replayed routes are not the router's own: replay changed what the model computes
    assert ref["metrics"]["train/routing_agreement"] < 0.5
    assert float((ref["logprobs"] - runs["ep1"]["logprobs"]).abs().max()) > 1e-3


@pytest.mark.multiprocess
def test_checkpoint_saved_at_ep2_loads_at_ep1_bit_for_bit(runs):
    saved, loaded = runs[CHECKPOINT_LAYOUT]["params"], runs["at_ep1"]
    assert loaded.keys() == saved.keys()
    for name, tensor in saved.items():
        assert torch.equal(loaded[name], tensor), name


@pytest.mark.multiprocess
def test_moe_metrics_are_plausible(runs):
    metrics = runs["ep1"]["metrics"]
    # 4 experts: shares around 1/4, the smallest below and the largest above it.
    assert 0.0 < metrics["train/moe_load_min"] <= 0.25 <= metrics["train/moe_load_max"] < 1.0
    # Per MoE layer (both layers are sparse); the model's bounds are the layers' extremes.
    per_layer = [(metrics[load_layer_key("min", i)], metrics[load_layer_key("max", i)]) for i in range(2)]
    assert all(0.0 < low <= 0.25 <= high < 1.0 for low, high in per_layer)
    assert metrics["train/moe_load_min"] == min(low for low, _ in per_layer)
    assert metrics["train/moe_load_max"] == max(high for _, high in per_layer)
    # Switch aux loss is 1 for a perfectly balanced router and grows with imbalance.
    assert 0.99 < metrics["train/moe_aux_loss"] < 1.5
    assert metrics["train/moe_z_loss"] > 0.0


# ------------------------------------------------------------------------ config and routing


def test_layer_pattern_follows_sparse_step_and_mlp_only_layers():
    assert moe_layer_pattern(hf_config("qwen3_moe", num_hidden_layers=4)) == [1, 1, 1, 1]
    assert moe_layer_pattern(hf_config("qwen3_moe", num_hidden_layers=4, decoder_sparse_step=2)) == [0, 1, 0, 1]
    assert moe_layer_pattern(hf_config("qwen3_moe", num_hidden_layers=4, mlp_only_layers=[0, 3])) == [0, 1, 1, 0]


def test_transformer_config_carries_the_router_and_losses():
    cfg = transformer_config_from_hf(
        CONFIG, dtype=torch.float32, expert_parallel=2, moe=MoeConfig(aux_loss_coeff=1e-3, z_loss_coeff=0.0)
    )
    assert (cfg.num_moe_experts, cfg.moe_router_topk, cfg.moe_ffn_hidden_size) == (4, 2, 32)
    assert cfg.moe_router_score_function == "softmax" and not cfg.moe_router_pre_softmax  # norm_topk_prob
    assert cfg.moe_aux_loss_coeff == 1e-3 and cfg.moe_z_loss_coeff is None
    assert cfg.expert_model_parallel_size == 2 and cfg.qk_layernorm and not cfg.moe_grouped_gemm
    unnormalised = transformer_config_from_hf({**CONFIG, "norm_topk_prob": False}, dtype=torch.float32)
    assert unnormalised.moe_router_pre_softmax


def test_impossible_splits_name_the_key():
    with pytest.raises(MoeConfigError, match="num_experts=4"):
        transformer_config_from_hf(CONFIG, dtype=torch.float32, expert_parallel=3)
    with pytest.raises(ModelConfigError, match="mixture-of-experts"):
        transformer_config_from_hf(hf_config("qwen3"), dtype=torch.float32, expert_parallel=2)
    with pytest.raises(MoeConfigError, match="moe_intermediate_size=31"):
        transformer_config_from_hf({**CONFIG, "moe_intermediate_size": 31}, dtype=torch.float32, tensor_parallel=2)


def _hf_routing(logits: torch.Tensor, k: int, normalise: bool) -> torch.Tensor:
    """transformers' Qwen3-MoE router: softmax in float32, top-k, optionally renormalised; dense [T, E]."""
    probs = torch.softmax(logits.float(), dim=-1)
    top, idx = probs.topk(k, dim=-1)
    if normalise:
        top = top / top.sum(dim=-1, keepdim=True)
    return torch.zeros_like(probs).scatter(1, idx, top)


def _routing_and_layout(rank: int, world_size: int, out: str) -> None:
    groups = initialize_parallel(1, 1, seed=0)
    results = {}
    for normalise in (True, False):
        cfg = {**CONFIG, "norm_topk_prob": normalise, "mlp_only_layers": [0]}
        model = build_gpt_model(cfg, groups, dtype=torch.float32)
        router = model.decoder.layers[1].mlp.router
        # The model communicates on the caller's groups (handed down as megatron-core's collection).
        experts = model.decoder.layers[1].mlp.experts
        assert model.pg_collection is groups.mcore and router.tp_group is groups.tp_group
        assert experts.ep_group is groups.ep_group and experts.tp_group is groups.etp_group
        hidden = torch.randn(5, 3, cfg["hidden_size"])
        with torch.no_grad():
            probs, routing_map = router(hidden)
            expected = _hf_routing(hidden.reshape(15, -1) @ router.weight.T, 2, normalise)
        results[normalise] = float((probs - expected).abs().max())
        assert routing_map.sum(dim=1).eq(2).all()
    keys = {getattr(item, "key", None) for item in model.sharded_state_dict().values()}  # checkpoint keys
    torch.save({"routing": results, "keys": keys, "dense_mlp": type(model.decoder.layers[0].mlp).__name__}, out)


def test_router_matches_transformers_routing_and_mixed_layers_keep_one_norm_key(tmp_path):
    out = tmp_path / "routing.pt"
    run_distributed(_routing_and_layout, 1, str(out))
    result = torch.load(out)
    assert result["routing"][True] < 1e-6 and result["routing"][False] < 1e-6, result["routing"]
    assert result["dense_mlp"] == "MLP"  # mlp_only_layers=[0]
    # The sparse layer's norm keeps its own key (as with Transformer Engine); the dense one fuses into fc1.
    assert "decoder.layers.1.pre_mlp_layernorm.weight" in result["keys"]
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in result["keys"]


# ------------------------------------------------------------------------------- CPU shims


class _AllocatesOnCudaInBackward(torch.autograd.Function):
    """Like megatron's all-to-all: the backward allocates with device=torch.cuda.current_device()."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return 3.0 * x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return 3.0 * grad + torch.zeros(grad.shape, device=torch.cuda.current_device())


def test_cpu_shims_keep_backward_mapped_and_give_gloo_numpy_split_sizes():
    from megatron.core.transformer.moe import token_dispatcher

    from megatron_mugrpo.training import cpu_compat

    activated_here = not cpu_compat.is_active()
    try:
        cpu_compat.activate()
        x = torch.ones(4, requires_grad=True)
        _AllocatesOnCudaInBackward.apply(x).sum().backward()
        torch.autograd.backward([_AllocatesOnCudaInBackward.apply(x)], [torch.full((4,), 2.0)])
        assert x.grad.tolist() == [9.0] * 4  # 3 from Tensor.backward + 3 × 2 from autograd.backward
        assert cpu_compat.activate_moe()["moe_dispatch"] == 1
        splits = token_dispatcher.maybe_move_tensor_to_cpu(torch.tensor([3, 5]), as_numpy=True)
        assert splits.tolist() == [3, 5] and not torch.is_tensor(splits)
    finally:
        if activated_here:
            cpu_compat.deactivate()
    if activated_here:  # deactivate() restores megatron's helper, which leaves CPU tensors as they are
        assert torch.is_tensor(token_dispatcher.maybe_move_tensor_to_cpu(torch.tensor([1]), as_numpy=True))
