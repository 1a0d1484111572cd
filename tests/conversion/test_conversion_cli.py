"""``convert`` CLI: bad input fails fast with one error line and no output; the full chain with
verify at TP=2 × PP=2 of a checkpoint converted at TP=1 × PP=1 (resharding on load)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conversion_helpers import make_hf_dir
from megatron_mugrpo.conversion.cli import EXIT_BAD_INPUT, EXIT_OK, EXIT_VERIFY_FAILED, main
from safetensors.torch import load_file


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_hf_dir(tmp_path_factory.mktemp("cli") / "qwen3", "qwen3", tied=True)


def _convert(*argv: str) -> int:
    return main(["convert", *argv])


def _bad_input(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert _convert(*argv) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err, err


def test_unknown_architecture(hf_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "model.safetensors").symlink_to(hf_dir / "model.safetensors")
    config = json.loads((hf_dir / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "model_type": "gpt_neox"}))
    _bad_input(["hf-to-megatron", "--hf-dir", str(bad), "--out", str(tmp_path / "o")], "gpt_neox", capsys)
    assert not (tmp_path / "o").exists()


def test_tp_not_dividing_query_groups(hf_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["hf-to-megatron", "--hf-dir", str(hf_dir), "--out", str(tmp_path / "o"), "--tp", "4"]
    _bad_input(argv, "tensor parallel size 4 must divide", capsys)
    assert not (tmp_path / "o").exists()


def test_non_empty_output(hf_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "x").write_text("")
    _bad_input(["hf-to-megatron", "--hf-dir", str(hf_dir), "--out", str(tmp_path / "o")], "not empty", capsys)


def test_missing_checkpoint(hf_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _bad_input(
        ["megatron-to-hf", "--ckpt", str(tmp_path / "none"), "--out", str(tmp_path / "o")], "does not exist", capsys
    )
    _bad_input(["verify", "--hf-dir", str(hf_dir), "--ckpt", str(tmp_path)], "neither a step directory", capsys)


def test_verify_exit_status_follows_the_tolerances(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import megatron_mugrpo.conversion.verify as verify

    reference = torch.randn(2, 5, 7)
    far = verify.compare_logits(reference, reference + 0.1, atol=1e-3, kl_tol=1e-5)
    near = verify.compare_logits(reference, reference + 1e-7, atol=1e-3, kl_tol=1e-5)
    assert not far.ok and near.ok and near.kl < 1e-10
    for result, status in ((far, EXIT_VERIFY_FAILED), (near, EXIT_OK)):
        monkeypatch.setattr(verify, "verify", lambda *args, result=result, **kwargs: result)
        assert _convert("verify", "--hf-dir", str(tmp_path), "--ckpt", str(tmp_path)) == status


@pytest.mark.multiprocess
def test_convert_verify_and_export_at_tp2_pp2(hf_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt, back = tmp_path / "ckpt", tmp_path / "hf_back"
    (hf_dir / "tokenizer_config.json").write_text("{}")
    assert _convert("hf-to-megatron", "--hf-dir", str(hf_dir), "--out", str(ckpt)) == EXIT_OK
    assert (ckpt / "latest").read_text().strip() == "step_00000000"

    assert _convert("verify", "--hf-dir", str(hf_dir), "--ckpt", str(ckpt), "--tp", "2", "--pp", "2") == EXIT_OK
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert "ok=True" in line and "max_abs_logit_diff=" in line, line
    diff = float(line.split("max_abs_logit_diff=")[1].split()[0])
    assert diff <= 1e-5, line

    assert _convert("megatron-to-hf", "--ckpt", str(ckpt), "--out", str(back)) == EXIT_OK
    original, exported = load_file(str(hf_dir / "model.safetensors")), load_file(str(back / "model.safetensors"))
    assert set(original) == set(exported)
    assert all(torch.equal(original[n].view(torch.uint8), exported[n].view(torch.uint8)) for n in original)
    assert json.loads((back / "config.json").read_text()) == json.loads((hf_dir / "config.json").read_text())
    assert (back / "tokenizer_config.json").is_file()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["hf-to-megatron", "--tp", "0"], "--tp 0: must be a positive integer"),
        (["hf-to-megatron", "--tp", "-2"], "--tp -2: must be a positive integer"),
        (["hf-to-megatron", "--pp", "0"], "--pp 0: must be a positive integer"),
        (["megatron-to-hf", "--tp", "0"], "--tp 0: must be a positive integer"),
        (["megatron-to-hf", "--tokenizer-dir", "/nonexistent/tok"], "is not a directory"),
        (["verify", "--batch", "0"], "--batch 0: must be a positive integer"),
        (["verify", "--seq-len", "-1"], "--seq-len -1: must be a positive integer"),
        (["verify", "--atol", "-1"], "--atol -1.0: must be >= 0"),
    ],
)
def test_bad_argument_values_write_nothing(
    argv: list[str], message: str, hf_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: --tp 0 raised ZeroDivisionError; --tp -2 left OUT/tokenizer/ behind."""
    (hf_dir / "tokenizer_config.json").write_text("{}")
    out = tmp_path / "o"
    paths = {
        "hf-to-megatron": ["--hf-dir", str(hf_dir), "--out", str(out)],
        "megatron-to-hf": ["--ckpt", str(tmp_path), "--out", str(out)],
        "verify": ["--hf-dir", str(hf_dir), "--ckpt", str(tmp_path)],
    }[argv[0]]
    _bad_input([argv[0], *paths, *argv[1:]], message, capsys)
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir()] == [], "no temporary directory left behind either"
