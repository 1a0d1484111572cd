"""`mugrpo plan`: hand-computed memory and time arithmetic, every paper config fitting the GPUs its comment
names, suggestions that make a run fit, and the command's table, JSON and errors.

The byte-exact comparison with what the trainer allocates is tests/plan/test_plan_exact.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_mugrpo.cli import main
from megatron_mugrpo.config import load_config
from megatron_mugrpo.errors import ConfigError
from megatron_mugrpo.plan.gpus import GPUS, gpu_spec
from megatron_mugrpo.plan.inputs import hf_fields, planning_overrides
from megatron_mugrpo.plan.memory import (
    ActivationInputs,
    TrainerLayout,
    activation_bytes,
    ddp_buffer,
    engine_bytes,
    static_bytes,
)
from megatron_mugrpo.plan.models import KNOWN_MODELS, ModelShape, RankLayout, Tensor
from megatron_mugrpo.plan.planner import GIB, Hardware, make_plan
from megatron_mugrpo.plan.timing import async_balance, decode_step_s

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
QWEN7B = ModelShape.from_hf(KNOWN_MODELS["Qwen2.5-Math-7B"])
MOE30B = ModelShape.from_hf(KNOWN_MODELS["Qwen3-30B-A3B"])


def test_parameter_counts_of_the_paper_models_are_the_published_ones() -> None:
    h, f, v, layers = 3584, 18944, 152064, 28
    per_layer = h + (h + 2 * 512) * h + h * h + (h + 2 * 512) + h + 3 * f * h  # norms, QKV(+bias), proj, SwiGLU
    assert QWEN7B.total_params() == 2 * v * h + layers * per_layer + h == 7_615_616_512  # "7.61B" on its card
    # Qwen3-30B-A3B: "30.5B in total and 3.3B activated".
    assert round(MOE30B.total_params() / 1e9, 1) == 30.5 and round(MOE30B.active_params() / 1e9, 1) == 3.4
    assert round(ModelShape.from_hf(KNOWN_MODELS["Qwen3-8B-Base"]).total_params() / 1e9, 2) == 8.19
    assert round(ModelShape.from_hf(KNOWN_MODELS["Llama-3.2-3B-Instruct"]).total_params() / 1e9, 2) == 3.21


def test_distributed_optimizer_buffer_padding_and_slices_by_hand() -> None:
    # Reverse order: the 10-element tensor at [0, 10); the 100-element one starts at 64 (alignment) and ends
    # at 164; the bucket ends at 256 (a multiple of lcm(DP=2, 128)); slices are [0, 128) and [128, 256).
    tensors = [Tensor("a", 100), Tensor("b", 10)]
    first = ddp_buffer(tensors, dp=2, dp_rank=0, distributed=True)
    second = ddp_buffer(tensors, dp=2, dp_rank=1, distributed=True)
    assert (first.numel, first.params, first.shard, second.shard) == (256, 110, 10 + 64, 164 - 128)
    assert ddp_buffer(tensors, dp=2, dp_rank=0, distributed=False).numel == 110  # no padding without it


def test_static_bytes_of_a_7b_model_by_hand() -> None:
    """bf16 weights, fp32 gradients, and 12 bytes of Adam state per parameter spread over DP."""
    layout = TrainerLayout(model=RankLayout(tp=1, pp=1), dp=1, edp=1, distributed_optimizer=False)
    got = static_bytes(QWEN7B, layout, dtype_bytes=2, pp_rank=0)
    padded = QWEN7B.total_params() + 2 * (152064 - 152064) * 3584  # 152064 is already a multiple of 128
    assert (got.weights, got.grads, got.optimizer) == (2 * padded, 4 * padded, 12 * padded)
    sharded = static_bytes(
        QWEN7B,
        TrainerLayout(model=RankLayout(tp=1, pp=1), dp=8, edp=8, distributed_optimizer=True),
        dtype_bytes=2,
        pp_rank=0,
    )
    assert sharded.optimizer == pytest.approx(12 * padded / 8, rel=1e-4)


def test_activations_per_layer_by_hand() -> None:
    """Qwen2.5-7B at TP 2 with sequence parallelism, flash attention, 8192 tokens, bf16."""
    inputs = ActivationInputs(
        tokens=8192, seq_len=4096, dtype_bytes=2, sequence_parallel=True, fused_kernels=True, in_flight=1
    )
    per_token = 2 * 3584 / 2 + (2 * 3584 + 2 * 512) / 2 + 2 * 3584 / 2 + 3 * 18944 / 2
    assert activation_bytes(QWEN7B, RankLayout(tp=2, pp=1), inputs) == int(28 * per_token * 8192 * 2)


def test_sglang_kv_cache_by_hand() -> None:
    """KV pool = fraction × memory − CUDA context − resident − weights; 57,344 bytes per token for Qwen2.5-7B."""
    gpu = GPUS["h100"]
    got = engine_bytes(
        QWEN7B,
        engine_tp=1,
        gpu_bytes=gpu.memory_bytes,
        usable_bytes=gpu.usable_bytes,
        mem_fraction=0.8,
        weight_bytes_per_param=2,
        resident=0,
        context=4096,
        staging=0,
    )
    assert QWEN7B.kv_bytes_per_token() == 2 * 28 * 4 * 128 * 2 == 57_344
    kv = int(0.8 * 80e9) - 2**30 - 2 * QWEN7B.total_params()
    assert (got.kv_cache, got.max_sequences) == (kv, kv // (57_344 * 4096))


def test_decode_roofline_is_bandwidth_bound_at_batch_one() -> None:
    gpu = GPUS["h100"]
    step = decode_step_s(QWEN7B, gpu, tp=1, batch=1, context=1000, weight_bytes=2)
    assert step == pytest.approx((2 * QWEN7B.total_params() + 1000 * 57_344) / 3.35e12)
    # A MoE at batch 1 reads only the top-k experts' weights.
    moe = decode_step_s(MOE30B, gpu, tp=1, batch=1, context=0, weight_bytes=2)
    assert moe < 2 * MOE30B.total_params() / 3.35e12 / 4


def test_async_balance_by_hand() -> None:
    # The workers make 1 group/s, the trainer could take 3.2 (32 groups per 10 s update): it waits
    # 1 − 1/3.2 of the time; publishing 5 s every 4 steps of 32 s adds 5 / 133 of the rest.
    got = async_balance(
        produce_groups_per_s=1.0,
        update_s=10.0,
        mini_groups=32,
        sync_every=4,
        publish_s=5.0,
        queue_groups=256,
        batch_groups=32,
        workers=2,
        max_lag=100,
    )
    waiting, step = 1 - 1 / 3.2, 32.0
    publishing = 5 / (4 * step + 5)
    assert got.idle_fraction == pytest.approx(1 - (1 - waiting) * (1 - publishing))
    assert got.mean_lag == pytest.approx(1.5 + 0 + 32 * 2 / 1.0 / step)


# Each paper config on the GPUs its comment names: "8×H100-class nodes" (configs/common/paper.yaml), the
# async runs' 4 GPUs (their header), Qwen3-30B-A3B on one node of 141 GB GPUs (its model file).
PAPER_FILES = sorted((CONFIGS / "paper").glob("*.yaml"))


def _paper_hardware(path: Path) -> Hardware:
    if "30b_a3b" in path.name:
        return Hardware(gpu=gpu_spec("h200"), gpus=8, gpus_per_node=8)
    return Hardware(gpu=gpu_spec("h100"), gpus=4 if "async" in path.name else 8, gpus_per_node=8)


def _plan(path: Path, hardware: Hardware, overrides: tuple[str, ...] = ()):
    with planning_overrides(path, list(overrides)) as (resolved, _):
        cfg = load_config(path, resolved)
        return make_plan(cfg, hf_fields(cfg.model.hf_dir, cfg.model.tiny), hardware)


def test_every_paper_config_fits_the_gpus_its_comment_names() -> None:
    misfits = {}
    for path in PAPER_FILES:
        plan = _plan(path, _paper_hardware(path))
        if not plan.fits:
            misfits[path.name] = plan.problems
        assert plan.engine.bytes.max_sequences >= 1 and plan.time.total_s > 0
    assert not misfits


def test_qwen3_30b_does_not_fit_one_node_of_80gb_gpus_as_its_comment_says() -> None:
    plan = _plan(
        CONFIGS / "paper" / "qwen3_30b_a3b__mu_grpo.yaml", Hardware(gpu=gpu_spec("h100"), gpus=8, gpus_per_node=8)
    )
    assert not plan.trainer.fits and plan.trainer.ep == 8 and plan.trainer.edp == 1


def test_a_layout_that_cannot_be_split_is_an_error_naming_the_key() -> None:
    with pytest.raises(ConfigError, match=r"parallel\.tensor_parallel=3 does not divide the 28 attention heads"):
        _plan(
            CONFIGS / "paper" / "qwen2.5_math_7b__mu_grpo.yaml",
            Hardware(gpu=gpu_spec("h100"), gpus=6, gpus_per_node=6),
            ("parallel.tensor_parallel=3",),
        )
    with pytest.raises(ConfigError, match=r"not a multiple of parallel\.tensor_parallel × parallel\.pipeline_parallel"):
        _plan(
            CONFIGS / "paper" / "qwen2.5_math_7b__mu_grpo.yaml",
            Hardware(gpu=gpu_spec("h100"), gpus=6, gpus_per_node=6),
            ("parallel.tensor_parallel=4",),
        )


def test_the_command_suggests_a_change_whose_own_plan_fits(capsys: pytest.CaptureFixture[str]) -> None:
    """Qwen2.5-Math-7B on 8 × 40 GB: neither role fits at TP 2; the suggested changes' plan fits."""
    config = str(CONFIGS / "paper" / "qwen2.5_math_7b__mu_grpo.yaml")
    argv = ["plan", "--config", config, "--gpus", "8", "--gpu", "a100-40gb", "--json"]
    assert main(argv) == 1
    out = json.loads(capsys.readouterr().out)
    assert not out["roles"]["trainer"]["fits"] and not out["roles"]["rollout"]["fits"]
    assert out["params"] == QWEN7B.total_params()
    suggestion = out["suggestion"]
    assert suggestion["plan"]["fits"] and suggestion["change"].startswith("parallel.tensor_parallel 2 → 4")
    assert suggestion["plan"]["roles"]["trainer"]["peak_bytes"] < out["roles"]["trainer"]["peak_bytes"]


def test_the_command_prints_a_table_for_a_demo_config_and_refuses_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--config", str(CONFIGS / "demo_moe_cpu.yaml"), "--gpus", "1"]) == 0
    table = capsys.readouterr().out
    assert "routing replay" in table and "fits" in table and "T_total" in table
    assert main(["plan", "--config", str(CONFIGS / "demo_cpu.yaml"), "--gpu", "tpu"]) == 2
    assert "--gpu 'tpu' is not a known GPU" in capsys.readouterr().err


def test_gpu_memory_override() -> None:
    assert gpu_spec("h100", memory_gib=94).memory_bytes == 94 * GIB
