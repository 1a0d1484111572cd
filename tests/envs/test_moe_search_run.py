"""A staged multi-turn search run on a tiny Qwen3-MoE with routing replay (moe.routing_replay=rollout), through
the CLI.

The base model writes searches (``test_async_search_run.SEARCH_CHAIN``: its residual stream carries the current
token's embedding, attention and experts add nothing) and its routers are set decisive, so trajectories hold
observations. The transformers engine records the experts of every position it feeds (prompt, sampled tokens,
the observation tokens it prefills); the store keeps them beside each shard; the trainer replays them over
prompt + trajectory. At the first update the trainer's weights are β's, so its own routing must choose the
recorded experts at every (real token, MoE layer), observation positions included: train/routing_agreement is
exactly 1.0.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from test_async_search_run import CONFIG, SEARCH_CHAIN

from megatron_mugrpo.envs.fictional import write_task
from megatron_mugrpo.rollout.store import RolloutStore

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from e2e_runs import mugrpo, records

POSITIONS = 448
EXPERTS, TOPK = 4, 2


def searching_moe_model(out: Path) -> Path:
    """A tiny Qwen3-MoE (2 layers, 4 experts top-2) with the character tokenizer whose samples follow
    ``SEARCH_CHAIN``; its routers see each token's one-hot embedding through a N(0, 1) gate, so each token's
    top-2 is far from a tie (the trainer, in Megatron, must choose exactly the engine's experts)."""
    from megatron_mugrpo.char_tokenizer import build_char_tokenizer
    from megatron_mugrpo.warmstart import TinyModelConfig, build_tiny_model

    tokenizer = build_char_tokenizer(out)
    tiny = TinyModelConfig(
        arch="qwen3_moe",
        hidden_size=64,
        num_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=POSITIONS,
        tie_word_embeddings=False,
        num_experts=EXPERTS,
        num_experts_per_tok=TOPK,
        moe_intermediate_size=32,
    )
    model = build_tiny_model(tiny, tokenizer, seed=0)
    vocab, states = tokenizer.get_vocab(), list(SEARCH_CHAIN)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        embedding, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
        embedding.zero_()
        embedding[:, 0] = 1.0  # state 0: any character outside the chain, followed by '<'
        head.zero_()
        head[vocab["<"], 0] = 20.0 / math.sqrt(tiny.hidden_size)  # the final RMSNorm scales a unit vector by √H
        for state, char in enumerate(states, start=1):
            embedding[vocab[char]] = 0.0
            embedding[vocab[char], state] = 1.0
            for after, p in SEARCH_CHAIN[char].items():
                head[vocab[after], state] = (20.0 + math.log(p)) / math.sqrt(tiny.hidden_size)
        for layer in model.model.layers:  # the residual stream keeps the current token's embedding
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.experts.down_proj.zero_()
            layer.mlp.gate.weight.copy_(torch.randn(layer.mlp.gate.weight.shape, generator=generator))
        model.model.norm.weight.fill_(1.0)
    model.save_pretrained(str(out), safe_serialization=True)
    return out


@pytest.mark.slow
def test_a_staged_moe_search_run_replays_the_routes_of_every_trajectory_position(tmp_path: Path):
    data = tmp_path / "data"
    write_task(data, 0, people=12, cities=4)
    base, run_dir = searching_moe_model(tmp_path / "base"), tmp_path / "run"
    mugrpo(
        "train",
        "--config",
        str(CONFIG),
        "--run-dir",
        str(run_dir),
        f"model.hf_dir={base}",
        f"data.train_path={data / 'train.jsonl'}",
        f"env.search.corpus={data / 'corpus.jsonl'}",
        "moe.routing_replay=rollout",
        "env.max_turns=2",
        f"env.max_total_tokens={POSITIONS}",
        "env.max_observation_tokens=96",
        "rollout.max_prompt_tokens=320",
        "rollout.max_new_tokens=40",
        "rollout.group_size=4",
        "rollout.cpu_threads=1",
        "stages.num_stages=1",
        "stages.train_groups=2",
        "stages.mini_groups=2",
        "parallel.micro_batch_size=8",
        "eval.benchmarks=[]",
        "logging.progress_bars=false",
        "logging.tensorboard=false",
        "logging.report=false",
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
