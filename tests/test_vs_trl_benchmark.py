"""benchmarks/vs_trl.py: without TRL it names the install command and exits 0; TRL's generation
batches are our stages' prompts, in stage order, tokenized as ours; its settings are the GRPO demo's;
on the long task (``--task long``) ours packs and TRL's settings are our GRPO's.

The end-to-end ``--smoke`` run (three tiny trainings and their evaluations) takes minutes of CPU, so it
runs only when asked: ``MUGRPO_VS_TRL_SMOKE=1 pytest tests/test_vs_trl_benchmark.py``.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "vs_trl.py"
sys.path.insert(0, str(SCRIPT.parent))

import vs_trl  # noqa: E402

from megatron_mugrpo.config import load_config  # noqa: E402
from megatron_mugrpo.errors import InputError  # noqa: E402
from megatron_mugrpo.loop.setup import load_tokenizer  # noqa: E402
from megatron_mugrpo.rollout.prompts import load_prompts, stage_prompts  # noqa: E402
from megatron_mugrpo.warmstart import warmstart_spec  # noqa: E402

HAS_TRL = importlib.util.find_spec("trl") is not None
LAST_LINE = re.compile(
    r"grpo_vs_trl=\d+\.\d+ mugrpo_vs_trl=\d+\.\d+ acc_ours_grpo=\d\.\d{3} acc_trl=\d\.\d{3} acc_mugrpo=\d\.\d{3}"
)


def run_script(*args: str, hide_trl: bool = False) -> subprocess.CompletedProcess:
    """The benchmark in a subprocess; ``hide_trl`` makes ``import trl`` fail there, as without the extra."""
    hide = "import sys; sys.modules['trl'] = None; " if hide_trl else ""
    code = f"{hide}import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
    return subprocess.run(
        [sys.executable, "-c", code, str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True, timeout=300
    )


def test_without_trl_it_names_the_install_command_and_exits_0(tmp_path: Path) -> None:
    done = run_script("--out", str(tmp_path / "out"), hide_trl=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "pip install -e .[bench]" in done.stdout
    assert not (tmp_path / "out").exists()  # nothing started


def test_bad_run_count_is_one_error() -> None:
    done = run_script("--runs", "0", hide_trl=True)
    assert done.returncode == 2 and "--runs 0: must be >= 1" in done.stderr


def test_trl_settings_refuse_a_run_that_is_not_standard_grpo(tmp_path: Path) -> None:
    with pytest.raises(InputError, match=re.escape("algo.loss='mu_grpo'")):
        vs_trl.trl_settings(load_config(vs_trl.MU_CONFIG), tmp_path)


def test_trl_settings_are_the_grpo_demos(tmp_path: Path) -> None:
    cfg = load_config(vs_trl.GRPO_CONFIG)
    settings = vs_trl.trl_settings(cfg, tmp_path)
    # G = 8; 32 groups generated, then 4 updates of 8 groups; 256 updates; clip [0.8, 1.2]; no KL.
    assert settings["num_generations"] == 8
    assert settings["per_device_train_batch_size"] == 8 * 8 and settings["steps_per_generation"] == 4
    assert settings["max_steps"] == 256
    assert settings["epsilon"] == settings["epsilon_high"] == pytest.approx(0.2) and settings["beta"] == 0.0
    assert settings["max_completion_length"] == 48 and settings["temperature"] == 1.0
    assert settings["learning_rate"] == cfg.optim.lr and settings["lr_scheduler_type"] == "constant"
    assert settings["use_cpu"] and not settings["shuffle_dataset"] and not settings["bf16"]


def test_long_task_matches_grpo_and_trl_and_packs_only_ours(tmp_path: Path) -> None:
    task = vs_trl.TASKS["long"]
    plan = vs_trl.method_overrides(task, [], smoke=False, updates=64)
    cfgs = {name: load_config(vs_trl.method_config(task, name), found) for name, found in plan.items()}
    grpo, trl, mu = cfgs["ours_grpo"], cfgs["trl"], cfgs["ours_mugrpo"]
    assert grpo.data.builtin_task == mu.data.builtin_task == "running_sum_repeat"
    # One base model for all three: the same tiny model and warm start.
    assert warmstart_spec(grpo) == warmstart_spec(trl) == warmstart_spec(mu)
    # Ours packs within a budget of 64 rows × (64 + 240) tokens; TRL's config is ours without it.
    for cfg in (grpo, mu):
        assert cfg.parallel.pack_sequences and cfg.parallel.micro_batch_tokens == 64 * (64 + 240)
    assert not trl.parallel.pack_sequences and trl.parallel.micro_batch_tokens is None
    assert (trl.algo, trl.stages, trl.rollout, trl.optim) == (grpo.algo, grpo.stages, grpo.rollout, grpo.optim)
    # --updates 64: GRPO 16 stages × μ = 4 of 32 groups, μ-GRPO 1 stage × μ = 64 of 512 groups.
    assert grpo.algo.loss == "grpo" and grpo.stages.train_groups == 32
    assert (grpo.stages.num_stages, grpo.stages.updates_per_stage) == (16, 4)
    assert (mu.algo.loss, mu.stages.num_stages, mu.stages.updates_per_stage) == ("mu_grpo", 1, 64)
    settings = vs_trl.trl_settings(trl, tmp_path)
    assert settings["max_steps"] == 64 and settings["steps_per_generation"] == 4
    assert settings["per_device_train_batch_size"] == 64 and settings["max_completion_length"] == 240
    assert settings["epsilon"] == pytest.approx(0.2) and settings["temperature"] == mu.rollout.temperature


def test_demo_task_is_the_two_demo_configs_as_they_are() -> None:
    plan = vs_trl.method_overrides(vs_trl.TASKS["demo"], ["optim.lr=2e-4"], smoke=False, updates=None)
    assert plan == {name: ["optim.lr=2e-4"] for name in vs_trl.METHODS}
    assert vs_trl.method_config(vs_trl.TASKS["demo"], "trl") == vs_trl.GRPO_CONFIG


def test_updates_that_are_not_a_multiple_of_a_methods_mu_are_one_error() -> None:
    # The long μ-GRPO makes 64 updates per stage: 32 updates cannot be whole stages of it.
    with pytest.raises(InputError, match=r"--updates 32: .* μ = 64; pick a multiple of 64"):
        vs_trl.method_overrides(vs_trl.TASKS["long"], [], smoke=False, updates=32)


def test_report_prints_each_run_the_spread_and_the_ratios_of_the_means(capsys: pytest.CaptureFixture) -> None:
    def run(grpo: float, trl: float, mu: float) -> dict[str, vs_trl.Result]:
        return {
            "ours_grpo": vs_trl.Result(train_s=grpo, acc=0.9),
            "trl": vs_trl.Result(train_s=trl, acc=0.8),
            "ours_mugrpo": vs_trl.Result(train_s=mu, acc=0.7),
        }

    vs_trl.report([run(60.0, 48.0, 30.0), run(70.0, 50.0, 34.0)])
    lines = capsys.readouterr().out.strip().splitlines()
    assert re.search(r"^ours_grpo +60\.0 / 70\.0 +65\.0 ± 7\.1 +0\.900 ± 0\.000$", lines[1])
    # TRL 49 s on average against our 65 s and 32 s.
    assert lines[-1] == "grpo_vs_trl=0.75 mugrpo_vs_trl=1.53 acc_ours_grpo=0.900 acc_trl=0.800 acc_mugrpo=0.700"
    assert LAST_LINE.fullmatch(lines[-1])


@pytest.mark.skipif(not HAS_TRL, reason="TRL is not installed (pip install -e .[bench])")
def test_trl_generation_batches_are_our_stages_in_order(tmp_path: Path) -> None:
    """TRL's own sampler over the dumped rows: its k-th generation batch holds our stage k's prompts, each
    G times in a row, and TRL's tokenization of their text gives our prompt ids."""
    from trl import GRPOConfig, GRPOTrainer

    cfg = load_config(vs_trl.GRPO_CONFIG, ["stages.num_stages=3"])
    tokenizer = load_tokenizer(cfg)
    prompts = load_prompts(cfg.data, tokenizer, cfg.rollout.max_prompt_tokens)
    rows = vs_trl.trl_prompts(cfg, prompts)
    args = GRPOConfig(**vs_trl.trl_settings(cfg, tmp_path))
    assert args.generation_batch_size == cfg.stages.train_groups * cfg.rollout.group_size
    assert not args.gradient_checkpointing and not args.bf16 and args.lr_scheduler_type == "constant"

    trainer = SimpleNamespace(
        args=args, num_generations=args.num_generations, num_iterations=args.num_iterations, shuffle_dataset=False
    )
    order = list(GRPOTrainer._get_train_sampler(trainer, rows))
    batch = args.generation_batch_size  # rows per dataloader step (get_train_dataloader)
    assert len(order) == args.max_steps * batch  # one pass over the rows makes every update
    group = cfg.rollout.group_size
    for stage in range(cfg.stages.num_stages):
        start = stage * args.steps_per_generation * batch  # the step that generates
        generated = [rows[i] for i in order[start : start + batch]]
        ours = stage_prompts(prompts, stage, cfg.stages.train_groups, cfg.data.seed)
        assert [r["prompt_id"] for r in generated[::group]] == [p.prompt_id for p in ours]
        assert all(generated[i]["prompt_id"] == generated[i - i % group]["prompt_id"] for i in range(batch))
        encoded = tokenizer(text=[r["prompt"] for r in generated[::group]])["input_ids"]  # TRL's _tokenize_prompts
        assert [list(ids) for ids in encoded] == [p.prompt_ids for p in ours]


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRL, reason="TRL is not installed (pip install -e .[bench])")
@pytest.mark.skipif(
    not os.environ.get("MUGRPO_VS_TRL_SMOKE"), reason="minutes of CPU: set MUGRPO_VS_TRL_SMOKE=1 to run it"
)
def test_smoke_runs_all_three_end_to_end(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--out", str(tmp_path / "out")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert LAST_LINE.fullmatch(done.stdout.strip().splitlines()[-1]), done.stdout[-3000:]
    for name in ("ours_grpo", "trl", "ours_mugrpo"):
        assert re.search(rf"^run 0 {name} +train +\d+\.\d s", done.stdout, re.M), done.stdout
