"""``mugrpo convert --ep N``: converting a mixture-of-experts model with its experts spread over EP ranks.

One multi-rank test runs the whole chain through the CLI on a tiny Qwen3-MoE (3 layers, layer 1 dense,
4 experts top-2): HF -> Megatron at EP = 2 (each of the 2 ranks holds 2 experts of each sparse layer),
then, resharded on load, verify against transformers and Megatron -> HF bit for bit at TP = 2 × EP = 2
(4 ranks, each holding half of 2 experts; sequence-parallel, as megatron-core requires of MoE at TP > 1).
It is one test because every spawned rank pays several seconds of imports. The bad-input tests check
that a wrong --ep (or a --seq-len that TP does not divide) fails with one line, exit status 2, no
output and no rank spawned.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conversion_helpers import make_hf_dir
from megatron_mugrpo.conversion import convert, verify
from megatron_mugrpo.conversion.cli import EXIT_BAD_INPUT, EXIT_OK, main
from megatron_mugrpo.conversion.errors import ConversionError
from megatron_mugrpo.conversion.launch import check_world_size
from safetensors.torch import load_file

MOE = {"num_hidden_layers": 3, "mlp_only_layers": [1], "num_experts": 4, "num_experts_per_tok": 2}
LOGIT_ATOL = 1e-5


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_hf_dir(tmp_path_factory.mktemp("ep") / "qwen3_moe", "qwen3_moe", **MOE)


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_hf_dir(tmp_path_factory.mktemp("ep") / "qwen3", "qwen3")


def _convert(*argv: str) -> int:
    return main(["convert", *argv])


def _logit_diff(verify_line: str) -> float:
    return float(verify_line.split("max_abs_logit_diff=")[1].split()[0])


@pytest.mark.multiprocess
def test_ep2_round_trip_at_tp2_x_ep2_is_bitwise_and_verifies(
    moe_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt, back = tmp_path / "ckpt", tmp_path / "hf_back"
    assert _convert("hf-to-megatron", "--hf-dir", str(moe_dir), "--out", str(ckpt), "--ep", "2") == EXIT_OK
    assert "ep=2" in capsys.readouterr().out
    metadata = json.loads((ckpt / "step_00000000" / "metadata.json").read_text())
    assert metadata["world_size"] == 2, "written by two ranks, one per EP rank"

    tp_ep = ["--tp", "2", "--ep", "2"]
    argv = ["verify", "--hf-dir", str(moe_dir), "--ckpt", str(ckpt), *tp_ep, "--atol", str(LOGIT_ATOL)]
    assert _convert(*argv) == EXIT_OK
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert "tp=2" in line and "ep=2" in line and "ok=True" in line and _logit_diff(line) <= LOGIT_ATOL, line

    assert _convert("megatron-to-hf", "--ckpt", str(ckpt), "--out", str(back), *tp_ep) == EXIT_OK
    source, exported = load_file(str(moe_dir / "model.safetensors")), load_file(str(back / "model.safetensors"))
    assert set(exported) == set(source)
    for name, tensor in source.items():
        assert torch.equal(exported[name].view(torch.uint8), tensor.view(torch.uint8)), name
    assert json.loads((back / "config.json").read_text()) == json.loads((moe_dir / "config.json").read_text())


@pytest.fixture
def no_spawn(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bad input must be refused before any rank starts: spawning fails the test."""

    def _spawn(*args: object, **kwargs: object) -> None:
        raise AssertionError("ranks were spawned for bad input")

    monkeypatch.setattr(convert, "run_on_ranks", _spawn)
    monkeypatch.setattr(verify, "run_on_ranks", _spawn)


def _refused(argv: list[str], message: str, work: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """One ``error:`` line naming ``message``, exit status 2, and nothing written under ``work``."""
    assert _convert(*argv) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err
    assert list(work.iterdir()) == [], "no output and no temporary directory left behind"


@pytest.mark.parametrize("verb", ["hf-to-megatron", "megatron-to-hf", "verify"])
def test_ep_zero_is_refused(
    verb: str, moe_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], no_spawn: None
) -> None:
    paths = {
        "hf-to-megatron": ["--hf-dir", str(moe_dir), "--out", str(tmp_path / "o")],
        "megatron-to-hf": ["--ckpt", str(tmp_path / "ckpt"), "--out", str(tmp_path / "o")],
        "verify": ["--hf-dir", str(moe_dir), "--ckpt", str(tmp_path / "ckpt")],
    }[verb]
    _refused([verb, *paths, "--ep", "0"], "--ep 0: must be a positive integer", tmp_path, capsys)


def test_ep_not_dividing_the_experts_names_num_experts(
    moe_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], no_spawn: None
) -> None:
    argv = ["hf-to-megatron", "--hf-dir", str(moe_dir), "--out", str(tmp_path / "o"), "--ep", "3"]
    _refused(argv, "expert parallel size 3 must divide num_experts=4; choose --ep among its divisors", tmp_path, capsys)


def test_ep_on_a_dense_model_names_the_model_type(
    dense_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], no_spawn: None
) -> None:
    argv = ["hf-to-megatron", "--hf-dir", str(dense_dir), "--out", str(tmp_path / "o"), "--ep", "2"]
    _refused(argv, "model_type='qwen3' is dense", tmp_path, capsys)


def test_verify_at_tp_needs_a_sequence_length_tp_divides(
    moe_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], no_spawn: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A MoE model at TP > 1 is sequence-parallel: verify refuses a --seq-len TP does not split before spawning."""
    metadata = {"hf_config": json.loads((moe_dir / "config.json").read_text())}
    monkeypatch.setattr(verify, "resolve_step_dir", lambda ckpt: Path(ckpt))
    monkeypatch.setattr(verify, "read_metadata", lambda step_dir: metadata)
    argv = ["verify", "--hf-dir", str(moe_dir), "--ckpt", str(tmp_path / "ckpt"), "--tp", "2", "--ep", "2"]
    _refused([*argv, "--seq-len", "7"], "--seq-len 7: a mixture-of-experts model at --tp 2 runs", tmp_path, capsys)


def test_torchrun_world_must_hold_whole_tp_pp_ep_grids() -> None:
    check_world_size(8, tp=2, pp=2, ep=2)
    check_world_size(4, tp=1, pp=2, ep=2)
    with pytest.raises(ConversionError, match="multiple of tp × pp × ep = 4 ranks; this launch has 6"):
        check_world_size(6, tp=1, pp=2, ep=2)
