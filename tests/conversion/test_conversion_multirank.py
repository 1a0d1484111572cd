"""Live TP × PP models against transformers, on 4 gloo ranks (one spawn: rank start-up dominates).

For each architecture, tied and untied, at TP ∈ {1, 2} × PP ∈ {1, 2}:
- ``load_hf_into_model`` + a pipeline forward gives transformers' float32 logits within LOGIT_ATOL;
- ``export_hf`` (TP all-gather, PP broadcast, fc1 / QKV un-interleave, vocab unpadding) gives back
  every HF tensor bit for bit.
Then the on-disk path: a checkpoint written at TP=2 × PP=2 is loaded at TP=1 × PP=2 (logits) and
exported at TP=1 × PP=1 into a HF directory identical, tensor by tensor, to the source.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conversion_helpers import make_hf_dir
from dist_utils import run_distributed
from safetensors.torch import load_file

from megatron_mugrpo.training.parallel import ParallelGroups

LOGIT_ATOL = 1e-5
"""float32 logits: Megatron and transformers differ only in summation order (measured ~2e-6)."""
LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]
LLAMA3_BAND = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,  # not Megatron's hard-coded 8192: exercises our inv_freq
}
VARIANTS = {
    "qwen2_untied": ("qwen2", False, {}),
    "qwen2_tied": ("qwen2", True, {}),
    "llama_untied": ("llama", False, {}),
    "llama_tied_band": ("llama", True, {"rope_scaling": LLAMA3_BAND}),
    "qwen3_untied": ("qwen3", False, {}),
    "qwen3_tied_v300": ("qwen3", True, {"vocab_size": 300}),  # padded to 384 at TP=1, 512 at TP=2
}
CHECKPOINT_VARIANTS = ("qwen3_tied_v300", "llama_untied")
WORLD_SIZE = 4


def _hf_tensors(hf_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(hf_dir / "model.safetensors"))


def _assert_bitwise_equal(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor], what: str) -> None:
    assert set(actual) == set(expected), f"{what}: names differ: {sorted(set(actual) ^ set(expected))}"
    for name, tensor in expected.items():
        other = actual[name].cpu()
        assert other.dtype == tensor.dtype and other.shape == tensor.shape, f"{what}: {name} dtype/shape"
        assert torch.equal(other.view(torch.uint8), tensor.view(torch.uint8)), f"{what}: {name} differs"


def _check_live(groups: ParallelGroups, hf_dir: Path, reference: torch.Tensor, tokens: torch.Tensor) -> None:
    """One model at the current TP × PP: logits against transformers, export bit for bit."""
    from megatron_mugrpo.conversion.hf_io import load_hf_config
    from megatron_mugrpo.conversion.live import export_hf, load_hf_into_model
    from megatron_mugrpo.conversion.megatron_io import build_model_chunks
    from megatron_mugrpo.conversion.verify import pipeline_forward_logits

    where = f"{hf_dir.name} tp={groups.tp} pp={groups.pp}"
    config = load_hf_config(hf_dir)
    chunks = build_model_chunks(config, torch.float32, groups)
    load_hf_into_model(chunks, hf_dir, groups)
    logits = pipeline_forward_logits(chunks, tokens, config["vocab_size"], groups)
    if logits is not None:
        diff = (logits - reference).abs().max().item()
        assert diff <= LOGIT_ATOL, f"{where}: max |logit diff| {diff:.2e} > {LOGIT_ATOL}"
    _assert_bitwise_equal(_hf_tensors(hf_dir), dict(export_hf(chunks, config, groups)), where)


def _check_bfloat16_export(groups: ParallelGroups, hf_dir: Path) -> None:
    """A bfloat16 model (the GPU training dtype) holds and exports exactly the bf16-cast HF tensors."""
    from megatron_mugrpo.conversion.hf_io import load_hf_config
    from megatron_mugrpo.conversion.live import export_hf, load_hf_into_model
    from megatron_mugrpo.conversion.megatron_io import build_model_chunks

    config = load_hf_config(hf_dir)
    chunks = build_model_chunks(config, torch.bfloat16, groups)
    load_hf_into_model(chunks, hf_dir, groups)
    expected = {name: t.to(torch.bfloat16) for name, t in _hf_tensors(hf_dir).items()}
    _assert_bitwise_equal(expected, dict(export_hf(chunks, config, groups)), f"{hf_dir.name} bfloat16")


def _check_checkpoint(hf_dir: Path, reference: torch.Tensor, tokens: torch.Tensor, work: Path) -> None:
    import torch.distributed as dist
    from megatron_mugrpo.conversion.convert import hf_to_megatron_on_rank, megatron_to_hf_on_rank
    from megatron_mugrpo.conversion.hf_io import load_hf_config
    from megatron_mugrpo.conversion.megatron_io import build_model_chunks, load_model
    from megatron_mugrpo.conversion.verify import pipeline_forward_logits

    from megatron_mugrpo.training import parallel

    step_dir, out_dir = work / "ckpt" / "step_00000000", work / "hf_out"
    groups = parallel.initialize_parallel(2, 2, seed=0)
    hf_to_megatron_on_rank(groups, str(hf_dir), str(work / "ckpt"), "float32")
    parallel.destroy_parallel()

    groups = parallel.initialize_parallel(1, 2, seed=0)  # resharding on load
    chunks = build_model_chunks(load_hf_config(hf_dir), torch.float32, groups)
    load_model(step_dir, chunks, groups)  # training.checkpoint.load_checkpoint
    logits = pipeline_forward_logits(chunks, tokens, reference.shape[-1], groups)
    if logits is not None:
        assert (logits - reference).abs().max().item() <= LOGIT_ATOL, f"{hf_dir.name}: checkpoint at tp=1 pp=2"
    parallel.destroy_parallel()

    groups = parallel.initialize_parallel(1, 1, seed=0)
    megatron_to_hf_on_rank(groups, str(step_dir), str(out_dir), "float32", None)
    parallel.destroy_parallel()
    dist.barrier()
    _assert_bitwise_equal(_hf_tensors(hf_dir), _hf_tensors(out_dir), f"{hf_dir.name} HF -> Megatron -> HF")


def _body(rank: int, world_size: int, root: str, tokens: torch.Tensor) -> None:
    from megatron_mugrpo.training import parallel

    root_path = Path(root)
    references = {name: torch.load(root_path / f"{name}.logits.pt") for name in VARIANTS}
    for tp, pp in LAYOUTS:  # layouts outside: creating Megatron's gloo groups is the slow part
        groups = parallel.initialize_parallel(tp, pp, seed=0)
        for name in VARIANTS:
            _check_live(groups, root_path / name, references[name], tokens)
        _check_bfloat16_export(groups, root_path / "qwen2_untied")
        parallel.destroy_parallel()
    for name in CHECKPOINT_VARIANTS:
        _check_checkpoint(root_path / name, references[name], tokens, root_path / f"work_{name}")


@pytest.mark.multiprocess
def test_live_models_and_checkpoints_match_transformers(tmp_path: Path) -> None:
    from megatron_mugrpo.conversion.verify import hf_logits, random_tokens

    tokens = random_tokens(256, batch=2, seq_len=12, seed=0)
    for name, (arch, tied, overrides) in VARIANTS.items():
        hf_dir = make_hf_dir(tmp_path / name, arch, tied=tied, seed=len(name), **overrides)
        torch.save(hf_logits(hf_dir, tokens), tmp_path / f"{name}.logits.pt")
    run_distributed(_body, WORLD_SIZE, str(tmp_path), tokens)
