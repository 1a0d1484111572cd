"""``export_hf`` on one rank: every HF tensor is a view of its parameter except q / k / v (the one
copy their per-group interleaving needs), and the weight sync into the transformers engine gives it
exactly the trainer's weights."""

from __future__ import annotations

from pathlib import Path

import torch
from conversion_helpers import make_hf_dir
from dist_utils import run_distributed
from safetensors.torch import load_file

QKV_NAMES = ("q_proj", "k_proj", "v_proj")


def _export_copies_only_qkv(rank: int, world_size: int, hf_dir: str) -> None:
    from megatron_mugrpo.conversion.hf_io import HfCheckpoint
    from megatron_mugrpo.conversion.live import export_hf, load_hf_into_model
    from megatron_mugrpo.conversion.megatron_io import build_model_chunks

    from megatron_mugrpo.rollout.transformers_engine import TransformersEngine
    from megatron_mugrpo.training.parallel import initialize_parallel

    groups = initialize_parallel(1, 1, seed=0)
    ckpt = HfCheckpoint(hf_dir)
    chunks = build_model_chunks(ckpt.config, torch.float32, groups)
    load_hf_into_model(chunks, ckpt, groups)
    storages = {p.untyped_storage().data_ptr() for p in chunks[0].parameters()}
    expected = load_file(str(Path(hf_dir) / "model.safetensors"))
    exported = dict(export_hf(chunks, ckpt.config, groups))
    assert exported.keys() == expected.keys()
    for name, tensor in exported.items():
        assert torch.equal(tensor, expected[name]), name
        is_view = tensor.untyped_storage().data_ptr() in storages
        assert is_view != any(part in name for part in QKV_NAMES), f"{name}: view={is_view}"

    engine = TransformersEngine(hf_dir, dtype="float32", device="cpu")
    engine.release()  # as between stages: the engine rebuilds its model before copying
    engine.load_weights(export_hf(chunks, ckpt.config, groups))
    for name, value in engine.model.state_dict().items():
        if name in expected:
            assert torch.equal(value, expected[name]), name


def test_export_copies_only_qkv_and_feeds_the_engine_exactly(tmp_path: Path) -> None:
    hf_dir = make_hf_dir(tmp_path / "qwen2", "qwen2", vocab_size=256)
    run_distributed(_export_copies_only_qkv, 1, str(hf_dir))
