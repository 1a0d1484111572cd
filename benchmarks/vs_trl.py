"""Our standard GRPO and μ-GRPO against Hugging Face TRL's ``GRPOTrainer`` on a CPU demo task.

Three trainings, one after the other on the same cores, from one warm-started base model directory:

1. ``ours_grpo``: our standard GRPO, ``configs/demo_grpo_cpu.yaml`` (64 stages × μ = 4: 32 groups of
   G = 8 generated, then 4 updates of 8 groups; 256 updates);
2. ``trl``: TRL ``GRPOTrainer`` with the same schedule and settings, read from that config
   (``trl_settings``): G, 32 groups per generation batch and 4 updates of 8 groups per batch
   (``generation_batch_size`` / ``steps_per_generation``), 256 updates, clip [1 − ε, 1 + ε], no KL
   (β = 0), the same AdamW (lr, betas, ε, weight decay, gradient clip, constant schedule), T, the
   response cap, group-scaled advantages and the per-response token mean (``loss_type='grpo'``, our
   ``seq_mean_token_mean``), float32, ``use_cpu``. Its prompts are ours: the stages' prompts in stage
   order, drawn by our own stage sampler (``trl_prompts``), with TRL's dataset shuffling off so
   generation batch k holds exactly our stage k's prompts; its reward is our math verifier;
3. ``ours_mugrpo``: our μ-GRPO, ``configs/demo_cpu.yaml`` (4 stages × μ = 64, the same 256 updates).

Each final model (ours: ``RUN_DIR/hf_final``; TRL's: saved after training) is then evaluated here by
one call of our evaluation (``megatron_mugrpo.evaluation.evaluate``: pass@1 over k samples on the
demo's held-out problems, the same seed for all three).

Training wall clock only: ours is ``perf/t_rollout_s + perf/t_optimize_s`` (rollout and update
phases; run set-up, in-run evaluations and the final export excluded), TRL's is its ``train()`` call
(model loading, trainer construction and saving excluded). The warm start is outside every timing.

    .venv/bin/python benchmarks/vs_trl.py [--task demo|long] [--updates N] [--runs N] [--smoke] [--out DIR]
                                          [override ...]

Needs TRL: ``pip install -e .[bench]`` (the pinned ``trl`` and ``accelerate``); without it the
benchmark says so and exits 0. Extra arguments are dotted overrides applied to every run (and to
TRL's settings). ``--runs N`` repeats the three trainings N times (run i: ``seed=i``, ``stages.seed=i``,
TRL's ``seed=i``; the base model and the prompts stay the same) and prints each run's times and the
mean ± std. ``--smoke`` shrinks everything (a 20-step warm start, 4 updates per method, 16 evaluation
problems) to check that the benchmark runs end to end; its numbers mean nothing. The last line is
``grpo_vs_trl=<TRL time / our GRPO time> mugrpo_vs_trl=<TRL time / our μ-GRPO time>
acc_ours_grpo=<> acc_trl=<> acc_mugrpo=<>`` (means over the runs).

``--task long`` runs the long-reasoning task instead (``configs/demo_long_cpu.yaml``:
``running_sum_repeat``, answers of 171-212 tokens, responses capped at 240, its own warm start): our
μ-GRPO is that config as it is (4 stages × μ = 64), our GRPO and TRL that config at μ = 4 with GRPO's
clip (``LONG_GRPO``: 64 stages × 32 groups, as ``demo_grpo_cpu.yaml`` is to ``demo_cpu.yaml``), TRL's
settings read from it as above. Ours trains with ``parallel.micro_batch_tokens`` and
``parallel.pack_sequences`` on (``LONG_PACKING``). TRL gets no padding-free counterpart because TRL
1.16.0's GRPOTrainer has none: ``GRPOConfig`` has no ``padding_free`` or packing field (those are
``SFTConfig``'s), the trainer left-pads prompts and right-pads completions to the batch's longest and
runs every forward on that padded [rows, prompt + completion] batch; its one padding setting,
``pad_to_multiple_of``, only rounds that width up ('auto': not at all off Neuron).
``use_transformers_continuous_batching`` is about generation, not the update, and stays off.

``--updates N`` sets each method's ``stages.num_stages`` to N / μ (N a multiple of every method's μ)
to shorten a run at equal updates: ``--task long --updates 64`` is GRPO 16 stages × μ = 4 and μ-GRPO
1 stage × μ = 64.

Settings that cannot be matched (TRL 1.16.0, ``trl/trainer/grpo_trainer.py``):

* TRL shuffles the completions of a generation batch across groups before cutting it into the
  ``steps_per_generation`` updates (``shuffle_sequence_dict`` in ``_prepare_inputs``): an update
  holds rows of many groups. Ours cuts a stage into updates of whole groups (a seeded permutation of
  the groups). Both see each row once per stage.
* Advantage ε: TRL divides by (std + 1e-4), ours by (std + ``algo.adv_eps`` = 1e-6). Both use the
  unbiased group std and give 0 to a group whose rewards are all equal.
* π_old: TRL recomputes the old log-probabilities with an extra forward pass of the training model
  over the generation batch (``steps_per_generation`` > 1); ours takes the sampler's own per-token
  log-probabilities at T, recorded during generation (no extra pass).
* Sampling: TRL calls ``model.generate`` (left-padded batch, global torch RNG seeded once by
  ``seed``); ours runs its own decode loop with a seed per shard (``stages.seed``), in engine
  batches of ``rollout.transformers.batch_size`` rows (TRL samples its 256-row batch at once).
* The stage boundary: ours syncs weights to the rollout engine, writes each stage's rollouts to a
  durable on-disk store and checkpoints in the background every ``checkpoint.every_stages``; TRL
  generates with the training model itself and keeps rollouts in memory (no checkpoints here:
  ``save_strategy='no'``).
* Threads: TRL runs in this process with torch's default thread count (the cores); ours trains with
  the same default and samples with ``rollout.cpu_threads`` threads (default 0: the cores as well).
  Measure on an otherwise idle machine: with other work on the cores, a process running as many
  threads as there are cores stalls at every parallel region (the ``--smoke`` TRL training took 3 s
  with 1 thread and 36–72 s with 2 on the 2 cores at load average 10–15).
* Weight decay: both skip biases and norm weights; TRL/transformers decide by parameter name, ours by
  Megatron's ``wd_mult = 0`` rule.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a clone without installing

from megatron_mugrpo.commands import train_argv  # noqa: E402
from megatron_mugrpo.errors import InputError  # noqa: E402

if TYPE_CHECKING:
    from megatron_mugrpo.config import RunConfig
    from megatron_mugrpo.rollout.prompts import PromptRecord

GRPO_CONFIG = ROOT / "configs" / "demo_grpo_cpu.yaml"
MU_CONFIG = ROOT / "configs" / "demo_cpu.yaml"
LONG_CONFIG = ROOT / "configs" / "demo_long_cpu.yaml"
INSTALL = "pip install -e .[bench]"
METHODS = ("ours_grpo", "trl", "ours_mugrpo")

SMOKE = [
    "warmstart.steps=20",
    "eval.benchmarks.0.limit=16",
    "eval.benchmarks.0.k=2",
    "rollout.max_new_tokens=16",
    "eval.max_new_tokens=16",
    "parallel.micro_batch_size=16",
    "rollout.shard_groups=4",
]
"""``--smoke``: every run tiny (a check that the benchmark runs end to end, not a measurement)."""
SMOKE_SHAPE = {
    "ours_grpo": ["stages.num_stages=2", "stages.train_groups=4", "stages.mini_groups=2"],
    "ours_mugrpo": ["stages.num_stages=1", "stages.train_groups=8", "stages.mini_groups=2"],
}
"""``--smoke`` schedules with equal totals (4 updates of 2 groups): GRPO 2 stages × μ = 2, μ-GRPO 1 × 4
(TRL's is our GRPO's)."""

LONG_GRPO = (
    "algo.loss=grpo",
    "algo.grpo.clip_eps=0.2",
    "stages.num_stages=64",
    "stages.train_groups=32",
    "checkpoint.every_stages=16",
    "eval.every_updates=64",
)
"""``demo_long_cpu.yaml`` as standard GRPO at μ = 4, as ``demo_grpo_cpu.yaml`` makes of ``demo_cpu.yaml``
(the ``grpo`` variant of ``experiments/f8_long_mechanism.yaml``): 64 stages × 32 groups, clip [0.8, 1.2]."""
LONG_PACKING = ("parallel.micro_batch_tokens=19456", "parallel.pack_sequences=true")
"""Ours on the long task: token-budget micro-batches with packed rows. 19,456 = 64 rows × (64 prompt +
240 response tokens), the budget of the config's ``micro_batch_size=64`` padded rows, so an update (8
groups × 8 = 64 rows) is one micro-batch as before and the peak-memory bound is unchanged."""


@dataclass(frozen=True, kw_only=True)
class Task:
    """What the three trainings run: our GRPO and TRL from ``grpo_config`` + ``grpo_shape``, our μ-GRPO
    from ``mu_config``; ``ours`` are overrides of our two runs only (TRL has no such setting)."""

    grpo_config: Path
    grpo_shape: tuple[str, ...] = ()
    mu_config: Path
    ours: tuple[str, ...] = ()


TASKS = {
    "demo": Task(grpo_config=GRPO_CONFIG, mu_config=MU_CONFIG),
    "long": Task(grpo_config=LONG_CONFIG, grpo_shape=LONG_GRPO, mu_config=LONG_CONFIG, ours=LONG_PACKING),
}
"""``--task``: the CPU demo (addition, answers of 20-48 tokens) or the long-reasoning task
(``running_sum_repeat``, 171-212 tokens, packing on for ours)."""

LOSS_TYPES = {"seq_mean_token_mean": "grpo", "token_mean": "dapo"}
"""Our ``algo.aggregation`` → TRL's ``loss_type``. With one process and no gradient accumulation TRL's
'dapo' is the token mean over the update's rows, our token_mean."""


