"""`mugrpo sweep` without training: the sweep-file schema and its errors, the plan (seeds, shared base
models), the scheduler (parallelism, failures, threads), run-directory checks and the experiments/ files.

The end-to-end sweep (real runs, interrupted and resumed) is tests/e2e/test_sweep_runs.py.
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

from megatron_mugrpo.config import load_config
from megatron_mugrpo.sweep import (
    BASE_DIR,
    FAILED,
    FINISHED,
    LOG_FILE,
    Job,
    SweepError,
    build_base_models,
    check_run_config,
    differing_keys,
    execute,
    load_sweep,
    plan_sweep,
    read_status,
    run_environment,
    run_state,
    sweep_lock,
    threads_per_run,
)

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "configs" / "demo_cpu.yaml"
DEMO_GRPO = ROOT / "configs" / "demo_grpo_cpu.yaml"


def write_sweep(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "sweep.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def demo_sweep(tmp_path: Path, variants: str, seeds: str = "[0, 1]", extra: str = "") -> Path:
    body = f"base: {DEMO}\nseeds: {seeds}\n{extra}variants:\n{textwrap.indent(textwrap.dedent(variants), '  ')}"
    return write_sweep(tmp_path, body)


def test_sweep_file_is_parsed_in_order(tmp_path: Path) -> None:
    path = demo_sweep(
        tmp_path,
        f"""\
        mu_grpo: []
        grpo: [inherit {DEMO_GRPO}, eval.every_updates=0]
        no_veto: [algo.mu_grpo.veto_scope=none]
        """,
        extra="overrides: [logging.tensorboard=false]\n",
    )
    spec = load_sweep(path, ["optim.lr=2e-4"])
    assert [v.name for v in spec.variants] == ["mu_grpo", "grpo", "no_veto"]
    assert [v.config for v in spec.variants] == [DEMO, DEMO_GRPO, DEMO]
    assert spec.variants[1].overrides == ["eval.every_updates=0"]
    assert (spec.overrides, spec.extra_overrides) == (["logging.tensorboard=false"], ["optim.lr=2e-4"])
    assert spec.seeds == [0, 1]
    assert spec.seed_keys == ["seed", "stages.seed", "data.seed"]
    assert spec.description == "sweep"  # the file's name without a description


def test_inherit_paths_are_relative_to_the_sweep_file(tmp_path: Path) -> None:
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "mine.yaml").write_text(f"inherit: {DEMO}\noptim:\n  lr: 5.0e-4\n")
    spec = load_sweep(demo_sweep(tmp_path, "mine: [inherit cfg/mine.yaml]\n"))
    assert spec.variants[0].config == (tmp_path / "cfg" / "mine.yaml").resolve()


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("seeds: [0]\nvariants: {a: []}\n", "'base: CONFIG.yaml' is missing"),
        (f"base: {DEMO}\nseed: [0]\nvariants: {{a: []}}\n", r"unknown key\(s\) \['seed'\]"),
        (f"base: {DEMO}\nvariants: {{a: []}}\n", "'seeds' must be a non-empty list"),
        (f"base: {DEMO}\nseeds: []\nvariants: {{a: []}}\n", "'seeds' must be a non-empty list"),
        (f"base: {DEMO}\nseeds: [0, 0]\nvariants: {{a: []}}\n", "repeat a value"),
        (f"base: {DEMO}\nseeds: [0, x]\nvariants: {{a: []}}\n", "non-negative integers"),
        (f"base: {DEMO}\nseeds: [0]\nvariants: {{}}\n", "'variants' must map at least one name"),
        (
            f"base: {DEMO}\nseeds: [0]\nvariants: {{a: [algo.mu_grpo.veto_scope]}}\n",
            "variant 'a': entry 'algo.mu_grpo.veto_scope'",
        ),
        (f"base: {DEMO}\nseeds: [0]\nvariants: {{a: algo.lr=1}}\n", "variant 'a': expected a list of strings"),
        (f"base: {DEMO}\nseeds: [0]\nvariants: {{a: [inherit nope.yaml]}}\n", "'nope.yaml' does not exist"),
        (f"base: {DEMO}\nseeds: [0]\nvariants: {{a: [inherit]}}\n", "needs a path"),
        (
            f"base: {DEMO}\nseeds: [0]\nvariants: {{a: [inherit {DEMO}, inherit {DEMO_GRPO}]}}\n",
            "more than one 'inherit PATH'",
        ),
        (f"base: {DEMO}\nseeds: [0]\nvariants: {{_base: []}}\n", "variant '_base': a variant name is a directory"),
        (f"base: {DEMO}\nseeds: [0]\nvariants: {{a: [stages.seed=3]}}\n", "sets 'stages.seed', which the sweep"),
        (f"base: {DEMO}\nseeds: [0]\noverrides: [seed=1]\nvariants: {{a: []}}\n", "sets 'seed', which the sweep"),
        (f"base: {DEMO}\nseeds: [0]\nseed_keys: []\nvariants: {{a: []}}\n", "seed_keys is empty"),
        (f"base: {DEMO}\nseeds: [0\nvariants: {{a: []}}\n", "not valid YAML"),
        ("- just a list\n", "expected a mapping"),
    ],
)
def test_bad_sweep_files_are_one_clear_error(tmp_path: Path, body: str, message: str) -> None:
    path = write_sweep(tmp_path, body)
    with pytest.raises(SweepError, match=message) as info:
        load_sweep(path)
    assert str(path) in str(info.value)


def test_bad_override_values_name_the_variant_and_seed(tmp_path: Path) -> None:
    spec = load_sweep(demo_sweep(tmp_path, "ok: []\nbad: [algo.clip_hgh=5]\n"))
    with pytest.raises(SweepError, match=r"variant 'bad', seed 0: .*algo\.clip_hgh"):
        plan_sweep(spec, tmp_path / "out", load=load_config)
    spec = load_sweep(demo_sweep(tmp_path, "bad: [algo.mu_grpo.clip_low=7]\n"))
    with pytest.raises(SweepError, match=r"variant 'bad', seed 0: .*algo\.mu_grpo\.clip_low"):
        plan_sweep(spec, tmp_path / "out", load=load_config)


def test_missing_sweep_file(tmp_path: Path) -> None:
    with pytest.raises(SweepError, match="does not exist"):
        load_sweep(tmp_path / "nope.yaml")


def test_plan_sets_every_seed_key_and_orders_overrides(tmp_path: Path) -> None:
    spec = load_sweep(
        demo_sweep(tmp_path, "a: [optim.lr=3e-4]\nb: [inherit " + str(DEMO_GRPO) + "]\n", seeds="[3, 7]"),
        ["optim.lr=2e-4"],
    )
    plan = plan_sweep(spec, tmp_path / "out", load=load_config)
    assert [run.name for run in plan] == ["a/seed_3", "a/seed_7", "b/seed_3", "b/seed_7"]
    for run in plan:
        assert run.run_dir == tmp_path / "out" / run.variant / f"seed_{run.seed}"
        assert (run.cfg.seed, run.cfg.stages.seed, run.cfg.data.seed) == (run.seed, run.seed, run.seed)
    assert plan[0].cfg.optim.lr == 2e-4  # command-line overrides come after the variant's
    assert plan[2].cfg.algo.loss == "grpo" and plan[2].cfg.stages.updates_per_stage == 4
    argv = plan[0].argv(resume=False)
    assert argv[argv.index("--config") + 1] == str(DEMO)
    assert argv[-5:] == ["optim.lr=2e-4", "seed=3", "stages.seed=3", "data.seed=3", f"model.hf_dir={plan[0].base_dir}"]
    assert plan[1].argv(resume=True)[-2:] == ["--resume", str(plan[1].run_dir)]


def test_seed_keys_can_keep_the_data_fixed(tmp_path: Path) -> None:
    spec = load_sweep(demo_sweep(tmp_path, "a: []\n", extra="seed_keys: [seed, stages.seed]\n"))
    plan = plan_sweep(spec, tmp_path / "out", load=load_config)
    assert [(r.cfg.seed, r.cfg.data.seed) for r in plan] == [(0, 0), (1, 0)]


def test_runs_of_one_seed_and_warm_start_share_a_base_model(tmp_path: Path) -> None:
    variants = "a: []\nb: [algo.mu_grpo.veto_scope=none]\nc: [warmstart.steps=3]\n"
    spec = load_sweep(demo_sweep(tmp_path, variants, extra="overrides: [warmstart.steps=2]\n"))
    plan = {run.name: run for run in plan_sweep(spec, tmp_path / "out", load=load_config)}
    assert plan["a/seed_0"].base_dir == plan["b/seed_0"].base_dir  # the loss does not touch the base model
    assert plan["a/seed_0"].base_dir != plan["a/seed_1"].base_dir  # the seed initialises it
    assert plan["a/seed_0"].base_dir != plan["c/seed_0"].base_dir  # other warm-start settings
    assert plan["a/seed_0"].base_dir.parent == tmp_path / "out" / BASE_DIR
    assert "model.hf_dir=" + str(plan["a/seed_0"].base_dir) in plan["a/seed_0"].argv(resume=False)

    messages: list[str] = []
    build_base_models([plan["a/seed_0"], plan["b/seed_0"], plan["a/seed_1"]], messages.append)
    built = sorted(p.name for p in (tmp_path / "out" / BASE_DIR).iterdir())
    assert built == sorted({plan["a/seed_0"].base_dir.name, plan["a/seed_1"].base_dir.name})
    assert len(messages) == 2  # one build per distinct base model
    marker = json.loads((plan["a/seed_1"].base_dir / "warmstart.json").read_text())
    assert marker["spec"]["seed"] == 1 and marker["spec"]["warmstart"]["steps"] == 2


def test_a_config_with_its_own_model_has_no_shared_base(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    spec = load_sweep(demo_sweep(tmp_path, "a: []\n", extra=f"overrides: [model.hf_dir={model}]\n"))
    run = plan_sweep(spec, tmp_path / "out", load=load_config)[0]
    assert run.base_dir is None and run.expected_config()["model"]["hf_dir"] == str(model)


def test_existing_run_with_other_settings_is_an_error(tmp_path: Path) -> None:
    from megatron_mugrpo.config import save_config

    model = tmp_path / "model"
    model.mkdir()
    spec = load_sweep(demo_sweep(tmp_path, "a: []\n", extra=f"overrides: [model.hf_dir={model}]\n"))
    run = plan_sweep(spec, tmp_path / "out", load=load_config)[0]
    assert run_state(run) == "new"
    check_run_config(run)  # nothing there yet
    run.run_dir.mkdir(parents=True)
    save_config(run.cfg, run.run_dir / "config.yaml")
    check_run_config(run)  # what `mugrpo train` writes for this plan
    assert run_state(run) == "resume"
    other = plan_sweep(
        load_sweep(demo_sweep(tmp_path, "a: [optim.lr=0.5]\n", extra=f"overrides: [model.hf_dir={model}]\n")),
        tmp_path / "out",
        load=load_config,
    )[0]
    with pytest.raises(
        SweepError, match=r"seed_0 was started with other settings than the sweep now asks for \(optim\.lr\)"
    ):
        check_run_config(other)


def test_differing_keys() -> None:
    saved = {"a": {"b": 1, "c": [1, 2]}, "d": 2}
    assert differing_keys(saved, {"a": {"b": 1, "c": [1, 2]}, "d": 2}) == []
    assert differing_keys(saved, {"a": {"b": 2, "c": [1]}, "d": 2, "e": 0}) == ["a.b", "a.c", "e"]


def _python_job(tmp_path: Path, name: str, code: str) -> Job:
    return Job(name=name, argv=[sys.executable, "-c", code], run_dir=tmp_path / name)


def test_scheduler_runs_n_at_once_and_keeps_going_after_a_failure(tmp_path: Path) -> None:
    """Each job writes its start and end time to its own file; at most `parallel` intervals overlap."""
    traces = tmp_path / "traces"
    traces.mkdir()
    body = "import os, time; start = time.time(); time.sleep(0.6); "
    body += f"open(os.path.join({str(traces)!r}, str(os.getpid())), 'w').write(f'{{start}} {{time.time()}}')"
    jobs = [_python_job(tmp_path, f"ok{i}", body) for i in range(3)]
    jobs.insert(1, _python_job(tmp_path, "bad", "import sys; print('something broke'); sys.exit(3)"))
    messages: list[str] = []
    results = execute(jobs, parallel=2, env=run_environment(1), echo=messages.append)
    assert results == {"ok0": 0, "bad": 3, "ok1": 0, "ok2": 0}
    intervals = [tuple(map(float, path.read_text().split())) for path in traces.iterdir()]
    assert len(intervals) == 3
    for start, _ in intervals:  # jobs running at any job's start, itself included
        assert sum(s <= start < e for s, e in intervals) <= 2
    assert read_status(tmp_path / "bad")["status"] == FAILED and read_status(tmp_path / "bad")["returncode"] == 3
    assert "something broke" in (tmp_path / "bad" / LOG_FILE).read_text()
    assert all(read_status(tmp_path / f"ok{i}")["status"] == FINISHED for i in range(3))
    failed = next(i for i, m in enumerate(messages) if m.startswith("FAILED bad (exit status 3)"))
    assert LOG_FILE in messages[failed] and messages[failed + 1].endswith("| something broke")


def test_a_second_attempt_appends_to_the_log(tmp_path: Path) -> None:
    job = _python_job(tmp_path, "run", "print('attempt')")
    execute([job], parallel=1, env=run_environment(1), echo=lambda _: None)
    execute([job], parallel=1, env=run_environment(1), echo=lambda _: None)
    assert (tmp_path / "run" / LOG_FILE).read_text().count("attempt\n") == 2
    assert read_status(tmp_path / "run")["attempts"] == 2


def test_runs_get_their_share_of_the_cores(tmp_path: Path) -> None:
    assert threads_per_run(2, 16) == 8 and threads_per_run(3, 16) == 5 and threads_per_run(4, 2) == 1
    env = run_environment(3, base={"PATH": "/bin", "OMP_NUM_THREADS": "64"})
    assert env == {
        "PATH": "/bin",
        "OMP_NUM_THREADS": "3",
        "MKL_NUM_THREADS": "3",
        "OPENBLAS_NUM_THREADS": "3",
        "RAYON_NUM_THREADS": "3",
    }
    # torch takes its intra-op pool size from the environment (nothing in megatron_mugrpo overrides it).
    job = _python_job(tmp_path, "threads", "import torch; print('threads', torch.get_num_threads())")
    execute([job], parallel=1, env=run_environment(1), echo=lambda _: None)
    assert "threads 1\n" in (tmp_path / "threads" / LOG_FILE).read_text()


def test_one_sweep_per_directory(tmp_path: Path) -> None:
    with (
        sweep_lock(tmp_path / "out"),
        pytest.raises(SweepError, match="in use by another `mugrpo sweep`"),
        sweep_lock(tmp_path / "out"),
    ):
        pass
    with sweep_lock(tmp_path / "out"):  # released
        pass


@pytest.mark.parametrize("path", sorted((ROOT / "experiments").glob("*.yaml")), ids=lambda p: p.name)
def test_experiment_files_plan(path: Path, tmp_path: Path) -> None:
    spec = load_sweep(path)
    plan = plan_sweep(spec, tmp_path / "out", load=load_config)
    assert len(plan) == len(spec.variants) * len(spec.seeds) and len(spec.seeds) >= 3
    totals = {run.cfg.stages.total_updates for run in plan}
    assert len(totals) == 1, f"{path.name}: variants differ in their number of updates: {totals}"


def test_f6_runs_every_stabiliser_at_both_staleness_levels(tmp_path: Path) -> None:
    """F6 (issue #27): each loss at μ = 64 and μ = 256, 3 seeds, all at the same 256 updates."""
    spec = load_sweep(ROOT / "experiments" / "f6_stabilisers.yaml")
    plan = plan_sweep(spec, tmp_path / "out", load=load_config)
    settings = {}
    for run in plan:
        algo, stages = run.cfg.algo, run.cfg.stages
        dual = algo.grpo.dual_clip_c if algo.loss == "grpo" else 0.0
        settings.setdefault(run.variant, set()).add((algo.loss, dual, stages.updates_per_stage))
    assert all(len(s) == 1 for s in settings.values()), settings
    got = {next(iter(s)) for s in settings.values()}
    losses = [
        ("mu_grpo", 0.0),
        ("opsm", 0.0),
        ("icepop", 0.0),
        ("icepop_current", 0.0),
        ("gspo", 0.0),
        ("m2po", 0.0),
        ("grpo", 0.0),
        ("grpo", 3.0),
    ]
    assert got == {(loss, dual, mu) for loss, dual in losses for mu in (64, 256)}
    assert spec.seeds == [0, 1, 2] and {run.cfg.stages.total_updates for run in plan} == {256}


def test_cli_reports_a_bad_sweep_file_as_one_error(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from megatron_mugrpo.cli import main

    path = demo_sweep(tmp_path, "a: [algo.mu_grpo.veto_scope]\n")
    assert main(["sweep", str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: sweep file") and "algo.mu_grpo.veto_scope" in err[0]
    assert not (tmp_path / "out").exists(), "nothing is written for a rejected sweep file"
    good = demo_sweep(tmp_path, "a: []\n")
    assert main(["sweep", str(good), "--out", str(tmp_path / "out"), "--parallel", "0"]) == 2
    assert "--parallel 0" in capsys.readouterr().err
