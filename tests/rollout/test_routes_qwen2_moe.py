"""Route recording on a Hugging Face Qwen2-MoE: the recorder hooks the routers, not the shared-expert gate.

Qwen2-MoE's sparse block (``Qwen2MoeSparseMoeBlock``) holds ``gate`` (the top-k router over the
routed experts), ``experts``, ``shared_expert`` and ``shared_expert_gate`` (a [1, hidden] linear whose
sigmoid scales the shared expert). ``RouteRecorder`` looks for modules with ``experts`` and ``gate``,
so it must hook ``mlp.gate`` of each sparse layer and nothing else. Checked on a tiny model (3
layers, the middle one dense, 8 experts top-2, a shared expert): the hooked modules are exactly the
sparse layers' routers; a teacher-forced forward's recorded ids equal the top-k of softmax(x · Wᵀ)
computed from each router's input; the transformers engine's decode loop with ``record_routes=True``
gives each generation the routes of a teacher-forced forward over prompt + response - 1.
Measured: equal at every token and layer. The engine's weight sync (``copy_weights``) fills a fresh
model's fused experts and its shared expert from released-checkpoint names: logits bit-identical.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from route_checks import assert_routes_are_teacher_forced, teacher_forced_routes

from megatron_mugrpo.rollout.routes import RouteRecorder
from megatron_mugrpo.training.model import tiny_hf_config

EXPERTS, TOPK = 8, 2
SPARSE_LAYERS = (0, 2)
PROMPTS = [[5, 17, 33, 9, 41], [7, 3], [12, 99, 54]]


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(0)
    config = tiny_hf_config(
        "qwen2_moe", num_hidden_layers=3, mlp_only_layers=[1], num_experts=EXPERTS, num_experts_per_tok=TOPK
    )
    model = Qwen2MoeForCausalLM(Qwen2MoeConfig(**config)).eval()
    with torch.no_grad():  # initialised routers sit near a tie everywhere; make their choice decisive
        for layer in SPARSE_LAYERS:
            model.model.layers[layer].mlp.gate.weight.normal_(0.0, 1.0)
            model.model.layers[layer].mlp.shared_expert_gate.weight.normal_(0.0, 1.0)
    return model


def test_recorder_hooks_the_routers_and_not_the_shared_expert_gate(model):
    blocks = [model.model.layers[i].mlp for i in SPARSE_LAYERS]
    recorder = RouteRecorder(model)
    try:
        assert recorder.moe_layers == 2 and recorder.bytes_per_token == 2 * TOPK  # uint8 ids
        hooked = [m for m in model.modules() if m._forward_hooks]
        assert hooked == [block.gate for block in blocks]
        assert all(not block.shared_expert_gate._forward_hooks for block in blocks)
    finally:
        recorder.close()
    assert not any(m._forward_hooks for m in model.modules())


def test_recorded_ids_are_the_top_k_of_each_router_s_own_softmax(model):
    """Expected ids from the router's input and weight alone: softmax(x · Wᵀ) over the 8 experts, top-2."""
    inputs: dict[int, torch.Tensor] = {}
    handles = [
        model.model.layers[i].mlp.gate.register_forward_pre_hook(
            lambda _m, args, i=i: inputs.__setitem__(i, args[0].detach().reshape(-1, args[0].shape[-1]))
        )
        for i in SPARSE_LAYERS
    ]
    recorder = RouteRecorder(model)
    try:
        tokens = [5, 17, 33, 9, 41, 7, 3]
        routes = teacher_forced_routes(model, recorder, tokens)
    finally:
        recorder.close()
        for handle in handles:
            handle.remove()
    assert routes.shape == (len(tokens), 2, TOPK) and routes.dtype == np.uint8
    for slot, layer in enumerate(SPARSE_LAYERS):
        weight = model.model.layers[layer].mlp.gate.weight
        expected = torch.softmax((inputs[layer] @ weight.T).float(), dim=-1).topk(TOPK, dim=-1).indices
        np.testing.assert_array_equal(routes[:, slot], expected.numpy().astype(np.uint8), err_msg=f"layer {layer}")


def test_transformers_engine_records_qwen2_moe_routes_as_the_trainer_feeds_them(model, tmp_path):
    from megatron_mugrpo.rollout.engine import SamplingParams
    from megatron_mugrpo.rollout.transformers_engine import TransformersEngine

    model.save_pretrained(tmp_path)
    eos = [3, 17, 41, 60, 99, 120, 200]  # common enough that rows stop at different steps
    engine = TransformersEngine(tmp_path, dtype=torch.float32, device="cpu", eos_token_ids=eos, record_routes=True)
    groups = engine.generate(PROMPTS, 2, SamplingParams(temperature=1.0, max_new_tokens=8, seed=5))
    assert_routes_are_teacher_forced(engine.model, PROMPTS, groups, moe_layers=2, topk=TOPK)
    engine.release()


def test_weight_sync_fills_fused_experts_and_the_shared_expert(model, tmp_path):
    """The trainer → engine sync sends released-checkpoint names (``mlp.experts.{e}.*``,
    ``mlp.shared_expert.*``, ``mlp.shared_expert_gate.weight``); the engine's model must end up equal."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from megatron_mugrpo.rollout.transformers_engine import copy_weights

    model.save_pretrained(tmp_path)
    saved = load_file(str(tmp_path / "model.safetensors"))
    assert "model.layers.2.mlp.shared_expert_gate.weight" in saved
    fresh = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(tmp_path))).eval()
    copy_weights(fresh, saved.items())
    ids = torch.tensor([[1, 7, 9, 11, 13]])
    with torch.no_grad():
        assert torch.equal(fresh(ids).logits, model(ids).logits)
    partial = {k: v for k, v in saved.items() if k != "model.layers.0.mlp.shared_expert.up_proj.weight"}
    with pytest.raises(ValueError, match=r"shared_expert\.up_proj"):
        copy_weights(fresh, partial.items())
