"""MetricsLogger (JSONL, TensorBoard, console), read_metrics, progress and Timer."""

from __future__ import annotations

import io
import json
import math
import sys
import time
from pathlib import Path

import pytest

from megatron_mugrpo.metrics import (
    METRICS_FILE,
    MetricsLogger,
    Timer,
    format_console_line,
    progress,
    read_metrics,
)


def _lines(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / METRICS_FILE).read_text().splitlines()]


def test_each_call_is_one_flushed_jsonl_record(tmp_path: Path) -> None:
    logger = MetricsLogger(tmp_path, tensorboard=False, console=False)
    logger.log({"train/loss": 0.5, "train/clip_frac_low": 0.125}, step=1)
    # Readable before close: a killed run keeps what it logged.
    first = _lines(tmp_path)
    assert len(first) == 1
    assert first[0]["step"] == 1 and first[0]["train/loss"] == 0.5
    assert first[0]["train/clip_frac_low"] == 0.125
    assert first[0]["wall_s"] >= 0.0 and "nonfinite" not in first[0]
    logger.log({"rollout/reward_mean": 3}, step=2)
    logger.close()
    logger.close()  # idempotent
    records = _lines(tmp_path)
    assert [r["step"] for r in records] == [1, 2]
    assert records[1]["rollout/reward_mean"] == 3.0 and records[1]["wall_s"] >= records[0]["wall_s"]
    with pytest.raises(RuntimeError, match="is closed"):
        logger.log({"train/loss": 1.0}, step=3)


def test_resume_appends_and_continues_wall_clock(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path, tensorboard=False, console=False) as logger:
        logger.log({"train/loss": 1.0}, step=1)
    first_wall = _lines(tmp_path)[0]["wall_s"]
    # Pretend the first run had been going for an hour.
    path = tmp_path / METRICS_FILE
    path.write_text(path.read_text().replace(f'"wall_s": {first_wall}', '"wall_s": 3600.0'))
    with MetricsLogger(tmp_path, tensorboard=False, console=False) as logger:
        logger.log({"train/loss": 0.9}, step=2)
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2]
    assert records[1]["wall_s"] >= 3600.0


def test_truncated_last_line_is_cut_before_appending(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path, tensorboard=False, console=False) as logger:
        logger.log({"train/loss": 1.0}, step=1)
    with (tmp_path / METRICS_FILE).open("a") as handle:
        handle.write('{"step": 2, "train/lo')  # killed mid-write
    with pytest.warns(UserWarning, match="truncated last line"):
        assert [r["step"] for r in read_metrics(tmp_path)] == [1]
    with pytest.warns(UserWarning, match="truncated last line"):
        logger = MetricsLogger(tmp_path, tensorboard=False, console=False)
    logger.log({"train/loss": 0.8}, step=2)
    logger.close()
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]


