"""End to end with an FP8 behaviour policy (rollout.quantization=fp8) and the rollout correction on:
the demo-scale run trains, reports the mismatch instead of warning, stores log π_old next to each
stage's shards (listed in the store's manifest), and a run killed in the middle of a stage resumes
from those files to exactly the uninterrupted run's weights and metrics.

Needs NVIDIA Model Optimizer (the ``fp8`` extra); skipped without it.
"""

from __future__ import annotations

import importlib.util
import json
import signal
from pathlib import Path

import pytest
import torch
from e2e_runs import final_weights, mugrpo, records, train
from safetensors.torch import load_file

from megatron_mugrpo.training.stage_reference import OLD_LOGPROBS_GLOB

if importlib.util.find_spec("modelopt") is None:
    pytest.skip("NVIDIA Model Optimizer is not installed (pip install 'megatron_mugrpo[fp8]')", allow_module_level=True)

FP8 = [
    "rollout.quantization=fp8",
    "rollout.modelopt.calibration_prompts=64",
    "algo.rollout_correction.tis_cap=2",
    "algo.rollout_correction.mask_bound=8",
]


@pytest.mark.slow
@pytest.mark.timeout(2700)  # three small FP8 runs (uninterrupted, killed, resumed) on a loaded 2-core machine
def test_fp8_rollout_trains_and_resumes_mid_stage(tmp_path: Path, base_model: Path):
    full = tmp_path / "fp8_full"
    train(full, base_model, *FP8)
    run_dir = tmp_path / "fp8"
    # checkpoint.every_updates=2 (SMALL): killed after update 3, the run resumes stage 0 at update 2,
    # after θ has moved, so log π_old must come from the stored file.
    proc = train(run_dir, base_model, *FP8, crash_at="update:3")
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    proc = mugrpo("train", "--resume", str(run_dir))
    assert "exceeds logging.logprob_gap_tolerance" not in proc.stderr

    for stage in (0, 1):
        stage_dir = run_dir / "rollouts" / f"stage_{stage:03d}"
        manifest = json.loads((stage_dir / "manifest.json").read_text())
        assert manifest["sampling"]["quantization"] == "fp8"
        listed = [info["file"] for info in manifest["old_logprobs"]["shards"]]
        assert (
            len(listed) == len(manifest["shards"])
            and sorted(p.name for p in stage_dir.glob(OLD_LOGPROBS_GLOB)) == listed
        )

    recs = records(run_dir)
    mismatch = [r for r in recs if "rollout/mismatch_kl" in r]
    assert [r["step"] for r in mismatch] == [0, 4], "measured once per stage, before its first update"
    for r in mismatch:
        assert r["rollout/mismatch_kl"] > 0 and r["rollout/mismatch_logprob_abs_max"] > 1e-4
    updates = [r for r in recs if "train/loss" in r]
    assert [r["step"] for r in updates] == list(range(1, 9))
    for first in (updates[0], updates[4]):
        # π_θ = π_old at a stage's first update: the corrected ratio is 1, the gap to β is the FP8 mismatch.
        assert first["train/ratio_mean"] == pytest.approx(1.0, abs=1e-5)
        assert first["train/rollout_logprob_abs_diff_max"] > 1e-4
    assert all(0 < r["train/rollout_corr_weight_mean"] <= 2.0 for r in updates)
    assert any(abs(r["train/loss"]) > 0 for r in updates)
    assert any("eval/avg_pass@1" in r for r in recs)

    start, end = load_file(str(base_model / "model.safetensors")), final_weights(run_dir)
    assert any(not torch.equal(start[k], end[k]) for k in start), "parameters did not change"

    # Resumed mid-stage from the stored log π_old = never interrupted: same weights, same metrics.
    expected = final_weights(full)
    assert expected.keys() == end.keys()
    for name in expected:
        assert torch.equal(expected[name], end[name]), f"{name} differs after the mid-stage resume"
    want = records(full)
    for key in ("train/loss", "train/rollout_corr_weight_mean", "train/ratio_mean", "rollout/mismatch_kl"):
        assert [r[key] for r in recs if key in r] == pytest.approx([r[key] for r in want if key in r]), key
