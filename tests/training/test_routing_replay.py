"""Routing replay in the trainer (moe.routing_replay=rollout) on one rank; the EP=2 / PP=2 runs with
replay are in test_moe.py's spawn.

A tiny Qwen3-MoE (2 layers, 4 experts top-2). The trainer's own routes are captured by hooks on its
routers; replayed into a replay-enabled copy of the same weights they reproduce its log-probs to an ulp
(which fails if the sequence-major rows are not transposed), while routes of another choice
change them by > 1e-3. A full activation recompute replays the same routes in backward (gradients equal to no
recompute); megatron's backward lists stay empty after every schedule; two replay-enabled models in
one process do not see each other's routes; bad routes and missing routes are refused by name;
every loss of the registry trains with replay.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from dist_utils import run_distributed

from megatron_mugrpo.algorithms.config import AlgoConfig
from megatron_mugrpo.algorithms.losses import available_losses, needs_old_logprobs
from megatron_mugrpo.records import TrainBatch
from megatron_mugrpo.training.model import build_gpt_model
from megatron_mugrpo.training.moe import MoeConfig, MoeConfigError
from megatron_mugrpo.training.optimizer import OptimConfig
from megatron_mugrpo.training.parallel import initialize_parallel
from megatron_mugrpo.training.routing_replay import (
    RoutingReplayError,
    StageRoutingAgreement,
    real_tokens,
    replay_rows,
    routes_for_schedule,
    set_micro_batch_routes,
)
from megatron_mugrpo.training.setup import Policy, build_policy
from megatron_mugrpo.training.train_step import forward_logprobs, train_step

from .common import hf_config, make_batch

EXPERTS, TOPK, MICRO_BATCH = 4, 2, 2
CONFIG = hf_config("qwen3_moe", num_experts=EXPERTS, num_experts_per_tok=TOPK, moe_intermediate_size=32)
RECOMPUTE = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}


def _routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for m in model.modules() if isinstance(m, TopKRouter)]


def _capture_fresh_routes(policy: Policy, batch: TrainBatch, micro_batch_size: int) -> torch.Tensor:
    """The trainer's own routes of ``batch`` [B, L, layers, k] (batch-major), in the micro-batches the
    schedule will run, each token's experts by decreasing probability as a top-k (and an engine) lists them."""
    bare, parts = policy.unwrapped()[0], []
    bare.eval()
    for start in range(0, batch.num_sequences, micro_batch_size):
        tokens, seen = batch.tokens[start : start + micro_batch_size], []
        hooks = [
            r.register_forward_hook(lambda _m, _i, out, seen=seen: seen.append(out[0].detach())) for r in _routers(bare)
        ]
        with torch.no_grad():
            bare(tokens, torch.arange(tokens.shape[1]).expand_as(tokens), None)
        for hook in hooks:
            hook.remove()
        rows, length = tokens.shape
        per_layer = [p.topk(TOPK, dim=-1).indices.reshape(length, rows, TOPK).transpose(0, 1) for p in seen]
        parts.append(torch.stack(per_layer, dim=2))
    bare.train()
    return torch.cat(parts).to(torch.uint8)


def _other_routes(batch: TrainBatch, fresh: torch.Tensor) -> torch.Tensor:
    """Routes that differ from ``fresh`` at every token and layer: the complementary pair of experts."""
    everything = torch.arange(EXPERTS)
    flat = fresh.reshape(-1, TOPK).long()
    other = torch.stack([everything[~torch.isin(everything, row)] for row in flat])
    return other.reshape(fresh.shape).to(torch.uint8)


def _copy_weights(src: Policy, dst: Policy) -> None:
    with torch.no_grad():
        for (_, a), (_, b) in zip(src.unwrapped()[0].named_parameters(), dst.unwrapped()[0].named_parameters()):
            b.copy_(a)
    dst.weights_loaded()