def _scalars(tensorboard_dir: Path, tag: str) -> list[tuple[int, float]]:
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    acc = event_accumulator.EventAccumulator(str(tensorboard_dir))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_keep_records_drops_exactly_what_was_logged_after_the_checkpoint(tmp_path: Path) -> None:
    """The checkpoint after update 2 stored 3 records; the next stage's summary, logged after it at the
    same step 2, and update 3 are redone by the resumed run, while a standalone evaluation's record
    (source) logged in between is kept. A step-based purge cannot tell the two step-2 records apart."""
    pytest.importorskip("tensorboard")
    with MetricsLogger(tmp_path, console=False) as logger:
        logger.log({"train/loss": 1.0}, step=1)
        logger.log({"train/loss": 2.0}, step=2)
        logger.log({"eval/avg_pass@1": 0.5, "perf/t_total_s": 10.0}, step=2)
        assert logger.records == 3  # ← the checkpoint after update 2 stores this
        logger.log({"rollout/reward_mean": 0.7, "perf/t_total_s": 12.0}, step=2)  # next stage's summary
        logger.log({"train/loss": 3.0}, step=3)
    with MetricsLogger(tmp_path, console=False, source="mugrpo eval of step_2", tensorboard_dir="tb_eval") as ev:
        ev.log({"eval/avg_pass@1": 0.5}, step=2)
    with MetricsLogger(tmp_path, console=False, keep_records=3) as logger:
        assert logger.records == 4
        logger.log({"rollout/reward_mean": 0.75, "perf/t_total_s": 11.0}, step=2)
        logger.log({"train/loss": 30.0}, step=3)
    records = read_metrics(tmp_path)
    assert [(r["step"], "source" in r) for r in records] == [
        (1, False),
        (2, False),
        (2, False),
        (2, True),
        (2, False),
        (3, False),
    ]
    assert [r["rollout/reward_mean"] for r in records if "rollout/reward_mean" in r] == [0.75], "summary logged once"
    totals = [r["perf/t_total_s"] for r in records if "perf/t_total_s" in r]
    assert totals == sorted(totals), "perf/t_total_s never goes backwards"
    tb = tmp_path / "tensorboard"
    assert _scalars(tb, "train/loss") == [(1, 1.0), (2, 2.0), (3, 30.0)]
    assert _scalars(tb, "eval/avg_pass@1") == [(2, 0.5)]
    assert _scalars(tb, "rollout/reward_mean") == [(2, 0.75)]
    assert _scalars(tmp_path / "tb_eval", "eval/avg_pass@1") == [(2, 0.5)]


def test_a_logger_without_purge_only_appends(tmp_path: Path) -> None:
    """What `mugrpo eval` and `mugrpo generate` open: the file's bytes so far stay exactly as they were."""
    with MetricsLogger(tmp_path, tensorboard=False, console=False) as logger:
        for step in (1, 2, 3):
            logger.log({"train/loss": float(step)}, step=step)
    before = (tmp_path / METRICS_FILE).read_bytes()
    with MetricsLogger(tmp_path, tensorboard=False, console=False, source="mugrpo eval of step_1") as logger:
        logger.log({"eval/avg_pass@1": 0.25}, step=1)
    after = (tmp_path / METRICS_FILE).read_bytes()
    assert after.startswith(before)
    (added,) = [json.loads(line) for line in after[len(before) :].splitlines()]
    assert added["source"] == "mugrpo eval of step_1" and added["step"] == 1


def test_bad_names_and_values_are_errors(tmp_path: Path) -> None:
    logger = MetricsLogger(tmp_path, tensorboard=False, console=False)
    with pytest.raises(ValueError, match=r"'loss' must be a string starting with one of"):
        logger.log({"loss": 1.0}, step=0)
    with pytest.raises(ValueError, match=r"metric 'train/lengths' has value \[1, 2\]"):
        logger.log({"train/lengths": [1, 2]}, step=0)
    logger.close()
    assert (tmp_path / METRICS_FILE).read_text() == ""


