"""Route recording on the transformers side (rollout.routes): a tiny Hugging Face Qwen3-MoE (3 layers,
the middle one dense, 8 experts top-2) driven through a decode loop like the transformers engine's
(left-padded prompts of different lengths, a KV cache, rows leaving the batch at different steps).

The routes recorded step by step equal, in float32, those of one teacher-forced forward over
prompt + response minus its last token, for every row (and without a KV cache too). Measured: equal
at every token and layer.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from route_checks import assert_routes_are_teacher_forced, teacher_forced_routes

from megatron_mugrpo.records import pad_routes
from megatron_mugrpo.rollout.routes import (
    RoutedGeneration,
    RouteRecorder,
    RouteRecordingError,
    route_bytes_per_token,
    route_dtype,
    routing_replay_problem,
)
from megatron_mugrpo.rollout.transformers_engine import left_pad, position_ids_from_mask
from megatron_mugrpo.training.model import tiny_hf_config

EXPERTS, TOPK = 8, 2
PROMPTS = [[5, 17, 33, 9, 41], [7, 3], [12, 99, 54], [8, 8, 21, 60, 2, 77, 14]]
RESPONSE_LENGTHS = [6, 1, 4, 9]
"""Row r leaves the batch after RESPONSE_LENGTHS[r] tokens (as at EOS; the last one at max_new_tokens)."""


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = tiny_hf_config(
        "qwen3_moe", num_hidden_layers=3, mlp_only_layers=[1], num_experts=EXPERTS, num_experts_per_tok=TOPK
    )
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**config)).eval()
    with torch.no_grad():  # initialised routers sit near a tie everywhere; make their choice decisive
        for layer in (0, 2):
            model.model.layers[layer].mlp.gate.weight.normal_(0.0, 1.0)
    return model


@torch.no_grad()
def _decode(model: torch.nn.Module, recorder: RouteRecorder, *, use_cache: bool = True) -> list[list[int]]:
    """The transformers engine's loop (sampling replaced by a seeded draw): returns each row's response."""
    from transformers import DynamicCache

    generator = torch.Generator().manual_seed(3)
    input_ids, mask = left_pad(PROMPTS, 0, torch.device("cpu"))
    positions = position_ids_from_mask(mask)
    cache = DynamicCache(config=model.config) if use_cache else None
    responses: list[list[int]] = [[] for _ in PROMPTS]
    active = torch.arange(len(PROMPTS))
    step_ids, step_pos = input_ids, positions
    recorder.begin([len(p) for p in PROMPTS])
    for _ in range(max(RESPONSE_LENGTHS)):
        recorder.step(active)
        logits = model(
            input_ids=step_ids, attention_mask=mask, position_ids=step_pos, past_key_values=cache, use_cache=use_cache
        ).logits[:, -1]
        token = torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(1)
        for i, row in enumerate(active.tolist()):
            responses[row].append(int(token[i]))
        keep = torch.tensor([len(responses[r]) < RESPONSE_LENGTHS[r] for r in active.tolist()]).nonzero().squeeze(1)
        if keep.numel() == 0:
            break
        if keep.numel() < active.numel():
            active, token, step_ids, mask, positions = (
                active[keep],
                token[keep],
                step_ids[keep],
                mask[keep],
                positions[keep],
            )
            if cache is not None:
                cache.batch_select_indices(keep)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        next_pos = positions[:, -1:] + 1
        positions = torch.cat([positions, next_pos], dim=1)
        if cache is not None:
            step_ids, step_pos = token[:, None], next_pos
        else:
            step_ids, step_pos = torch.cat([step_ids, token[:, None]], dim=1), positions
    return responses


@pytest.mark.parametrize("use_cache", [True, False])
def test_decode_routes_equal_teacher_forced_routes(model, use_cache):
    recorder = RouteRecorder(model)
    try:
        responses = _decode(model, recorder, use_cache=use_cache)
        assert [len(r) for r in responses] == RESPONSE_LENGTHS
        recorded = [recorder.routes(row) for row in range(len(PROMPTS))]
        for row, (prompt, response) in enumerate(zip(PROMPTS, responses)):
            routes = recorded[row]
            assert routes.shape == (len(prompt) + len(response) - 1, 2, TOPK) and routes.dtype == np.uint8
            expected = teacher_forced_routes(model, recorder, prompt + response[:-1])
            np.testing.assert_array_equal(routes, expected, err_msg=f"row {row}")
            assert (np.sort(routes, axis=-1)[..., 1:] != np.sort(routes, axis=-1)[..., :-1]).all()  # distinct
    finally:
        recorder.close()


def test_recorder_reads_the_block_routers_and_leaves_unarmed_forwards_alone(model):
    recorder = RouteRecorder(model)
    try:
        assert recorder.moe_layers == 2 and recorder.bytes_per_token == 4  # 2 sparse layers x top-2 x 1 byte
        with torch.no_grad():
            model(input_ids=torch.tensor([[5, 6, 7]]))  # no begin/step: a scoring pass, not recorded
        with pytest.raises(RouteRecordingError, match="no routes for row 0"):
            recorder.routes(0)
        recorder.begin([3, 2])
        with pytest.raises(RouteRecordingError, match="prefill forward must feed all 2 rows"):
            recorder.step([0])
        with pytest.raises(RouteRecordingError, match=r"distinct rows in \[0, 2\)"):
            recorder.step([0, 2])
    finally:
        recorder.close()
    assert all(not gate._forward_hooks for gate in (model.model.layers[0].mlp.gate, model.model.layers[2].mlp.gate))


def test_route_storage_is_one_byte_per_id_up_to_256_experts():
    assert route_dtype(4) == np.uint8 and route_dtype(256) == np.uint8
    assert route_dtype(257) == np.int16
    assert route_bytes_per_token(48, 8, 128) == 384  # Qwen3-30B-A3B: 48 MoE layers, top-8 of 128
    assert route_bytes_per_token(94, 8, 128) == 752  # Qwen3-235B-A22B
    with pytest.raises(RouteRecordingError, match="num_experts=0"):
        route_dtype(0)


def test_routed_generation_is_a_generation_with_routes():
    from megatron_mugrpo.rollout.engine import Generation

    gen = RoutedGeneration(
        response_ids=[4, 2], logprobs=[-0.1, -0.2], finish_reason="stop", routes=np.zeros((3, 2, 2), np.uint8)
    )
    assert isinstance(gen, Generation) and gen.routes.shape == (3, 2, 2)


def test_pad_routes_lays_rows_out_for_the_trainer_with_distinct_filler():
    rows = [np.array([[[3, 1]], [[0, 2]]], np.uint8), np.array([[[1, 2]]], np.uint8)]
    batch = pad_routes(rows, 3)
    assert batch.shape == (2, 3, 1, 2) and batch.dtype == torch.uint8
    assert batch[:, :, 0].tolist() == [[[3, 1], [0, 2], [0, 1]], [[1, 2], [0, 1], [0, 1]]]
    with pytest.raises(ValueError, match="do not fit"):
        pad_routes(rows, 1)


def test_run_configs_where_replay_cannot_work_are_refused_naming_the_key():
    from megatron_mugrpo.config import load_config
    from megatron_mugrpo.errors import ConfigError

    moe = ["model.tiny.arch=qwen3_moe", "moe.routing_replay=rollout"]
    assert load_config("configs/demo_moe_cpu.yaml", ["moe.routing_replay=rollout"]).moe.routing_replay == "rollout"
    with pytest.raises(ConfigError, match=r"moe\.routing_replay='rollout'.*model\.tiny\.arch='qwen2' is dense"):
        load_config("configs/demo_cpu.yaml", ["moe.routing_replay=rollout"])
    # async mode carries routes through the rollout queue (rollout.queue), HDR through its buffer (loop.hdr)
    assert load_config("configs/demo_cpu.yaml", [*moe, "mode=async"]).moe.routing_replay == "rollout"
    assert load_config("configs/demo_cpu.yaml", [*moe, "replay.enabled=true"]).replay.enabled
    assert routing_replay_problem("rollout", engine="vllm", tiny_arch="qwen3_moe").startswith(
        "moe.routing_replay='rollout' needs the experts"
    )
    assert routing_replay_problem("none", engine="vllm", tiny_arch="qwen2") == ""
    assert routing_replay_problem("rollout", engine="transformers", tiny_arch="qwen3_moe") == ""


def test_transformers_engine_records_each_responses_routes_as_the_trainer_feeds_them(model, tmp_path):
    """The engine's own decode loop (preallocated cache, rows leaving at EOS after compaction) under
    ``record_routes=True``: each generation carries len(prompt) + len(response) - 1 rows of routes,
    equal to a teacher-forced forward's, also for rows fed past their EOS before they left the batch."""
    from megatron_mugrpo.rollout.engine import SamplingParams
    from megatron_mugrpo.rollout.transformers_engine import TransformersEngine

    model.save_pretrained(tmp_path)
    eos = [3, 17, 41, 60, 99, 120, 200]  # common enough that rows stop at different steps
    engine = TransformersEngine(tmp_path, dtype=torch.float32, device="cpu", eos_token_ids=eos, record_routes=True)
    plain = TransformersEngine(tmp_path, dtype=torch.float32, device="cpu", eos_token_ids=eos)
    params = SamplingParams(temperature=1.0, max_new_tokens=12, seed=5)
    groups = engine.generate(PROMPTS, 3, params)
    assert [[g.response_ids for g in group] for group in groups] == [
        [g.response_ids for g in group] for group in plain.generate(PROMPTS, 3, params)
    ]  # recording changes nothing that is sampled
    lengths = {len(g.response_ids) for group in groups for g in group}
    assert len(lengths) > 2 and any(g.finish_reason == "stop" for group in groups for g in group)
    assert_routes_are_teacher_forced(engine.model, PROMPTS, groups, moe_layers=2, topk=TOPK)
    engine.release()
    assert engine.recorder is None
    assert not isinstance(plain.generate(PROMPTS[:1], 1, params)[0][0], RoutedGeneration)
