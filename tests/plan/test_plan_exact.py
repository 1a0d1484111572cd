"""The plan's weights, gradients and optimizer-state bytes equal what the trainer allocates, byte for byte.

One spawn of 4 gloo ranks builds the trainer's policy (``training.setup.build_policy``: Megatron DDP with
fp32 gradient buffers, the optimizer, one step to create Adam's state) in several layouts of the tiny
CPU configs, and compares each rank's allocated bytes with ``plan.memory.static_bytes`` for that rank:

- configs/demo_cpu.yaml's model at TP 2 (DP 2) with the distributed optimizer (padded buffers);
- the same at PP 2 with its tied embedding split over the two stages (its own bucket);
- configs/demo_moe_cpu.yaml's model at EP 2 (expert DP 2, dense DP 4) with the distributed optimizer;
- the dense model in bfloat16 at TP 2 without the distributed optimizer (fp32 main copies).

Allocated bytes are counted by storage (``plan.run_plan.allocated_static_bytes``, which a run's
memory.json records too), so a parameter that is a view into DDP's buffer is counted once, as the buffer.
"""

from __future__ import annotations

from pathlib import Path

import torch
from dist_utils import run_distributed

from megatron_mugrpo.plan.inputs import tiny_hf_fields
from megatron_mugrpo.plan.memory import TrainerLayout, static_bytes
from megatron_mugrpo.plan.models import ModelShape, RankLayout, rank_tensors
from megatron_mugrpo.plan.run_plan import allocated_static_bytes
from megatron_mugrpo.warmstart import TinyModelConfig

ROOT = Path(__file__).resolve().parents[2]
WORLD = 4
DENSE = TinyModelConfig()  # configs/demo_cpu.yaml's model.tiny (the defaults), checked below
MOE = TinyModelConfig(arch="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)
LAYOUTS = [
    # (name, tiny model, tp, pp, ep, distributed optimizer, dtype)
    ("dense_tp2_dist", DENSE, 2, 1, 1, True, torch.float32),
    ("dense_pp2_tied_dist", DENSE, 1, 2, 1, True, torch.float32),
    ("moe_ep2_dist", MOE, 1, 1, 2, True, torch.float32),
    ("dense_tp2_bf16", DENSE, 2, 1, 1, False, torch.bfloat16),
]


def _layout(rank: int, world: int) -> None:
    from megatron.core import parallel_state

    from megatron_mugrpo.training.optimizer import OptimConfig
    from megatron_mugrpo.training.parallel import destroy_parallel, initialize_parallel
    from megatron_mugrpo.training.setup import build_policy

    for name, tiny, tp, pp, ep, distributed, dtype in LAYOUTS:
        groups = initialize_parallel(tp, pp, seed=0, ep=ep, etp=1 if ep > 1 else None)
        hf = tiny_hf_fields(tiny)
        policy = build_policy(
            hf, groups=groups, dtype=dtype, optim=OptimConfig(), use_distributed_optimizer=distributed
        )
        policy.optimizer.step()  # Adam's moments exist only after the first step
        got = allocated_static_bytes(policy)
        actual = (got["weights"], got["grads"], got["optimizer"])
        shape = ModelShape.from_hf(hf)
        model = RankLayout(tp=tp, pp=pp, ep=ep, etp=1 if ep > 1 else tp)
        edp = world // (pp * model.etp * ep)
        layout = TrainerLayout(model=model, dp=world // (tp * pp), edp=edp, distributed_optimizer=distributed)
        planned = static_bytes(
            shape,
            layout,
            dtype_bytes=dtype.itemsize,
            pp_rank=groups.pp_rank,
            dp_rank=groups.dp_rank,
            edp_rank=parallel_state.get_expert_data_parallel_rank(),
        )
        # The planned tensor list is the model's, tensor for tensor.
        numels = [p.numel() for chunk in policy.model_chunks for p in chunk.module.parameters()]
        assert numels == [t.numel for t in rank_tensors(shape, model, groups.pp_rank)], name
        assert (planned.weights, planned.grads, planned.optimizer) == actual, (name, rank, planned, actual)
        del policy
        destroy_parallel()


def test_tiny_layouts_match_the_demo_configs() -> None:
    import yaml

    demo = yaml.safe_load((ROOT / "configs" / "demo_cpu.yaml").read_text())["model"]["tiny"]
    assert all(getattr(DENSE, key) == value for key, value in demo.items())
    moe = yaml.safe_load((ROOT / "configs" / "demo_moe_cpu.yaml").read_text())["model"]["tiny"]
    assert all(getattr(MOE, key) == value for key, value in moe.items())


def test_planned_static_bytes_equal_the_trainers_allocations() -> None:
    run_distributed(_layout, WORLD)
