"""SGLang's routed experts → routes (rollout.sglang_engine, routing replay). No GPU here: the parsing is
tested on outputs shaped as SGLang's source writes them (0.5.10 and 0.5.23: ``meta_info["routed_experts"]``
= base64 of int32 [prompt + output tokens - 1, num_hidden_layers, k]), and the engine's flags
(server argument ``enable_return_routed_experts``, request flag ``return_routed_experts``) against the
stand-in of each checked-in snapshot, which refuses keywords the real signatures do not have.
"""

from __future__ import annotations

import base64
import json
import sys

import numpy as np
import pytest
import torch
from sglang_standin import build_module, load_snapshot, snapshot_versions

from megatron_mugrpo.rollout import sglang_engine
from megatron_mugrpo.rollout.engine import SamplingParams
from megatron_mugrpo.rollout.routes import RoutedGeneration, RouteRecordingError, route_layout
from megatron_mugrpo.rollout.sglang_engine import SGLangContractError, SGLangEngine, routes_from_output
from megatron_mugrpo.training.model import tiny_hf_config

CONFIG = tiny_hf_config("qwen3_moe", vocab_size=32, num_hidden_layers=3, mlp_only_layers=[1], num_experts=8)
LAYOUT = route_layout(CONFIG)  # layers 0 and 2 route, top-2 of 8


def _sglang_routed_experts(routes: np.ndarray) -> str:
    """What SGLang puts in meta_info["routed_experts"]: pybase64.b64encode(tensor.numpy().tobytes()).decode()."""
    return base64.b64encode(np.ascontiguousarray(routes, dtype=np.int32).tobytes()).decode("utf-8")


def _output(prompt_len: int, response: list[int], routes: np.ndarray) -> dict:
    """One ``Engine.generate`` output with return_logprob and return_routed_experts, as SGLang returns it."""
    return {
        "text": "",
        "output_ids": response,
        "meta_info": {
            "id": "req0",
            "finish_reason": {"type": "stop", "matched": response[-1]},
            "prompt_tokens": prompt_len,
            "completion_tokens": len(response),
            "cached_tokens": 0,
            "output_token_logprobs": [(-0.5, t, None) for t in response],
            "routed_experts": _sglang_routed_experts(routes),
        },
    }


def _all_layer_routes(tokens: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.stack([[rng.permutation(8)[:2] for _ in range(3)] for _ in range(tokens)])  # [T, 3 layers, 2]


def test_routes_keep_the_sparse_layers_of_prompt_plus_response_minus_one():
    everything = _all_layer_routes(3 + 4 - 1)
    routes = routes_from_output(_output(3, [5, 6, 7, 1], everything), prompt_len=3, response_len=4, layout=LAYOUT)
    assert routes.dtype == np.uint8 and routes.shape == (6, 2, 2)
    np.testing.assert_array_equal(routes, everything[:, [0, 2]])


def test_bad_routed_experts_are_refused_with_what_is_wrong():
    output = _output(3, [5, 1], _all_layer_routes(4))
    with pytest.raises(SGLangContractError, match="expected 3 tokens"):
        routes_from_output(output, prompt_len=2, response_len=2, layout=LAYOUT)
    output["meta_info"]["routed_experts"] = _sglang_routed_experts(np.full((4, 3, 2), 8))
    with pytest.raises(SGLangContractError, match=r"outside \[0, 8\)"):
        routes_from_output(output, prompt_len=3, response_len=2, layout=LAYOUT)
    del output["meta_info"]["routed_experts"]
    with pytest.raises(SGLangContractError, match="enable_return_routed_experts"):
        routes_from_output(output, prompt_len=3, response_len=2, layout=LAYOUT)
    with pytest.raises(RouteRecordingError, match="no experts"):
        route_layout(tiny_hf_config("qwen3"))


@pytest.mark.parametrize("version", snapshot_versions())
def test_engine_asks_sglang_for_routed_experts_and_returns_routed_generations(version, tmp_path, monkeypatch):
    module = build_module(load_snapshot(version))
    monkeypatch.setitem(sys.modules, "sglang", module)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv(sglang_engine.ORIGINAL_LOGPROB_ENV, raising=False)
    answer = module.Engine._one

    def with_routes(self, ids, params, return_logprob):  # SGLang's capturer, as the source fills it
        out = answer(self, ids, params, return_logprob)
        tokens = len(ids) + len(out["output_ids"]) - 1
        out["meta_info"]["routed_experts"] = _sglang_routed_experts(_all_layer_routes(tokens, seed=tokens))
        return out

    monkeypatch.setattr(module.Engine, "_one", with_routes)
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    engine = SGLangEngine(str(tmp_path), record_routes=True)
    assert module.recorder.engines[0].server_args["enable_return_routed_experts"] is True
    prompts = [[3, 4, 5], [6, 7]]
    groups = engine.generate(prompts, n=2, params=SamplingParams(max_new_tokens=5, seed=1))
    generate_calls = [args for _, name, args in module.recorder.calls if name == "generate"]
    assert generate_calls and all(call.get("return_routed_experts") is True for call in generate_calls)
    for prompt, group in zip(prompts, groups):
        for gen in group:
            assert isinstance(gen, RoutedGeneration)
            tokens = len(prompt) + len(gen.response_ids) - 1
            np.testing.assert_array_equal(gen.routes, _all_layer_routes(tokens, seed=tokens)[:, [0, 2]])


def test_engine_without_record_routes_asks_for_nothing(tmp_path, monkeypatch):
    module = build_module(load_snapshot(snapshot_versions()[-1]))
    monkeypatch.setitem(sys.modules, "sglang", module)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv(sglang_engine.ORIGINAL_LOGPROB_ENV, raising=False)
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    groups = SGLangEngine(str(tmp_path)).generate([[3, 4]], n=1, params=SamplingParams(max_new_tokens=3))
    assert "enable_return_routed_experts" not in module.recorder.engines[0].server_args
    generate_call = next(args for _, name, args in module.recorder.calls if name == "generate")
    assert generate_call.get("return_routed_experts") is None
    assert not isinstance(groups[0][0], RoutedGeneration)
