"""The plan's activation estimate is within 25% of what the demo models keep for backward on CPU.

Measured: one forward of the tiny demo model (megatron-core's local layer spec, float32) at the demo's
micro-batch shape, with a ``torch.autograd.graph.saved_tensors_hooks`` pack hook summing the storages
of every tensor autograd saves for backward, parameters excluded, each storage once. That is the
activation memory a micro-batch holds from its forward to its backward; the plan is compared with its
unfused-kernel (CPU) estimate (``plan.memory.ActivationInputs.fused_kernels=False``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from dist_utils import run_distributed

from megatron_mugrpo.config import load_config
from megatron_mugrpo.plan.inputs import tiny_hf_fields
from megatron_mugrpo.plan.memory import ActivationInputs, activation_bytes
from megatron_mugrpo.plan.models import ModelShape, RankLayout

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
TOLERANCE = 0.25


def _measure(rank: int, world: int, config: str, out: list) -> None:
    from megatron_mugrpo.training.model import build_gpt_model
    from megatron_mugrpo.training.parallel import initialize_parallel

    cfg = load_config(CONFIGS / config)
    groups = initialize_parallel(1, 1, seed=0)
    hf = tiny_hf_fields(cfg.model.tiny)
    model = build_gpt_model(hf, groups, dtype=torch.float32)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    rows, length = cfg.parallel.micro_batch_size, cfg.rollout.max_prompt_tokens + cfg.rollout.max_new_tokens
    ids = torch.randint(0, hf["vocab_size"], (rows, length))
    positions = torch.arange(length).expand(rows, length)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(ids, positions, None)
    inputs = ActivationInputs(
        tokens=rows * length,
        seq_len=length,
        dtype_bytes=4,
        sequence_parallel=False,
        fused_kernels=False,
        in_flight=1,
    )
    out.append((activation_bytes(ModelShape.from_hf(hf), RankLayout(tp=1, pp=1), inputs), sum(saved.values())))


@pytest.mark.parametrize("config", ["demo_cpu.yaml", "demo_moe_cpu.yaml", "demo_code_cpu.yaml"])
def test_activation_estimate_is_within_a_quarter_of_the_measured(config: str) -> None:
    out: list = []
    run_distributed(_measure, 1, config, out)  # in this process: ``out`` comes back filled
    planned, measured = out[0]
    assert measured > 0 and abs(planned - measured) <= TOLERANCE * measured, (planned, measured)
