"""write_report: PNGs from two runs' metrics.jsonl, skipped metrics noted, a non-run dir is an error."""

from __future__ import annotations

from pathlib import Path

import pytest
from PIL import Image

from megatron_mugrpo.metrics import MetricsLogger
from megatron_mugrpo.report import REWARD, eval_series, main, moving_average, stage_series, write_report

UPDATES = 8
EXPECTED_FILES = (
    "eval_accuracy.png",
    "nav_clip_fractions.png",
    "ratio_neg_adv.png",
    "reward_per_stage.png",
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
    assert all(_is_png(p) for p in written[:-1])
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
    assert [p.name for p in written] == ["eval_accuracy.png", "nav_clip_fractions.png", "report.md"]
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
    assert [p.name for p in written] == [*EXPECTED_FILES[:-1], "replay.png", "report.md"]
    assert _is_png(written[-2])
    assert "- none" in written[-1].read_text()
