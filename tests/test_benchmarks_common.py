"""benchmarks/common.py, the set-up the benchmark scripts share: summaries, the best-of-N timer, a free
port, the prompt pool and the tiny model directory."""

from __future__ import annotations

import importlib.util
import json
import socket
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location(
    "benchmarks_common", Path(__file__).resolve().parents[1] / "benchmarks" / "common.py"
)
common = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(common)  # by path: the benchmarks' directory stays off this process's sys.path


def test_mean_and_mean_std_by_hand() -> None:
    assert common.mean([1.0, 2.0, 6.0]) == 3.0 and common.mean([]) == 0.0
    assert common.mean_std([1.0, 2.0, 3.0]) == "2.000 ± 1.000"  # sample std: sqrt((1 + 0 + 1) / 2)
    assert common.mean_std([0.25], ".2f") == "0.25 ± 0.00"
    assert common.mean_std([]) == "-"


def test_best_time_is_the_fastest_call_and_returns_the_last_result() -> None:
    calls, cleaned = [], []
    seconds, result = common.best_time(
        lambda: calls.append(len(calls)) or len(calls), 3, cleanup=lambda: cleaned.append(1)
    )
    assert result == 3 and calls == [0, 1, 2] and cleaned == [1, 1, 1]
    assert 0.0 <= seconds < float("inf")
    with pytest.raises(ValueError, match="repeats=0"):
        common.best_time(lambda: None, 0)


def test_free_port_can_be_bound() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", common.free_port()))


def test_prompt_pool_is_deterministic_token_ids() -> None:
    pool = common.prompt_pool(4)
    assert len(pool) == 4 and pool == common.prompt_pool(4)
    assert all(ids and all(isinstance(i, int) for i in ids) for ids in pool)


def test_tiny_model_dir_has_head_dim_64_and_its_tokenizer(tmp_path: Path) -> None:
    out = common.tiny_model_dir(tmp_path / "m", hidden=128, layers=1, max_positions=256)
    config = json.loads((out / "config.json").read_text())
    assert config["hidden_size"] // config["num_attention_heads"] == common.HEAD_DIM
    assert (config["num_key_value_heads"], config["intermediate_size"], config["tie_word_embeddings"]) == (1, 512, True)
    assert (out / "tokenizer.json").is_file() or (out / "tokenizer_config.json").is_file()
