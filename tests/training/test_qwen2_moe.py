"""Qwen2-MoE on Megatron: the shared expert's sigmoid gate, logits equal to transformers', EP=2 equals EP=1.

``tiny_hf_config('qwen2_moe')`` (hidden 64, 2 layers, 4 experts top-2 without renormalisation, a
shared expert of width 48, QKV biases) is saved as a transformers checkpoint and loaded into the
trainer's model through the converter. Checked:

- the config carries the shared expert into megatron-core (width, gate on) and refuses what it
  cannot build, naming the key;
- megatron-core's ``SharedExpertMLP`` computes transformers' function ``sigmoid(x · w_gate) ·
  shared_expert(x)`` (hand-checked: a zero gate weight halves the MLP's output exactly; random
  weights: equal to the formula and to transformers' ``Qwen2MoeSparseMoeBlock`` parts);
- the whole model's float32 logits equal transformers' on a padded batch;
- one spawn at EP=2 (each rank 2 experts, the shared expert replicated) reproduces the single-rank
  logits, log-probs, gradients and one AdamW step; the shared expert learns (its weights change);
- routing replay (R3) end to end: the routes the rollout engines' ``RouteRecorder`` records from
  transformers' model, replayed with ``moe.routing_replay=rollout``, agree with the trainer's own
  routing and leave its log-probs as they are; rotated routes change them.

Measured (2 busy cores, float32, torch 2.13, megatron-core 0.16.1, transformers 5.23): the shared
expert equals the formula and transformers' parts bit for bit; logits vs transformers max |Δ| 1.7e-6;
EP=2 vs EP=1: logits bit-identical, log-probs (micro-batches of 2) within 9.5e-7 (2 ulp at |log p| ≈ 5),
|Δgrad| <= 2.6e-8, |Δw| after one AdamW step <= 1.9e-6 (Adam's first step is lr · g / (|g| + ε): a
gradient within a few ε of zero turns its 1e-8 difference into a weight difference of that order),
loss relative 1.7e-7; every shared-expert weight moved by >= 1e-3. Replay: routing agreement 1.0,
replayed vs fresh log-probs 9.5e-7, rotated routes move log-probs by up to 0.60.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from dist_utils import run_distributed

from megatron_mugrpo.training.model import ModelConfigError, tiny_hf_config, transformer_config_from_hf
from megatron_mugrpo.training.moe import MoeConfig, MoeConfigError
from megatron_mugrpo.training.optimizer import OptimConfig
from megatron_mugrpo.training.tiny import tiny_hf_dir

from .common import make_batch, max_abs_diff, mu_grpo_step

LOGIT_ATOL = 1e-5
"""float32 HF vs Megatron: different summation orders (fused QKV, expert permutation), far below this."""
EP_LOGIT_ATOL = 1e-6
EP_LOGPROB_ATOL = 1e-5
"""Micro-batched log-probs at EP=2 differ from EP=1 by a few float32 ulp (9.5e-7 measured; the
whole-batch logits are bit-identical), so they get a float32 tolerance rather than equality."""
GRAD_ATOL = 1e-5
WEIGHT_ATOL = 5e-6
LR = 1e-3
MICRO_BATCH = 2
EXPERTS = 4
CONFIG = tiny_hf_config("qwen2_moe", num_experts=EXPERTS)
MOE = MoeConfig(aux_loss_coeff=1e-2)
_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")


# ------------------------------------------------------------------------------ config


def test_config_carries_the_gated_shared_expert():
    cfg = transformer_config_from_hf(CONFIG, dtype=torch.float32, expert_parallel=2)
    assert (cfg.num_moe_experts, cfg.moe_router_topk, cfg.moe_ffn_hidden_size) == (4, 2, 32)
    assert cfg.moe_shared_expert_intermediate_size == 48 and cfg.moe_shared_expert_gate
    assert cfg.moe_router_pre_softmax  # norm_topk_prob=False: softmax over all experts, then top-k
    assert cfg.add_qkv_bias and not cfg.qk_layernorm
    qwen3 = transformer_config_from_hf(tiny_hf_config("qwen3_moe"), dtype=torch.float32)
    assert qwen3.moe_shared_expert_intermediate_size is None and not qwen3.moe_shared_expert_gate


def test_impossible_shared_experts_name_the_key():
    with pytest.raises(MoeConfigError, match="must divide shared_expert_intermediate_size=45"):
        transformer_config_from_hf(
            {**CONFIG, "shared_expert_intermediate_size": 45}, dtype=torch.float32, tensor_parallel=2
        )
    with pytest.raises(MoeConfigError, match="shared_expert_intermediate_size >= 1"):
        transformer_config_from_hf({**CONFIG, "shared_expert_intermediate_size": None}, dtype=torch.float32)
    with pytest.raises(MoeConfigError, match="has no shared expert"):
        transformer_config_from_hf(tiny_hf_config("qwen3_moe", shared_expert_intermediate_size=48), dtype=torch.float32)
    with pytest.raises(ModelConfigError, match="qkv_bias=false"):
        transformer_config_from_hf({**CONFIG, "qkv_bias": False}, dtype=torch.float32)
    with pytest.raises(MoeConfigError, match="num_experts=4"):
        transformer_config_from_hf(CONFIG, dtype=torch.float32, expert_parallel=3)


# ---------------------------------------------------------------------------- one rank


def _hf_shared_part(hf_dir: str, layer: int, x: torch.Tensor) -> torch.Tensor:
    """transformers' shared-expert term of ``Qwen2MoeSparseMoeBlock.forward`` for hidden states ``x`` [T, H]."""
    from transformers import AutoModelForCausalLM

    block = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).model.layers[layer].mlp
    with torch.no_grad():
        return F.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)


