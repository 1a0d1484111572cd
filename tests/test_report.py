"""write_report: PNGs from two runs' metrics.jsonl, skipped metrics noted, a non-run dir is an error;
write_sweep_report: mean ± std over seeds, hand-computed."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest
from PIL import Image

from megatron_mugrpo.metrics import MetricsLogger
from megatron_mugrpo.report import (
    REWARD,
    Run,
    SeedGroup,
    accuracy_bands,
    eval_series,
    group_style,
    main,
    mean_std,
    moving_average,
    seed_band,
    stage_series,
    token_weighted_rate,
    write_report,
    write_sweep_report,
)

UPDATES = 8
EXPECTED_FILES = (
    "eval_accuracy.png",
    "nav_clip_fractions.png",
    "ratio_neg_adv.png",
    "reward_per_stage.png",
    "report.json",
    "report.md",
)


def _fake_run(run_dir: Path, *, updates_per_stage: int, seconds_per_update: float) -> None:
    """Log a short run the way the staged loop does (see the convention in report.py)."""
    with MetricsLogger(run_dir, tensorboard=False, console=False) as logger:
        for update in range(UPDATES):
            if update % updates_per_stage == 0:
                stage = update // updates_per_stage
                logger.log({"rollout/reward_mean": 0.2 + 0.1 * stage, "rollout/stage": stage}, step=update)
            logger.log(
                {
                    "train/loss": 0.1,
                    "train/nav_vetoed_frac": 0.01 * update,
                    "train/masked_frac": 0.01 * update,  # μ-GRPO logs its veto under both names
                    "train/clip_frac_low": 0.0,
                    "train/clip_frac_high": 0.02,
                    "train/ratio_mean_neg_adv": 1.0 - 0.01 * update,
                },
                step=update + 1,
            )
            if (update + 1) % 4 == 0:
                t = seconds_per_update * (update + 1)
                logger.log(
                    {"eval/aime/pass@1": 0.1 + 0.01 * update, "eval/avg_pass@1": 0.2, "perf/t_total_s": t},
                    step=update + 1,
                )


def _is_png(path: Path) -> bool:
    with Image.open(path) as image:
        return image.format == "PNG" and image.size[0] > 100 and image.size[1] > 100


def test_two_runs_give_every_plot(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    _fake_run(tmp_path / "mu_grpo", updates_per_stage=4, seconds_per_update=1.0)
    _fake_run(tmp_path / "grpo", updates_per_stage=2, seconds_per_update=3.0)
    out = tmp_path / "report"
    # Through the command line, which prints the written paths.
    assert main([str(tmp_path / "mu_grpo"), str(tmp_path / "grpo"), "--out", str(out)]) == 0
    written = [Path(line) for line in capsys.readouterr().out.split()]
    assert written == [out / name for name in EXPECTED_FILES]
    assert all(_is_png(p) for p in written[:-2])
    summary = (out / "report.md").read_text()
    assert "| mu_grpo | 8 | 0.2000 | 0.2000 | 8 |" in summary
    assert "| grpo | 8 | 0.2000 | 0.2000 | 24 |" in summary
    assert "- none" in summary  # nothing skipped


def test_missing_metrics_are_skipped_with_a_note(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path / "partial", tensorboard=False, console=False) as logger:
        for update in range(1, 251):  # long enough for the moving-average overlay
            logger.log({"train/clip_frac_high": 0.1 + 1e-4 * update, "train/loss": 0.5}, step=update)
        logger.log({"eval/avg_pass@1": 0.5}, step=1)  # no perf/t_total_s: falls back to wall_s
    written = write_report([tmp_path / "partial"], tmp_path / "out")
    assert [p.name for p in written] == ["eval_accuracy.png", "nav_clip_fractions.png", "report.json", "report.md"]
    notes = written[-1].read_text()
    assert "skipped 'train/nav_vetoed_frac' in nav_clip_fractions.png" in notes
    assert "skipped ratio_neg_adv.png: no run logged 'train/ratio_mean_neg_adv'" in notes
    assert "skipped reward_per_stage.png: no run logged 'rollout/reward_mean'" in notes
    assert "lack 'perf/t_total_s'; plotted against wall_s" in notes


def test_run_dir_without_metrics_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"empty/metrics\.jsonl does not exist"):
        write_report([tmp_path / "empty"], tmp_path / "out")
    assert main([str(tmp_path / "empty"), "--out", str(tmp_path / "out")]) == 2
    assert "metrics.jsonl does not exist" in capsys.readouterr().err


def test_series_extraction() -> None:
    records = [
        {"step": 0, "rollout/reward_mean": 0.1, "rollout/stage": 0},
        {"step": 4, "eval/avg_pass@1": 0.3, "perf/t_total_s": 40.0, "wall_s": 41.0},
        {"step": 4, "rollout/reward_mean": 0.2, "rollout/stage": 1},
        {"step": 4, "rollout/reward_mean": 0.25, "rollout/stage": 1},  # stage 1 regenerated after a resume
        {"step": 8, "eval/avg_pass@1": 0.4, "wall_s": 90.0},
    ]
    notes: list[str] = []
    acc = eval_series(records, "eval/avg_pass@1", notes, "run")
    assert (acc.x, acc.y) == ([40.0, 90.0], [0.3, 0.4])
    assert notes == ["run: 1 'eval/avg_pass@1' record(s) lack 'perf/t_total_s'; plotted against wall_s"]
    reward = stage_series(records)
    assert (reward.x, reward.y) == ([0.0, 1.0], [0.1, 0.25])
    unlabelled = stage_series([{"step": 0, REWARD: 0.5}, {"step": 2, REWARD: 0.7}])
    assert (unlabelled.x, unlabelled.y) == ([0.0, 1.0], [0.5, 0.7])


def test_moving_average() -> None:
    assert moving_average([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert moving_average([2.0], 5) == [2.0]


def test_standalone_evaluations_stay_out_of_the_training_curves(tmp_path: Path) -> None:
    """A later `mugrpo eval` of an old checkpoint appends a record with a 'source'; the report's curves
    follow the training run, so that record is not a point of the accuracy curve."""
    from megatron_mugrpo.report import load_runs

    _fake_run(tmp_path, updates_per_stage=4, seconds_per_update=1.0)
    with MetricsLogger(tmp_path, tensorboard=False, console=False, source="mugrpo eval of step_00000004") as logger:
        logger.log({"eval/avg_pass@1": 0.9, "perf/t_total_s": 4.5}, step=4)
    (run,) = load_runs([tmp_path])
    assert eval_series(run.records, "eval/avg_pass@1", [], "run").y == [0.2, 0.2]


# ---------------------------------------------------------------------------------------------------
# Sweeps: groups of seeds
# ---------------------------------------------------------------------------------------------------


def _seed_records(acc: list[float], t: list[float], veto: list[tuple[float, float]]) -> list[dict]:
    """An eval before training and after each update pair; per-update (veto fraction, response tokens)."""
    records = [{"step": 0, "eval/avg_pass@1": acc[0], "perf/t_total_s": t[0], "perf/t_rollout_s": 1.0}]
    for update, (frac, tokens) in enumerate(veto, start=1):
        records.append({"step": update, "train/nav_vetoed_frac": frac, "train/response_tokens": tokens})
        if update % 2 == 0:
            i = update // 2
            records.append(
                {"step": update, "eval/avg_pass@1": acc[i], "perf/t_total_s": t[i], "perf/t_rollout_s": 2.0 * i}
            )
    return records


def test_mean_std_and_seed_band() -> None:
    stat = mean_std([1.0, 2.0, 4.0])
    assert stat.mean == pytest.approx(7 / 3) and stat.n == 3
    assert stat.std == pytest.approx(math.sqrt(((1 - 7 / 3) ** 2 + (2 - 7 / 3) ** 2 + (4 - 7 / 3) ** 2) / 2))
    single = mean_std([0.5, math.nan])  # NaN left out; one value has no spread
    assert (single.mean, single.n) == (0.5, 1) and math.isnan(single.std)
    band = seed_band([{0.0: 1.0, 2.0: 3.0, 4.0: 5.0}, {0.0: 3.0, 2.0: 5.0}, {}])
    assert (band.x, band.mean, band.n) == ([0.0, 2.0], [2.0, 4.0], 2)  # x values both seeds have
    assert band.std == pytest.approx([math.sqrt(2), math.sqrt(2)])


def test_rates_are_token_weighted() -> None:
    records = [
        {"step": 1, "train/nav_vetoed_frac": 0.5, "train/response_tokens": 10.0},
        {"step": 2, "train/nav_vetoed_frac": 0.0, "train/response_tokens": 30.0},
    ]
    assert token_weighted_rate(records, "train/nav_vetoed_frac") == pytest.approx(5 / 40)  # not (0.5 + 0) / 2
    assert math.isnan(token_weighted_rate(records, "train/clip_frac_low"))


def test_sweep_report_means_over_seeds(tmp_path: Path) -> None:
    seeds = {
        "a": [
            _seed_records([0.1, 0.2, 0.4], [0.0, 10.0, 20.0], [(0.1, 10.0), (0.2, 10.0), (0.0, 20.0), (0.3, 20.0)]),
            _seed_records([0.2, 0.1, 0.3], [0.0, 12.0, 26.0], [(0.0, 10.0), (0.0, 10.0), (0.4, 10.0), (0.0, 10.0)]),
        ],
        "b": [_seed_records([0.3, 0.3, 0.5], [0.0, 5.0, 9.0], [(0.0, 1.0)] * 4)],
    }
    groups = [
        SeedGroup(label=name, runs=[Run(label=f"seed_{i}", records=r) for i, r in enumerate(runs)])
        for name, runs in seeds.items()
    ]
    written = write_sweep_report(groups, tmp_path, title="test", notes=["b/seed_1 failed"])
    assert [p.name for p in written] == [
        "sweep_accuracy.png",
        "sweep_veto_clip.png",
        "summary.csv",
        "runs.csv",
        "summary.md",
    ]
    assert all(_is_png(p) for p in written[:2])
    rows = {row["variant"]: row for row in csv.DictReader((tmp_path / "summary.csv").open())}
    a = rows["a"]
    assert int(a["n"]) == 2
    assert float(a["final_acc_mean"]) == pytest.approx(0.35) and float(a["final_acc_std"]) == pytest.approx(
        math.sqrt(2 * 0.05**2)
    )
    assert float(a["best_acc_mean"]) == pytest.approx(0.35)
    assert float(a["acc_gain_mean"]) == pytest.approx((0.3 + 0.1) / 2)
    assert float(a["t_total_s_mean"]) == pytest.approx(23.0) and float(a["t_rollout_s_mean"]) == pytest.approx(4.0)
    veto = [(0.1 * 10 + 0.2 * 10 + 0.3 * 20) / 60, 0.4 * 10 / 40]
    assert float(a["veto_rate_mean"]) == pytest.approx(sum(veto) / 2)
    assert float(a["veto_rate_std"]) == pytest.approx(abs(veto[0] - veto[1]) / math.sqrt(2))
    assert math.isnan(float(a["clip_low_mean"]))  # never logged
    assert int(rows["b"]["n"]) == 1 and math.isnan(float(rows["b"]["final_acc_std"]))
    summary = (tmp_path / "summary.md").read_text()
    assert "| a | 2 | 0.350 ± 0.071 |" in summary and "| b | 1 | 0.500 |" in summary
    assert "- b/seed_1 failed" in summary and "skipped sweep_ratio_neg_adv.png" in summary
    by_update, by_time = accuracy_bands(groups[0])
    assert by_update.x == [0.0, 2.0, 4.0] and by_update.mean == pytest.approx([0.15, 0.15, 0.35])
    assert by_time.x == pytest.approx([0.0, 11.0, 23.0])  # each evaluation at the seeds' mean wall clock


def test_a_sweep_of_many_variants_draws_no_two_groups_alike() -> None:
    styles = [tuple(group_style(i).values()) for i in range(40)]
    assert len(set(styles)) == 40  # F8's 12 variants once drew grpo and clip_high_2 in one blue
    assert group_style(0) == {"color": "C0", "linestyle": "-"} and group_style(12) == {"color": "C2", "linestyle": "--"}


def test_replay_metrics_get_their_plot(tmp_path: Path) -> None:
    """A run with Headroom-Drift Replay gets replay.png (headroom accepted/rejected, drift, age per stage)."""
    _fake_run(tmp_path / "hdr", updates_per_stage=4, seconds_per_update=1.0)
    with MetricsLogger(tmp_path / "hdr", tensorboard=False, console=False) as logger:
        for stage in range(1, 3):
            metrics = {
                "replay/headroom_mean": 0.3,
                "replay/headroom_mean_rejected": 0.2,
                "replay/drift_mean": 1e-3 * stage,
                "replay/age_mean": 4.0 * stage,
            }
            logger.log(metrics, step=4 * stage + 1)
    written = write_report([tmp_path / "hdr"], tmp_path / "out")
    assert [p.name for p in written] == [*EXPECTED_FILES[:-2], "replay.png", "report.json", "report.md"]
    assert _is_png(written[-3])
    assert "- none" in written[-1].read_text()


def test_a_moe_run_gets_load_and_per_layer_plots_and_a_dense_one_does_not(tmp_path: Path):
    from megatron_mugrpo.training.moe import load_layer_key

    with MetricsLogger(tmp_path / "moe", tensorboard=False, console=False) as logger:
        for update in range(1, UPDATES + 1):
            record = {"train/loss": 0.1, "train/moe_load_min": 0.1, "train/moe_load_max": 0.4}
            record["train/routing_agreement"] = 1.0 - 0.01 * update
            for layer in (1, 3):  # the sparse layers of a model whose layers 0 and 2 are dense
                record[load_layer_key("min", layer)] = 0.1 + 0.01 * layer
                record[load_layer_key("max", layer)] = 0.4 - 0.01 * layer
            logger.log(record, step=update)
    _fake_run(tmp_path / "dense", updates_per_stage=4, seconds_per_update=1.0)

    written = {p.name: p for p in write_report([tmp_path / "moe", tmp_path / "dense"], tmp_path / "both")}
    assert {"moe.png", "moe_load_layers.png"} <= set(written)
    with Image.open(written["moe.png"]) as panels, Image.open(written["moe_load_layers.png"]) as layers:
        # moe_load_min, moe_load_max, routing_agreement (no aux loss logged); one per-layer panel: the MoE run
        assert panels.width / panels.height == pytest.approx(3 * 5.0 / 3.6, rel=0.02)
        assert layers.width / layers.height == pytest.approx(5.0 / 3.6, rel=0.02)
    dense = {p.name for p in write_report([tmp_path / "dense"], tmp_path / "dense_only")}
    assert not {"moe.png", "moe_load_layers.png"} & dense