def test_non_finite_values_are_logged_and_flagged(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    with MetricsLogger(tmp_path, tensorboard=False, console=True) as logger:
        logger.log({"train/loss": float("nan"), "train/grad_norm": float("inf"), "train/lr": 1e-6}, step=4)
    (record,) = read_metrics(tmp_path)
    assert math.isnan(record["train/loss"]) and record["train/grad_norm"] == math.inf
    assert record["nonfinite"] == ["train/loss", "train/grad_norm"]
    out = capsys.readouterr().out
    assert "step 4" in out and "train/loss=nan" in out and "! non-finite: train/loss, train/grad_norm" in out


def test_console_line_prefers_key_metrics() -> None:
    record = {"step": 7, "wall_s": 12.3, "time": 0.0, "train/loss": 0.25, "train/other": 1.0}
    record["perf/t_total_s"] = 99
    line = format_console_line(record)
    assert line.startswith("step 7 | 12s")
    assert "train/loss=0.25" in line and "perf/t_total_s=99" in line and "train/other" not in line
    fallback = format_console_line({"step": 1, "wall_s": 0.0, "time": 0.0, "eval/x/pass@1": 0.5})
    assert fallback.endswith("eval/x/pass@1=0.5")


def test_only_rank_zero_writes(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    run_dir = tmp_path / "run"
    logger = MetricsLogger(run_dir, rank=1)
    logger.log({"train/loss": 1.0}, step=1)
    with pytest.raises(ValueError, match="must be a string starting with"):
        logger.log({"bad": 1.0}, step=1)  # still validated on every rank
    logger.close()
    assert not run_dir.exists()
    assert capsys.readouterr().out == ""


def test_tensorboard_scalars(tmp_path: Path) -> None:
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    with MetricsLogger(tmp_path, tensorboard=True, console=False) as logger:
        logger.log({"train/loss": 0.5}, step=1)
        logger.log({"train/loss": 0.25, "rollout/reward_mean": 0.75}, step=2)
    acc = event_accumulator.EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [(1, 0.5), (2, 0.25)]
    assert [(e.step, e.value) for e in acc.Scalars("rollout/reward_mean")] == [(2, 0.75)]


def test_missing_tensorboard_warns_and_keeps_jsonl(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import now raises ImportError
    with MetricsLogger(tmp_path, tensorboard=True, console=False) as logger:
        with pytest.warns(UserWarning, match=r"pip install tensorboard.*logging\.tensorboard=false"):
            logger.log({"train/loss": 1.0}, step=1)
        logger.log({"train/loss": 0.5}, step=2)  # warned once, then silent
    assert [r["train/loss"] for r in read_metrics(tmp_path)] == [1.0, 0.5]
    assert not (tmp_path / "tensorboard").exists()


def test_read_metrics_of_a_non_run_dir(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"metrics\.jsonl does not exist.*not a run directory"):
        read_metrics(tmp_path)


def test_progress_bar_enabled_and_disabled() -> None:
    stream = io.StringIO()
    with progress(total=3, desc="rollout", enabled=True, file=stream) as bar:
        bar.update(3)
    assert "rollout" in stream.getvalue() and "3/3" in stream.getvalue()
    quiet = io.StringIO()
    with progress(total=3, desc="rollout", enabled=False, file=quiet) as bar:
        bar.update(3)
        bar.set_postfix(loss=0.1)
    assert quiet.getvalue() == ""


def test_timer_accumulates_and_syncs() -> None:
    syncs = []
    timer = Timer(sync=lambda: syncs.append(1))
    for _ in range(2):
        with timer("perf/t_rollout_s"):
            time.sleep(0.01)
    with pytest.raises(KeyError), timer("perf/t_train_s"):
        raise KeyError("the section's error propagates; its time still counts")
    assert timer.total("perf/t_rollout_s") >= 0.02
    assert timer.total("perf/t_unused_s") == 0.0
    assert len(syncs) == 6  # before and after each of the three sections
    assert set(timer.metrics(reset=True)) == {"perf/t_rollout_s", "perf/t_train_s"}
    assert timer.metrics() == {}
    with pytest.raises(ValueError, match="must start with 'perf/'"), timer("train/t_s"):
        pass


def test_a_drift_mean_over_no_triggered_response_is_not_flagged_on_the_console(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """NaN there means "no response triggered this update" (the usual case): recorded, not flagged."""
    with MetricsLogger(tmp_path, tensorboard=False, console=True) as logger:
        logger.log({"train/loss": 0.5, "train/trigger_pos_frac": float("nan")}, step=1)
        logger.log({"train/loss": 0.5, "train/trigger_pos_frac": float("inf")}, step=2)
    first, second = read_metrics(tmp_path)
    assert first["nonfinite"] == ["train/trigger_pos_frac"] and second["nonfinite"] == ["train/trigger_pos_frac"]
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step")]
    assert "non-finite" not in lines[0] and "! non-finite: train/trigger_pos_frac" in lines[1]
