"""benchmarks/common.py, the set-up the benchmark scripts share: summaries, the best-of-N timer, a free
port, the prompt pool and the tiny model directory."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
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


def test_replay_summary_means_the_stages_with_a_non_empty_buffer_and_skips_nan() -> None:
    records = [
        {"step": 1, "replay/buffer_groups": 0.0, "replay/accepted": 9.0, "replay/acceptance_rate": 1.0},
        {"step": 2, "replay/buffer_groups": 4.0, "replay/accepted": 1.0, "replay/acceptance_rate": float("nan")},
        {"step": 3, "replay/buffer_groups": 4.0, "replay/accepted": 3.0, "replay/acceptance_rate": 0.5},
    ]
    records = [r | {k: 0.0 for k in common.REPLAY_KEYS if k not in r} for r in records]
    summary = common.replay_summary(records)
    assert summary["replay/accepted"] == 2.0  # (1 + 3) / 2: the empty-buffer stage is left out
    assert summary["replay/acceptance_rate"] == 0.5  # the NaN of a stage that scored nothing is left out
    assert set(summary) == set(common.REPLAY_KEYS)
    assert all(math.isnan(v) for v in common.replay_summary([]).values())  # a run without replay


def test_run_methods_runs_seed_by_seed_with_the_seed_overrides_last_and_keeps_every_summary(
    tmp_path: Path, capsys
) -> None:
    calls = []

    def train(config, run_dir, overrides):
        calls.append((config.name, run_dir.name, list(overrides)))
        return [{"step": 4, "acc": 0.5 + len(calls) / 100}]

    results = common.run_methods(
        tmp_path,
        ["grpo", "hdr"],
        seeds=2,
        plan=lambda name, seed: (Path(f"{name}.yaml"), [f"m={name}"]),
        summarize=lambda config, overrides, records: {"acc": records[-1]["acc"], "last": overrides[-1]},
        describe=lambda result: f"acc {result['acc']:.2f}",
        train=train,
    )
    assert [c[1] for c in calls] == ["grpo_seed0", "hdr_seed0", "grpo_seed1", "hdr_seed1"]
    assert calls[2] == ("grpo.yaml", "grpo_seed1", ["m=grpo", "seed=1", "stages.seed=1"])
    assert results == {
        "grpo": [{"acc": 0.51, "last": "stages.seed=0"}, {"acc": 0.53, "last": "stages.seed=1"}],
        "hdr": [{"acc": 0.52, "last": "stages.seed=0"}, {"acc": 0.54, "last": "stages.seed=1"}],
    }
    assert json.loads((tmp_path / "results.json").read_text()) == results
    assert capsys.readouterr().out.splitlines() == [
        "grpo seed 0: acc 0.51",
        "hdr seed 0: acc 0.52",
        "grpo seed 1: acc 0.53",
        "hdr seed 1: acc 0.54",
    ]


@pytest.mark.parametrize(
    ("argv", "message"),
    [(["--seeds", "0"], "--seeds must be >= 1"), (["--methods", "grpo,nope"], "--methods: ['nope'] unknown")],
)
def test_methods_to_run_refuses_bad_seeds_and_unknown_methods_with_exit_2(tmp_path: Path, capsys, argv, message):
    parser = common.method_parser("doc", tmp_path, ["grpo", "hdr"])
    with pytest.raises(SystemExit) as exit_:
        common.methods_to_run(parser, parser.parse_args(argv), ["grpo", "hdr"])
    assert exit_.value.code == 2 and message in capsys.readouterr().err
    args = parser.parse_args(["--methods", "hdr,grpo", "x=1"])
    assert common.methods_to_run(parser, args, ["grpo", "hdr"]) == ["hdr", "grpo"] and args.overrides == ["x=1"]


_SIGTERMED_BENCHMARK = """
import importlib.util, subprocess, sys
from pathlib import Path

spec = importlib.util.spec_from_file_location("benchmarks_common", sys.argv[1])
common = importlib.util.module_from_spec(spec)
spec.loader.exec_module(common)
pid_file = Path(sys.argv[2])
child = "import os, sys, time; open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(120)"

def train(config, run_dir, overrides):
    subprocess.run([sys.executable, "-c", child, str(pid_file)], check=True)
    return []

common.run_methods(pid_file.parent, ["grpo"], seeds=1, plan=lambda name, seed: (Path("c.yaml"), []),
                   summarize=lambda *a: {}, describe=str, train=train)
"""


def test_a_sigterm_to_the_benchmark_kills_and_reaps_its_running_child_before_it_exits(tmp_path: Path) -> None:
    # A child left running would finish its graceful preemption after a restarted benchmark emptied --out.
    pid_file = tmp_path / "child.pid"
    script = tmp_path / "bench.py"
    script.write_text(_SIGTERMED_BENCHMARK)
    bench = subprocess.Popen([sys.executable, str(script), str(Path(common.__file__)), str(pid_file)])
    child = None
    try:
        deadline = time.monotonic() + 120
        while not (pid_file.exists() and pid_file.read_text()) and bench.poll() is None:
            assert time.monotonic() < deadline, "the benchmark's child never started"
            time.sleep(0.05)
        child = int(pid_file.read_text())
        bench.send_signal(signal.SIGTERM)  # to the benchmark only, as `kill PID` sends it
        assert bench.wait(timeout=120) == 143
        with pytest.raises(ProcessLookupError):  # killed and waited for: not even a zombie is left
            os.kill(child, 0)
    finally:
        bench.kill()
        if child is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
