"""A run's own plan (RUN_DIR/plan.json) and `mugrpo report`'s plan against actual.

- the device a run has: a GPU of the table matched by the driver's name, with the memory it reports;
  an unknown GPU and a CPU plan memory only (no time);
- plan.json of the CPU demo configs: rank 0's bytes are ``static_bytes``'s, the time is not planned,
  and a run that cannot be planned records why;
- the table's arithmetic on a hand-made plan, memory.json and metrics file (staged and async), and
  the report's markdown table and JSON section built from them.

The real run (plan.json and memory.json of a finished demo run, bytes equal) is in
tests/e2e/test_run_plan.py; the byte-exact allocation check in every layout is test_plan_exact.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_mugrpo.config import load_config
from megatron_mugrpo.metrics import MetricsLogger
from megatron_mugrpo.plan.actual import MEASURED_FILE, PLAN_FILE, compare
from megatron_mugrpo.plan.gpus import CUDA_CONTEXT_BYTES
from megatron_mugrpo.plan.inputs import tiny_hf_fields
from megatron_mugrpo.plan.memory import TrainerLayout, static_bytes
from megatron_mugrpo.plan.models import ModelShape, RankLayout
from megatron_mugrpo.plan.output import render
from megatron_mugrpo.plan.planner import Hardware, make_plan
from megatron_mugrpo.plan.run_plan import cpu_device, gpu_for_device, write_run_plan
from megatron_mugrpo.report import write_report

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.parametrize(
    ("name", "memory", "entry"),
    [
        ("NVIDIA H100 80GB HBM3", 85_520_809_984, "h100"),
        ("NVIDIA H100 PCIe", 85_520_809_984, "h100-pcie"),
        ("NVIDIA H200", 150_754_820_096, "h200"),
        ("NVIDIA A100-SXM4-80GB", 85_100_000_000, "a100"),
        ("NVIDIA A100-SXM4-40GB", 42_314_694_656, "a100-40gb"),
    ],
)
def test_a_gpu_is_the_tables_entry_with_the_memory_the_driver_reports(name: str, memory: int, entry: str) -> None:
    spec = gpu_for_device(name, memory)
    assert spec.name == entry and spec.has_roofline
    assert abs(spec.memory_bytes - memory) <= 1  # GiB → GB conversion rounding
    assert spec.usable_bytes == spec.memory_bytes - CUDA_CONTEXT_BYTES


def test_an_unknown_gpu_and_a_cpu_plan_memory_but_no_time() -> None:
    cfg = load_config(CONFIGS / "demo_cpu.yaml", [])
    hf = tiny_hf_fields(cfg.model.tiny)
    unknown = gpu_for_device("Some Accelerator X", 32 * 10**9)
    assert unknown.memory_gb == 32 and not unknown.has_roofline
    cpu = cpu_device(processes_per_node=4)
    assert cpu.usable_bytes == cpu.memory_bytes and not cpu.has_roofline  # no CUDA context on a host
    for spec in (unknown, cpu):
        plan = make_plan(cfg, hf, Hardware(gpu=spec, gpus=1, gpus_per_node=1))
        assert plan.time is None and plan.fits
        assert "no FLOPs or bandwidth figures, so no time is planned" in plan.notes[0]
        assert "time     not planned" in render(plan)


@pytest.mark.parametrize("config", ["demo_cpu.yaml", "demo_moe_cpu.yaml", "demo_async_cpu.yaml"])
def test_the_plan_a_cpu_run_writes(tmp_path: Path, config: str) -> None:
    cfg = load_config(CONFIGS / config, [])
    world = 2 if cfg.mode == "async" else 1
    write_run_plan(cfg, tmp_path, world_size=world, processes_per_node=world, verb="train")
    plan = json.loads((tmp_path / PLAN_FILE).read_text())
    assert plan["written_by"] == "train" and plan["gpu"]["name"] == "cpu" and plan["gpu"]["count"] == world
    assert plan["time"] is None and plan["fits"]
    assert plan["stages"] == {
        "num_stages": cfg.stages.num_stages,
        "updates_per_stage": cfg.stages.updates_per_stage,
    }
    shape = ModelShape.from_hf(tiny_hf_fields(cfg.model.tiny))
    ep = cfg.parallel.expert_parallel
    layout = TrainerLayout(model=RankLayout(tp=1, pp=1, ep=ep, etp=1), dp=1, edp=1, distributed_optimizer=False)
    rank0 = static_bytes(shape, layout, dtype_bytes=4, pp_rank=0)
    assert plan["rank0"] == {
        "weights": rank0.weights,
        "grads": rank0.grads,
        "optimizer": rank0.optimizer,
        "params": rank0.params,
        "total": rank0.total,
    }
    # fp32, one rank: weights and fp32 gradients 4 bytes a parameter (the vocabulary padded to 128), Adam's
    # two moments 8 (an fp32 model is its own main copy)
    assert rank0.params == shape.total_params() + (128 - shape.vocab_size) * shape.hidden
    assert rank0.weights == rank0.grads == 4 * rank0.params and rank0.optimizer == 8 * rank0.params


def test_a_run_that_cannot_be_planned_records_why(tmp_path: Path) -> None:
    cfg = load_config(CONFIGS / "demo_cpu.yaml", ["parallel.tensor_parallel=2"])
    write_run_plan(cfg, tmp_path, world_size=1, processes_per_node=1, verb="train")  # 1 rank cannot hold TP 2
    plan = json.loads((tmp_path / PLAN_FILE).read_text())
    assert "not a multiple of parallel.tensor_parallel" in plan["error"]
    assert compare(plan, None, []) == []


PLAN = {
    "mode": "staged",
    "gpu": {"name": "h100", "count": 8},
    "device_source": "test",
    "stages": {"num_stages": 2, "updates_per_stage": 4},
    "roles": {"trainer": {"peak_bytes": 6000}},
    "rank0": {"weights": 1000, "grads": 2000, "optimizer": 3000},
    "time": {"rollout_s": 50.0, "optimize_s": 20.0, "update_s": 5.0, "total_s": 150.0, "updates_per_stage": 4},
}
MEASURED = {
    "updates": 6,
    "weights": 1000,
    "grads": 2000,
    "optimizer": 3000,
    "peak": {"kind": "cuda_max_memory_allocated", "bytes": 4500},
}


def _staged_records() -> list[dict]:
    """Stages 0 and 1 generated (t_rollout 40 s, then 110 s cumulative); 6 of 8 updates, 3 s each."""
    return [
        {"step": 0, "rollout/stage": 0.0, "perf/t_rollout_s": 40.0},
        *({"step": u, "train/loss": 0.1} for u in range(1, 5)),
        {"step": 4, "rollout/stage": 1.0, "perf/t_rollout_s": 110.0},
        {"step": 4, "rollout/stage": 1.0, "perf/t_rollout_s": 110.0},  # logged again by a resume: counted once
        *({"step": u, "train/loss": 0.1} for u in range(5, 7)),
        {
            "step": 6,
            "eval/avg_pass@1": 0.5,
            "perf/t_rollout_s": 110.0,
            "perf/t_optimize_s": 18.0,
            "perf/t_total_s": 160,
        },
    ]


def test_plan_against_actual_arithmetic_by_hand() -> None:
    rows = {row.name: row for row in compare(PLAN, MEASURED, _staged_records())}
    assert [rows[k].actual for k in ("weights (rank 0)", "gradients (rank 0)", "optimizer state (rank 0)")] == [
        1000,
        2000,
        3000,
    ]
    assert rows["weights (rank 0)"].ratio == 1.0
    assert (rows["trainer peak"].plan, rows["trainer peak"].actual, rows["trainer peak"].ratio) == (6000, 4500, 0.75)
    assert rows["rollout per stage"].actual == pytest.approx(110.0 / 2)  # 2 stages, the resumed one once
    assert rows["one update"].actual == pytest.approx(18.0 / 6)
    assert rows["optimizer per stage"].actual == pytest.approx(18.0 / 6 * 4)  # per update × μ
    assert rows["optimizer per stage"].ratio == pytest.approx(12.0 / 20.0)
    assert (rows["T_total"].plan, rows["T_total"].actual) == (150.0, 160.0)
    assert rows["T_total"].note == "the run did 6 of 8 updates"
    assert "trainer idle fraction" not in rows  # staged


def test_async_rows_and_a_cpu_plan_without_time() -> None:
    plan = {
        **PLAN,
        "mode": "async",
        "time": {**PLAN["time"], "async": {"idle_fraction": 0.2, "mean_lag": 1.5}},
    }
    records = [
        {"step": 1, "perf/trainer_idle_ratio": 0.1, "rollout/lag_mean": 1.0},
        {"step": 2, "perf/trainer_idle_ratio": 0.3, "rollout/lag_mean": 2.0},
        {"step": 2, "perf/t_rollout_s": 7.0, "perf/t_optimize_s": 4.0, "perf/t_total_s": 12.0},
    ]
    rows = {row.name: row for row in compare(plan, None, records)}
    assert rows["rollout per stage"].actual is None and "async" in rows["rollout per stage"].note
    assert (rows["trainer idle fraction"].plan, rows["trainer idle fraction"].actual) == (0.2, pytest.approx(0.2))
    assert (rows["mean lag (updates)"].plan, rows["mean lag (updates)"].actual) == (1.5, 1.5)
    assert rows["weights (rank 0)"].actual is None and rows["trainer peak"].note == "not measured"
    cpu = {**PLAN, "time": None}
    rows = {row.name: row for row in compare(cpu, MEASURED, _staged_records())}
    assert rows["one update"].plan is None and rows["one update"].actual == pytest.approx(3.0)
    assert rows["optimizer per stage"].actual == pytest.approx(12.0)  # μ from the plan's stages


def test_the_report_shows_the_table_and_its_json(tmp_path: Path) -> None:
    run = tmp_path / "run"
    with MetricsLogger(run, tensorboard=False, console=False) as logger:
        for record in _staged_records():
            step = record.pop("step")
            logger.log(record, step=step)
    (run / PLAN_FILE).write_text(json.dumps(PLAN))
    (run / MEASURED_FILE).write_text(json.dumps(MEASURED))
    unplanned = tmp_path / "old"
    with MetricsLogger(unplanned, tensorboard=False, console=False) as logger:
        logger.log({"train/loss": 0.1}, step=1)
    write_report([run, unplanned], tmp_path / "out")
    text = (tmp_path / "out" / "report.md").read_text()
    assert "## Plan against actual" in text and "planned for 8 × h100 (test)" in text
    assert "| weights (rank 0) | 1000 B | 1000 B | 1.00 |  |" in text
    assert "| optimizer per stage | 20.00 s | 12.00 s | 0.60 |  |" in text
    assert "| T_total | 150.00 s | 160.00 s | 1.07 | the run did 6 of 8 updates |" in text
    assert "no plan.json: the run started before `mugrpo train` wrote its plan" in text
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    rows = {r["name"]: r for r in report["runs"]["run"]["plan_vs_actual"]["rows"]}
    assert rows["trainer peak"] == {
        "name": "trainer peak",
        "unit": "bytes",
        "plan": 6000,
        "actual": 4500,
        "note": "measured: torch.cuda.max_memory_allocated of rank 0",
        "ratio": 0.75,
    }
    assert report["runs"]["old"]["plan_vs_actual"] == {"plan": None, "error": None, "rows": []}
    assert report["runs"]["run"]["figures"]["t_total_s"] == 160
