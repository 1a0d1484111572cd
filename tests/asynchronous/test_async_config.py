"""The `mode` key and the `async` section: the keyword alias both ways, validation, the presets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from megatron_mugrpo.asynchronous.batches import batch_size, prompt_range
from megatron_mugrpo.config import config_from_dict, load_config, save_config
from megatron_mugrpo.errors import ConfigError

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_async_is_the_key_in_yaml_overrides_and_snapshots(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("mode: async\nasync:\n  rollout_ranks: 2\n  max_lag: 8\n")
    cfg = load_config(path, ["async.sync_every=2", "stages.mini_groups=4", "stages.train_groups=16"])
    assert cfg.mode == "async"
    assert (cfg.async_.rollout_ranks, cfg.async_.max_lag, cfg.async_.sync_every) == (2, 8, 2)
    save_config(cfg, tmp_path / "config.yaml")
    written = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert written["async"]["max_lag"] == 8 and "async_" not in written
    assert load_config(tmp_path / "config.yaml") == cfg
    assert config_from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg  # a checkpoint's metadata


def test_inherited_async_sections_merge(tmp_path: Path) -> None:
    (tmp_path / "base.yaml").write_text("async:\n  max_lag: 64\n  queue_groups: 100\n")
    (tmp_path / "run.yaml").write_text("inherit: base.yaml\nmode: async\nasync:\n  max_lag: 32\n")
    cfg = load_config(tmp_path / "run.yaml")
    assert (cfg.async_.max_lag, cfg.async_.queue_groups) == (32, 100)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["async.max_lag=2", "async.sync_every=4"], r"async\.max_lag=2 < async\.sync_every=4"),
        (["async.rollout_ranks=0"], r"async\.rollout_ranks=0 must be >= 1"),
        (["async.queue_groups=0"], r"async\.queue_groups=0 must be >= 1"),
        (["async.worker_timeout_s=0"], r"async\.worker_timeout_s=0\.0 must be > 0"),
        (["mode=async", "async.queue_groups=16"], r"async\.queue_groups=16 is smaller than stages\.mini_groups=32"),
        (["mode=streaming"], r"mode='streaming' is not one of \('staged', 'async'\)"),
        (["mode=async", "algo.rollout_correction.tis_cap=2"], r"algo\.rollout_correction .* mode: async has no"),
        (["mode=async", "rollout.quantization=fp8"], r"rollout\.quantization='fp8' is not supported in mode: async"),
        (["async.max_lagg=3"], r"'async\.max_lagg' is not a configuration key"),
        (["async_.max_lag=8"], r"'async_\.max_lag' is not a configuration key"),
        (["async.max_lag=soon"], r"async\.max_lag: Value 'soon'"),
        (["async.first_batch_groups=0"], r"async\.first_batch_groups=0 must be >= 1"),
        (["async.progress_timeout_s=-1"], r"async\.progress_timeout_s=-1\.0 must be > 0 \(or null"),
    ],
)
def test_bad_async_settings_are_clear_errors(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_hang_detection_can_be_switched_off() -> None:
    assert load_config(None, []).async_.progress_timeout_s == 1800.0
    assert load_config(None, ["async.progress_timeout_s=null"]).async_.progress_timeout_s is None


@pytest.mark.parametrize(
    ("first", "sizes"),
    [(None, [64, 64, 64, 64]), (8, [8, 16, 32, 64, 64]), (48, [48, 64, 64]), (100, [64, 64, 64])],
)
def test_worker_batches_ramp_up_and_cover_the_prompt_stream_once(first: int | None, sizes: list[int]) -> None:
    """Batch b of worker w of R takes R · n_b prompts after all earlier batches, its w-th n_b of them:
    every prompt position is generated exactly once whatever the ramp (and without one, batch b of
    worker w is slice b · R + w of batch_groups prompts, as before the ramp existed)."""
    ramp = f"async.first_batch_groups={'null' if first is None else first}"
    overrides = ["mode=async", "async.rollout_ranks=3", ramp]
    cfg = load_config(None, overrides).async_
    assert [batch_size(cfg, b) for b in range(len(sizes))] == sizes
    covered = []
    for batch in range(len(sizes) + 3):
        for worker in range(3):
            positions = prompt_range(cfg, batch, worker)
            assert len(positions) == batch_size(cfg, batch)
            covered += positions
            if first is None or first >= cfg.batch_groups:
                assert positions.start == (batch * 3 + worker) * cfg.batch_groups
    assert covered == list(range(len(covered)))


def test_the_field_name_is_refused_as_a_yaml_key(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("async_:\n  max_lag: 8\n")
    with pytest.raises(ConfigError, match="write the section as 'async', not 'async_'"):
        load_config(path)


def test_presets() -> None:
    grpo = load_config(CONFIGS / "methods" / "async_grpo.yaml")
    mu = load_config(CONFIGS / "methods" / "async_mu_grpo.yaml")
    assert grpo.mode == mu.mode == "async"
    assert grpo.async_.sync_every == mu.async_.sync_every == 4  # the paper's sync interval
    assert grpo.async_.max_lag == grpo.async_.sync_every  # async GRPO: no staleness beyond the interval
    assert mu.async_.max_lag == (1 + 255) * 4 == 1024  # async μ-GRPO: 255 extra stale intervals
    assert (grpo.algo.loss, mu.algo.loss) == ("grpo", "mu_grpo")
    assert grpo.stages.total_updates == mu.stages.total_updates == 4096
    demo, staged = load_config(CONFIGS / "demo_async_cpu.yaml"), load_config(CONFIGS / "demo_cpu.yaml")
    assert demo.mode == "async" and demo.stages.total_updates == staged.stages.total_updates


@pytest.mark.parametrize("method", ["async_grpo", "async_mu_grpo"])
def test_paper_async_files_split_four_gpus(method: str, tmp_path: Path) -> None:
    """Table 2's layout: Qwen2.5-Math-7B, 2 trainer ranks (TP 2) + 2 rollout ranks."""
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(
        json.dumps({"num_attention_heads": 28, "num_key_value_heads": 4, "num_hidden_layers": 28})
    )
    train = tmp_path / "train.jsonl"
    train.write_text('{"problem": "1+1", "answer": "2"}\n')
    path = CONFIGS / "paper" / f"qwen2.5_math_7b__{method}.yaml"
    cfg = load_config(path, [f"model.hf_dir={hf}", f"data.train_path={train}"])
    assert cfg.mode == "async" and cfg.async_.rollout_ranks == 2 and cfg.parallel.tensor_parallel == 2
    assert (cfg.rollout.engine, cfg.stages.mini_groups) == ("sglang", 32)


def test_recomputed_partial_rollouts_refuse_routing_replay_naming_both_keys() -> None:
    """A recompute at a weight switch routes the in-flight prefix afresh, so one recorded route per position
    cannot serve the tokens on both sides of the switch: the combination is a ConfigError naming the keys."""
    moe = ["mode=async", "model.tiny.arch=qwen3_moe", "moe.routing_replay=rollout", "async.partial_rollout=true"]
    with pytest.raises(ConfigError) as error:
        load_config(None, [*moe, "async.partial_kv=recompute"])
    message = str(error.value)
    for key in ("async.partial_rollout=true", "async.partial_kv=recompute", "moe.routing_replay=rollout"):
        assert key in message, message
    assert "set moe.routing_replay=none or async.partial_rollout=false" in message.lower()
    assert load_config(None, [*moe[:3], "async.partial_rollout=false"]).moe.routing_replay == "rollout"
    assert load_config(None, [*moe, "async.partial_kv=keep"]).async_.partial_kv == "keep"