@dataclass(kw_only=True)
class Result:
    """One training of one method."""

    train_s: float
    """Training wall clock (see the module docstring for what it covers)."""
    acc: float
    """Held-out ``eval/avg_pass@1`` of the final model."""


def trl_available() -> bool:
    """Whether ``trl`` (and what it needs) imports."""
    try:
        import trl  # noqa: F401
    except ImportError:
        return False
    return True


def trl_prompts(cfg: RunConfig, prompts: list[PromptRecord]) -> list[dict[str, str]]:
    """TRL's training rows: every stage's prompts in stage order, as our staged loop draws them.

    With ``shuffle_dataset=False`` TRL's sampler walks the rows in order, one generation batch of
    ``stages.train_groups`` prompts at a time, so its k-th batch is our stage k. ``prompt`` is the text
    our loader tokenized (TRL tokenizes it again with the same tokenizer); ``answer`` reaches the reward.
    """
    from megatron_mugrpo.rollout.prompts import stage_prompts

    stages = cfg.stages
    return [
        {"prompt": record.text, "answer": record.answer, "prompt_id": record.prompt_id}
        for stage in range(stages.num_stages)
        for record in stage_prompts(prompts, stage, stages.train_groups, cfg.data.seed)
    ]


def trl_settings(cfg: RunConfig, output_dir: Path) -> dict[str, Any]:
    """``GRPOConfig`` keywords equal to our standard GRPO run ``cfg`` (see the module docstring)."""
    if cfg.algo.loss != "grpo" or cfg.algo.grpo.dual_clip_c != 0:
        raise InputError(
            f"TRL's settings are read from a standard GRPO run: algo.loss={cfg.algo.loss!r} "
            f"(algo.grpo.dual_clip_c={cfg.algo.grpo.dual_clip_c}) must be 'grpo' without dual clip; "
            "drop the overrides that change them"
        )
    group, stages, optim = cfg.rollout.group_size, cfg.stages, cfg.optim
    return {
        "output_dir": str(output_dir),
        "use_cpu": True,
        "bf16": False,  # TRL's default is bf16 autocast; the demo trains in float32
        "activation_checkpointing": False,  # TRL's default recomputes activations; ours does not
        "seed": cfg.seed,
        "shuffle_dataset": False,  # stage k's prompts, in order (trl_prompts)
        "num_generations": group,
        "per_device_train_batch_size": stages.mini_groups * group,  # rows per update
        "gradient_accumulation_steps": 1,
        "steps_per_generation": stages.updates_per_stage,  # μ updates per generation batch
        "num_iterations": 1,
        "max_steps": stages.num_stages * stages.updates_per_stage,
        "max_completion_length": cfg.rollout.max_new_tokens,
        "temperature": cfg.rollout.temperature,
        "top_p": 1.0,
        "top_k": 0,
        "beta": 0.0,
        "epsilon": cfg.algo.grpo.clip_eps,
        "epsilon_high": cfg.algo.grpo.clip_eps,
        "loss_type": LOSS_TYPES[cfg.algo.aggregation],
        "scale_rewards": "group",
        "mask_truncated_completions": False,
        "learning_rate": optim.lr,
        "lr_scheduler_type": "constant",
        "warmup_steps": 0,
        "weight_decay": optim.weight_decay,
        "adam_beta1": optim.beta1,
        "adam_beta2": optim.beta2,
        "adam_epsilon": optim.eps,
        "max_grad_norm": optim.clip_grad,
        "save_strategy": "no",
        "report_to": "none",
        "logging_steps": max(1, stages.num_stages * stages.updates_per_stage // 4),  # 4 lines of TRL's metrics
        "disable_tqdm": True,
    }


def train_trl(cfg: RunConfig, base: Path, out_dir: Path) -> float:
    """Train TRL's ``GRPOTrainer`` from ``base`` on our stages' prompts; saves the final model in
    ``out_dir / 'final'``. Returns the seconds of ``train()`` alone."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    from megatron_mugrpo.loop.setup import read_inputs

    inputs = read_inputs(cfg)  # the prompts and the reward exactly as our run reads them
    rows = trl_prompts(cfg, inputs.prompts)
    (out_dir / "prompts.jsonl").parent.mkdir(parents=True, exist_ok=True)
    (out_dir / "prompts.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))

    def reward(completions: list[str], answer: list[str], **_: Any) -> list[float]:
        return [score for score, _ in inputs.reward_fn.score(completions, answer)]

    try:
        model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=reward,
            args=GRPOConfig(**trl_settings(cfg, out_dir / "trainer")),
            train_dataset=Dataset.from_list(rows),
            processing_class=inputs.tokenizer,
        )
        started = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - started
        trainer.save_model(str(out_dir / "final"))
    finally:
        inputs.reward_fn.close()
    return seconds


def train_ours(config: Path, run_dir: Path, overrides: list[str]) -> float:
    """One `mugrpo train` in a subprocess; returns its rollout + optimize seconds."""
    cmd = train_argv(config, run_dir, ["logging.progress_bars=false", "logging.tensorboard=false", *overrides])
    subprocess.run(cmd, cwd=ROOT, check=True, env=dict(os.environ, PYTHONWARNINGS="ignore"), stdout=subprocess.DEVNULL)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in records if "perf/t_optimize_s" in r][-1]  # the final evaluation's record
    return last["perf/t_rollout_s"] + last["perf/t_optimize_s"]


def evaluate_final(cfg: RunConfig, hf_dir: Path) -> float:
    """``eval/avg_pass@1`` of the model in ``hf_dir`` on ``cfg``'s benchmarks: the run's own evaluation
    (engine, benchmarks, k, T, response cap), seeded with ``cfg.seed`` whichever model it scores."""
    from megatron_mugrpo.evaluation import AVG_KEY, evaluate
    from megatron_mugrpo.loop.setup import read_inputs
    from megatron_mugrpo.rollout.engine import build_engine_from_config, shutdown_engine

    inputs = read_inputs(cfg)
    try:
        engine = build_engine_from_config(cfg.rollout, str(hf_dir), seed=cfg.seed)
        try:
            metrics = evaluate(engine, inputs.benchmarks, tokenizer=inputs.tokenizer, eval_cfg=cfg.eval, seed=cfg.seed)
        finally:
            shutdown_engine(engine)
    finally:
        inputs.reward_fn.close()
    return metrics[AVG_KEY]


def method_config(task: Task, method: str) -> Path:
    """The config file ``method`` starts from."""
    return task.mu_config if method == "ours_mugrpo" else task.grpo_config


def schedule(config: Path, overrides: list[str], updates: int | None) -> list[str]:
    """``--updates N``: the ``stages.num_stages`` that makes ``N`` updates at the run's μ (none without it)."""
    if updates is None:
        return []
    from megatron_mugrpo.config import load_config

    mu = load_config(config, overrides).stages.updates_per_stage
    if updates < 1 or updates % mu:
        raise InputError(
            f"--updates {updates}: must be a positive multiple of every method's μ (updates per stage); "
            f"{config.name} with {overrides} has μ = {mu}; pick a multiple of {mu}"
        )
    return [f"stages.num_stages={updates // mu}"]


def method_overrides(task: Task, user: list[str], *, smoke: bool, updates: int | None) -> dict[str, list[str]]:
    """Each method's overrides of its config (``method_config``): the task's shape, the smoke schedule,
    ours-only settings, the user's, then ``--updates``. TRL's settings are read from ``trl``'s."""
    smoke_shape = {name: SMOKE_SHAPE[name] if smoke else [] for name in ("ours_grpo", "ours_mugrpo")}
    plan = {
        "ours_grpo": [*task.grpo_shape, *smoke_shape["ours_grpo"], *task.ours, *user],
        "trl": [*task.grpo_shape, *smoke_shape["ours_grpo"], *user],
        "ours_mugrpo": [*smoke_shape["ours_mugrpo"], *task.ours, *user],
    }
    return {name: [*found, *schedule(method_config(task, name), found, updates)] for name, found in plan.items()}


def run_overrides(overrides: list[str], base: Path, index: int) -> list[str]:
    """``overrides`` with the shared base model and run ``index``'s seeds."""
    return [*overrides, f"model.hf_dir={base}", f"seed={index}", f"stages.seed={index}"]


def one_run(index: int, base: Path, out: Path, task: Task, plan: dict[str, list[str]]) -> dict[str, Result]:
    """The three trainings of run ``index`` (seeds = ``index``), each evaluated after training."""
    from megatron_mugrpo.config import load_config
    from megatron_mugrpo.loop.export import FINAL_HF_DIR

    grpo_cfg = load_config(task.grpo_config, run_overrides(plan["trl"], base, index))
    results = {}
    for name in METHODS:
        run_dir = out / f"run{index}" / name
        if name == "trl":
            seconds = train_trl(grpo_cfg, base, run_dir)
            final = run_dir / "final"
        else:
            seconds = train_ours(method_config(task, name), run_dir, run_overrides(plan[name], base, index))
            final = run_dir / FINAL_HF_DIR
        results[name] = Result(train_s=seconds, acc=evaluate_final(grpo_cfg, final))
        print(f"run {index} {name:<12} train {seconds:7.1f} s   acc {results[name].acc:.3f}", flush=True)
    return results


def mean_std(values: list[float], fmt: str) -> str:
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.fmean(values):{fmt}} ± {std:{fmt}}"