def _shared_expert_checks(model: torch.nn.Module, hf_dir: str) -> dict[str, float]:
    """|Δ| of megatron-core's shared expert against the formula and transformers; the zero-gate halving."""
    shared = model.decoder.layers[0].mlp.shared_experts
    x = torch.randn(5, 3, CONFIG["hidden_size"], generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = shared(x)
        fc1, fc2, gate = shared.linear_fc1.weight, shared.linear_fc2.weight, shared.gate_weight
        up_gate = x @ fc1.T  # [gate rows; up rows] at TP=1
        mlp = (F.silu(up_gate[..., :48]) * up_gate[..., 48:]) @ fc2.T
        formula = torch.sigmoid(x @ gate.T) * mlp
        hf = _hf_shared_part(hf_dir, 0, x.reshape(15, -1)).reshape(5, 3, -1)
        saved = gate.clone()
        gate.zero_()
        halved = shared(x)
        gate.copy_(saved)
    return {
        "formula": float((out - formula).abs().max()),
        "transformers": float((out - hf).abs().max()),
        "zero_gate_halves": float((halved - 0.5 * mlp).abs().max()),
        "gate_shape": list(gate.shape),
    }


def _redraw(model: torch.nn.Module) -> None:
    """Weights N(0, 0.1), norms around 1: an initialised router sits near a tie everywhere, where 1e-7 of
    summation-order noise would flip experts and the comparison with transformers would test the tie."""
    generator = torch.Generator().manual_seed(7)
    for name, param in model.named_parameters():
        noise = torch.randn(param.shape, generator=generator)
        param.copy_(1.0 + 0.1 * noise if "norm" in name else 0.1 * noise)


def _gathered(policy: Any, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``values`` by single-rank name (local expert j of EP rank r is r × E/EP + j), every rank's experts."""
    groups, local = policy.groups, EXPERTS // policy.groups.ep
    mine = {
        _EXPERT.sub(lambda m: f".local_experts.{groups.ep_rank * local + int(m.group(1))}.", name): v.detach().clone()
        for name, v in values.items()
    }
    return {name: value for part in groups.all_gather(mine) for name, value in part.items()}


def _params(policy: Any) -> dict[str, torch.Tensor]:
    return _gathered(policy, dict(policy.unwrapped()[0].named_parameters()))


def _grads(policy: Any) -> dict[str, torch.Tensor]:
    return _gathered(policy, {n: p.main_grad for n, p in policy.unwrapped()[0].named_parameters()})


def _run(rank: int, world_size: int, hf_dir: str, out: str) -> None:
    """Build the policy at EP = world size from ``hf_dir``; logits, log-probs, one update, its gradients."""
    from megatron_mugrpo.conversion import load_hf_policy

    from megatron_mugrpo.training.parallel import initialize_parallel
    from megatron_mugrpo.training.train_step import forward_logprobs

    torch.use_deterministic_algorithms(True)
    groups = initialize_parallel(1, 1, seed=1234, ep=world_size)
    policy = load_hf_policy(hf_dir, groups=groups, dtype=torch.float32, optim=OptimConfig(lr=LR), moe=MOE)
    bare = policy.unwrapped()[0]
    result: dict[str, Any] = {}
    if world_size == 1:
        result["shared"] = _shared_expert_checks(bare, hf_dir)
    batch = make_batch(10, groups=2, group_size=4)
    bare.eval()
    with torch.no_grad():
        positions = torch.arange(batch.tokens.shape[1]).expand_as(batch.tokens)
        result["logits"] = bare(batch.tokens, positions, None)[..., : policy.vocab_size].clone()
    bare.train()
    result["tokens"] = batch.tokens
    result["logprobs"] = forward_logprobs(policy, batch, temperature=1.0, micro_batch_size=MICRO_BATCH)
    result["init"] = _params(policy)
    result["metrics"] = mu_grpo_step(policy, batch, MICRO_BATCH)
    result["grads"], result["params"] = _grads(policy), _params(policy)
    if rank == 0:
        torch.save(result, Path(out) / f"ep{world_size}.pt")


def _recorded_routes(hf_dir: str) -> torch.Tensor:
    """The routes transformers' model takes on the test batch ([B, L, 2 layers, k], uint8), recorded by
    the rollout engines' ``RouteRecorder`` over each whole (padded) row: what R3 hands the trainer."""
    from transformers import AutoModelForCausalLM

    from megatron_mugrpo.rollout.routes import RouteRecorder

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    tokens = make_batch(10, groups=2, group_size=4).tokens
    recorder = RouteRecorder(model)
    try:
        recorder.begin([tokens.shape[1]] * tokens.shape[0])
        recorder.step(range(tokens.shape[0]))
        with torch.no_grad():
            model(input_ids=tokens)
        return torch.stack([torch.from_numpy(recorder.routes(row)) for row in range(tokens.shape[0])])
    finally:
        recorder.close()


def _replay(rank: int, world_size: int, hf_dir: str, out: str) -> None:
    """moe.routing_replay=rollout: log-probs replaying transformers' routes and rotated ones, and one
    update's agreement with transformers' routes."""
    import dataclasses

    from megatron_mugrpo.conversion import load_hf_policy

    from megatron_mugrpo.training.parallel import initialize_parallel
    from megatron_mugrpo.training.train_step import forward_logprobs

    groups = initialize_parallel(1, 1, seed=1234)
    moe = MoeConfig(aux_loss_coeff=1e-2, routing_replay="rollout")
    policy = load_hf_policy(hf_dir, groups=groups, dtype=torch.float32, optim=OptimConfig(lr=LR), moe=moe)
    routes = torch.load(Path(out) / "routes.pt")
    batch = dataclasses.replace(make_batch(10, groups=2, group_size=4), routes=routes)
    rotated = dataclasses.replace(batch, routes=(routes + 1) % EXPERTS)  # still k distinct experts
    result = {
        "own": forward_logprobs(policy, batch, temperature=1.0, micro_batch_size=MICRO_BATCH),
        "rotated": forward_logprobs(policy, rotated, temperature=1.0, micro_batch_size=MICRO_BATCH),
    }
    result["metrics"] = mu_grpo_step(policy, batch, MICRO_BATCH)
    torch.save(result, Path(out) / "replay.pt")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("qwen2_moe")
    hf_dir = tiny_hf_dir(
        root / "hf", "qwen2_moe", seed=0, tokenizer=False, adjust=_redraw, num_experts=EXPERTS, vocab_size=100
    )
    run_distributed(_run, 1, str(hf_dir), str(root))
    run_distributed(_run, 2, str(hf_dir), str(root))
    torch.save(_recorded_routes(str(hf_dir)), root / "routes.pt")
    run_distributed(_replay, 1, str(hf_dir), str(root))
    return {"hf_dir": hf_dir, **{name: torch.load(root / f"{name}.pt") for name in ("ep1", "ep2", "replay")}}


@pytest.mark.multiprocess
def test_shared_expert_computes_transformers_sigmoid_gate(runs):
    shared = runs["ep1"]["shared"]
    assert shared["gate_shape"] == [1, CONFIG["hidden_size"]]
    assert shared["zero_gate_halves"] == 0.0  # sigmoid(0) = 1/2, exactly
    assert shared["formula"] < 1e-6 and shared["transformers"] < 1e-6, shared


@pytest.mark.multiprocess
def test_logits_equal_transformers_in_float32(runs):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(runs["hf_dir"]), dtype=torch.float32).eval()
    with torch.no_grad():
        expected = model(input_ids=runs["ep1"]["tokens"]).logits
    diff = float((runs["ep1"]["logits"] - expected).abs().max())
    assert diff < LOGIT_ATOL, f"max |logit diff| Megatron vs transformers = {diff:.3g}"


@pytest.mark.multiprocess
def test_ep2_matches_ep1_and_the_shared_expert_learns(runs):
    ours, ref = runs["ep2"], runs["ep1"]
    torch.testing.assert_close(ours["logits"], ref["logits"], atol=EP_LOGIT_ATOL, rtol=0)
    torch.testing.assert_close(ours["logprobs"], ref["logprobs"], atol=EP_LOGPROB_ATOL, rtol=0)
    assert max_abs_diff(ours["grads"], ref["grads"]) < GRAD_ATOL
    assert max_abs_diff(ours["params"], ref["params"]) < WEIGHT_ATOL
    assert ours["metrics"]["train/loss"] == pytest.approx(ref["metrics"]["train/loss"], rel=1e-6)
    shared = [name for name in ref["params"] if ".shared_experts." in name]
    assert len(shared) == 2 * 3  # 2 sparse layers × (fc1, fc2, gate_weight)
    for name in shared:
        assert float(ref["grads"][name].abs().max()) > 1e-6, name
        assert not torch.equal(ref["params"][name], ref["init"][name]), name


@pytest.mark.multiprocess
def test_replaying_transformers_routes_reproduces_fresh_routing(runs):
    """R3 end to end on Qwen2-MoE: transformers' recorded routes are the trainer's own choice, so replaying
    them leaves the log-probs as they are (the shared expert is not routed and is unaffected); routes
    that are not the router's own change them."""
    replay, fresh = runs["replay"], runs["ep1"]["logprobs"]
    assert replay["metrics"]["train/routing_agreement"] == 1.0
    torch.testing.assert_close(replay["own"], fresh, atol=EP_LOGPROB_ATOL, rtol=0)
    assert float((replay["rotated"] - fresh).abs().max()) > 1e-3
