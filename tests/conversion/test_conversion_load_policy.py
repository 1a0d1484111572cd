"""``load_hf_policy``: one call builds this rank's policy from a Hugging Face directory and loads its
weights, including into the optimizer's fp32 main copies (the step a two-call caller could forget)."""

from __future__ import annotations

from pathlib import Path

import torch
from conversion_helpers import make_hf_dir
from dist_utils import run_distributed
from safetensors.torch import load_file


def _load_policy(rank: int, world_size: int, hf_dir: str) -> None:
    from megatron_mugrpo.conversion import export_hf, load_hf_policy

    from megatron_mugrpo.training.optimizer import OptimConfig
    from megatron_mugrpo.training.parallel import initialize_parallel

    groups = initialize_parallel(1, 1, seed=0)
    policy = load_hf_policy(hf_dir, groups=groups, dtype=torch.bfloat16, optim=OptimConfig(lr=1e-4))
    expected = load_file(str(Path(hf_dir) / "model.safetensors"))
    exported = dict(export_hf(policy.unwrapped(), policy.hf_config, groups))
    assert exported.keys() == expected.keys()
    for name, tensor in exported.items():
        assert torch.equal(tensor, expected[name].to(torch.bfloat16)), name
    # bf16 parameters are stepped through fp32 main copies: they must hold the loaded weights, not the
    # random initialisation, or the first optimizer step would undo the load.
    optimizers = policy.optimizer.chained_optimizers  # megatron-core chains one optimizer per param group kind
    model_params = [p for opt in optimizers for group in opt.float16_groups for p in group]
    main_params = [p for opt in optimizers for group in opt.fp32_from_float16_groups for p in group]
    assert model_params and len(model_params) == len(main_params)
    for model_param, main_param in zip(model_params, main_params):
        assert torch.equal(main_param.to(torch.bfloat16), model_param.data)


def test_load_hf_policy_loads_model_and_optimizer_main_weights(tmp_path: Path) -> None:
    hf_dir = make_hf_dir(tmp_path / "qwen2", "qwen2", vocab_size=256)
    run_distributed(_load_policy, 1, str(hf_dir))