def report(runs: list[dict[str, Result]]) -> None:
    """Per-method times (each run, mean ± std over runs when several) and the machine-readable last line."""
    print(f"{'method':<13}{'train s (each run)':<30}{'mean ± std s':>18}{'acc':>16}")
    for name in METHODS:
        times = [r[name].train_s for r in runs]
        accs = [r[name].acc for r in runs]
        each = " / ".join(f"{t:.1f}" for t in times)
        print(f"{name:<13}{each:<30}{mean_std(times, '.1f'):>18}{mean_std(accs, '.3f'):>16}")
    mean = {name: statistics.fmean(r[name].train_s for r in runs) for name in METHODS}
    acc = {name: statistics.fmean(r[name].acc for r in runs) for name in METHODS}
    print(
        f"grpo_vs_trl={mean['trl'] / mean['ours_grpo']:.2f} mugrpo_vs_trl={mean['trl'] / mean['ours_mugrpo']:.2f} "
        f"acc_ours_grpo={acc['ours_grpo']:.3f} acc_trl={acc['trl']:.3f} acc_mugrpo={acc['ours_mugrpo']:.3f}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_vs_trl")
    parser.add_argument("--runs", type=int, default=1, help="repeat the three trainings N times (mean ± std)")
    parser.add_argument("--smoke", action="store_true", help="tiny runs: check that the benchmark runs")
    parser.add_argument("--task", choices=sorted(TASKS), default="demo", help="the demo or the long-reasoning task")
    parser.add_argument("--updates", type=int, help="updates per method (stages.num_stages = N / μ for each)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides applied to every run")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error(f"--runs {args.runs}: must be >= 1")
    if not trl_available():
        print(f"TRL is not installed: this benchmark runs TRL's GRPOTrainer. Install it with `{INSTALL}`.")
        return 0
    from transformers.utils import logging as transformers_logging

    from megatron_mugrpo.cli import quiet_libraries
    from megatron_mugrpo.config import load_config
    from megatron_mugrpo.warmstart import prepare_base_model

    quiet_libraries()  # the table, not the libraries' import-time chatter
    transformers_logging.disable_progress_bar()
    task = TASKS[args.task]
    user = [*(SMOKE if args.smoke else []), *args.overrides]
    try:  # every config and TRL's settings checked before the warm start
        plan = method_overrides(task, user, smoke=args.smoke, updates=args.updates)
        cfgs = {name: load_config(method_config(task, name), found) for name, found in plan.items()}
        trl_settings(cfgs["trl"], args.out)
    except InputError as exc:
        parser.error(str(exc))
    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)
    base = prepare_base_model(cfgs["ours_mugrpo"], args.out / "base_model")  # one warm start, outside every timing
    report([one_run(i, base, args.out, task, plan) for i in range(args.runs)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