def _grads(model: torch.nn.Module, batch: TrainBatch, routes: torch.Tensor) -> dict[str, torch.Tensor]:
    """One forward-backward of the summed log-probs of ``batch`` under ``routes`` (one micro-batch)."""
    model.zero_grad()
    with routes_for_schedule([model]):
        set_micro_batch_routes(model, routes, batch.response_mask)
        logits = model(batch.tokens, torch.arange(batch.tokens.shape[1]).expand_as(batch.tokens), None)
        logits[..., : CONFIG["vocab_size"]].log_softmax(-1).gather(-1, batch.targets[..., None]).sum().backward()
        leftover = [len(r.router_replay.replay_backward_list) for r in _routers(model)]
    return {"grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, "left": leftover}


def _body(rank: int, world_size: int, out: dict[str, Any]) -> None:
    from megatron.core.transformer.moe.router_replay import RouterReplay

    torch.use_deterministic_algorithms(True)
    groups = initialize_parallel(1, 1, seed=0)
    optim = OptimConfig(lr=1e-3)
    fresh_policy = build_policy(CONFIG, groups=groups, dtype=torch.float32, optim=optim, moe=MoeConfig())
    replay_policy = build_policy(
        CONFIG, groups=groups, dtype=torch.float32, optim=optim, moe=MoeConfig(routing_replay="rollout")
    )
    _copy_weights(fresh_policy, replay_policy)
    out["global_instances"] = len(RouterReplay.global_router_replay_instances)
    batch = make_batch(10, groups=2, group_size=4)
    fresh = _capture_fresh_routes(fresh_policy, batch, MICRO_BATCH)
    other = _other_routes(batch, fresh)
    score = dict(temperature=1.0, micro_batch_size=MICRO_BATCH)
    out["fresh"] = forward_logprobs(fresh_policy, batch, **score)
    out["fresh_given_routes"] = forward_logprobs(fresh_policy, dataclasses.replace(batch, routes=fresh), **score)
    out["replay_own"] = forward_logprobs(replay_policy, dataclasses.replace(batch, routes=fresh), **score)
    out["replay_other"] = forward_logprobs(replay_policy, dataclasses.replace(batch, routes=other), **score)
    try:
        forward_logprobs(replay_policy, batch, **score)
    except RoutingReplayError as exc:
        out["missing_error"] = str(exc)
    out["every_loss"] = _every_loss_with_replay(groups, optim, batch, score)
    step = dict(loss_name="mu_grpo", loss_options=AlgoConfig().loss_options(), **score)
    out["metrics_own"] = train_step(replay_policy, dataclasses.replace(batch, routes=fresh), **step)
    out["metrics_other"] = train_step(replay_policy, dataclasses.replace(batch, routes=other), **step)
    out["backward_lists"] = [len(r.router_replay.replay_backward_list) for r in _routers(replay_policy.unwrapped()[0])]
    # Full activation recompute: the backward re-runs each layer's forward and must replay the same routes.
    models = {}
    for name, overrides in (("plain", {}), ("recompute", RECOMPUTE)):
        torch.manual_seed(5)
        models[name] = build_gpt_model(
            CONFIG, groups, dtype=torch.float32, moe=MoeConfig(routing_replay="rollout"), config_overrides=overrides
        )
    models["recompute"].load_state_dict(models["plain"].state_dict())
    out["recompute"] = {name: _grads(m, batch, other) for name, m in models.items()}
    # Routes checked for one micro-batch, then a forward of another shape: the router refuses them.
    model, rows = models["plain"], batch.slice(0, 2)
    with routes_for_schedule([model]), torch.no_grad():
        set_micro_batch_routes(model, other[:2], rows.response_mask)
        try:
            model(batch.tokens[:3], torch.arange(batch.tokens.shape[1]).expand(3, -1), None)
        except RoutingReplayError as exc:
            out["row_error"] = str(exc)
    try:
        build_gpt_model(
            CONFIG,
            groups,
            dtype=torch.float32,
            moe=MoeConfig(routing_replay="rollout"),
            config_overrides={"moe_router_fusion": True},
        )
    except RoutingReplayError as exc:
        out["fusion_error"] = str(exc)
    out["global_instances_after"] = len(RouterReplay.global_router_replay_instances)


def _every_loss_with_replay(groups: Any, optim: OptimConfig, batch: TrainBatch, score: dict) -> dict[str, Any]:
    """One update per registered loss, in turn, on two copies of one model: routing afresh, and replaying
    the routes the fresh copy chose for this batch just before. Replaying a model's own routes must
    change nothing, whatever the loss does with the log-probs: {loss: (fresh metrics, replay metrics)}."""
    fresh = build_policy(CONFIG, groups=groups, dtype=torch.float32, optim=optim, moe=MoeConfig())
    replay = build_policy(
        CONFIG, groups=groups, dtype=torch.float32, optim=optim, moe=MoeConfig(routing_replay="rollout")
    )
    _copy_weights(fresh, replay)
    out = {}
    for loss in available_losses():
        # icepop reads log π_old of the stage's start; here the stage starts at β's weights
        data = dataclasses.replace(batch, old_logprobs=batch.behaviour_logprobs) if needs_old_logprobs(loss) else batch
        routes = _capture_fresh_routes(fresh, data, MICRO_BATCH)
        step = dict(loss_name=loss, loss_options=AlgoConfig(loss=loss).loss_options(), **score)
        out[loss] = (
            train_step(fresh, data, **step),
            train_step(replay, dataclasses.replace(data, routes=routes), **step),
        )
    return out


@pytest.fixture(scope="module")
def runs() -> dict[str, Any]:
    out: dict[str, Any] = {}
    run_distributed(_body, 1, out)
    return out


def test_every_loss_of_the_registry_trains_with_replay(runs):
    """Each update replays routes equal to the fresh ones (agreement 1) and is that loss's fresh update."""
    assert set(runs["every_loss"]) == set(available_losses())
    for loss, (fresh, replay) in runs["every_loss"].items():
        assert replay["train/routing_agreement"] == 1.0, loss
        for key in ("train/loss", "train/grad_norm"):
            assert replay[key] == pytest.approx(fresh[key], rel=1e-5, abs=1e-7), (loss, key)


def test_replaying_the_trainers_own_routes_changes_nothing(runs):
    # Equal to an ulp: measured 0 alone, 4.8e-7 at one token when other forwards ran before (CPU
    # kernels); rows transposed the wrong way, or other experts, move log-probs by > 1e-3.
    torch.testing.assert_close(runs["replay_own"], runs["fresh"], atol=1e-6, rtol=0)
    assert torch.equal(runs["fresh_given_routes"], runs["fresh"])  # routes without replay only feed the metric
    assert runs["metrics_own"]["train/routing_agreement"] == 1.0


def test_replaying_other_routes_changes_the_logprobs(runs):
    mask = make_batch(10, groups=2, group_size=4).response_mask.bool()
    assert (runs["replay_other"] - runs["fresh"])[mask].abs().max() > 1e-3
    assert runs["metrics_other"]["train/routing_agreement"] < 0.05  # the first update's own weights disagree


def test_recompute_in_backward_replays_the_same_routes(runs):
    plain, recompute = runs["recompute"]["plain"], runs["recompute"]["recompute"]
    assert plain["grads"].keys() == recompute["grads"].keys()
    for name, grad in plain["grads"].items():
        torch.testing.assert_close(recompute["grads"][name], grad, atol=1e-7, rtol=0, msg=name)
    assert recompute["left"] == [0, 0]  # the recompute popped what each forward pushed
    assert plain["left"] == [1, 1]  # without recompute nothing pops: only routes_for_schedule empties it


def test_backward_lists_are_emptied_after_every_schedule(runs):
    assert runs["backward_lists"] == [0, 0]


def test_replay_enabled_models_leave_megatrons_global_instance_list(runs):
    assert runs["global_instances"] == 0 and runs["global_instances_after"] == 0


def test_a_forward_of_another_shape_than_its_routes_is_refused(runs):
    length = make_batch(10, groups=2, group_size=4).tokens.shape[1]
    assert (
        f"routes {3 * length} token rows" in runs["row_error"] and f"given routes for {2 * length}" in runs["row_error"]
    )


def test_replay_with_the_fused_router_is_refused(runs):
    assert "moe_router_fusion" in runs["fusion_error"] and "moe.routing_replay=rollout" in runs["fusion_error"]


def test_replay_without_routes_names_the_key(runs):
    assert "moe.routing_replay=rollout" in runs["missing_error"] and "routes" in runs["missing_error"]


def test_dense_model_with_replay_names_the_key():
    from megatron_mugrpo.training.model import transformer_config_from_hf

    with pytest.raises(MoeConfigError, match=r"moe\.routing_replay"):
        transformer_config_from_hf(hf_config("qwen3"), dtype=torch.float32, moe=MoeConfig(routing_replay="rollout"))
    with pytest.raises(ValueError, match=r"moe\.routing_replay"):
        MoeConfig(routing_replay="engine")


# --------------------------------------------------------------------------------- pure parts


def test_rows_are_sequence_major_and_padding_gets_filler():
    # B=2 rows, L=3 positions, 1 MoE layer, k=2; row 1 holds 2 real tokens, row 0 three.
    routes = torch.tensor([[[[0, 1]], [[1, 2]], [[2, 3]]], [[[3, 0]], [[0, 2]], [[0, 0]]]])
    valid = torch.tensor([[True, True, True], [True, True, False]])
    rows = replay_rows(routes, valid, num_experts=4, topk=2, moe_layers=1)
    # row s*B + b: (b0,s0) (b1,s0) (b0,s1) (b1,s1) (b0,s2) (b1,s2 padding -> 0, 1)
    assert rows[0].tolist() == [[0, 1], [3, 0], [1, 2], [0, 2], [2, 3], [0, 1]]


def test_bad_routes_are_refused_with_what_is_wrong():
    valid = torch.ones(1, 2, dtype=torch.bool)
    good = torch.tensor([[[[0, 1]], [[2, 3]]]])
    with pytest.raises(RoutingReplayError, match="shape"):
        replay_rows(good[:, :, :, :1], valid, num_experts=4, topk=2, moe_layers=1)
    with pytest.raises(RoutingReplayError, match="shape"):
        replay_rows(good, valid, num_experts=4, topk=2, moe_layers=2)
    with pytest.raises(RoutingReplayError, match=r"outside \[0, 4\)"):
        replay_rows(good + 1, valid, num_experts=4, topk=2, moe_layers=1)
    with pytest.raises(RoutingReplayError, match="repeat an expert"):
        replay_rows(torch.tensor([[[[0, 1]], [[2, 2]]]]), valid, num_experts=4, topk=2, moe_layers=1)
    with pytest.raises(RoutingReplayError, match="cover 1 positions"):
        replay_rows(good[:, :1], valid, num_experts=4, topk=2, moe_layers=1)
    # a padding row of zeros (train_step's pad_rows) is not a real token and is accepted
    padded = torch.cat([good, torch.zeros_like(good)])
    rows = replay_rows(padded, torch.tensor([[True, True], [False, False]]), num_experts=4, topk=2, moe_layers=1)
    assert rows[0, 1].tolist() == [0, 1]


def test_real_tokens_are_prompt_plus_response_minus_its_last_token():
    # prompt of 3 tokens, response of 2: targets 2 and 3 are the response; inputs 0..3 are real
    mask = torch.tensor([[0.0, 0.0, 1.0, 1.0, 0.0, 0.0], [0.0] * 6])
    assert real_tokens(mask).tolist() == [[True, True, True, True, False, False], [False] * 6]


def test_stage_agreement_reports_the_first_update_and_the_mean():
    stage = StageRoutingAgreement()
    for value in (0.9, 0.8, 0.7):
        stage.add({"train/routing_agreement": value})
    stage.add({})  # an update without routes
    assert stage.summary() == pytest.approx(
        {"train/routing_agreement_first": 0.9, "train/routing_agreement_stage_mean": 0.8}
    )
    resumed = StageRoutingAgreement(from_first_update=False)  # a stage resumed after its first update
    resumed.add({"train/routing_agreement": 0.5})
    assert resumed.summary() == {"train/routing_agreement_stage_mean": 0.5}
    assert StageRoutingAgreement().summary() == {}  # a dense model's stage logs nothing
