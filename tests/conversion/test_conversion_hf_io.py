"""Reading and writing Hugging Face directories: sharded index, validation errors, atomic output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conversion_helpers import make_hf_dir
from megatron_mugrpo.conversion.errors import ConversionError
from megatron_mugrpo.conversion.hf_io import SAFE_INDEX, HfCheckpoint, save_hf_dir
from safetensors.torch import load_file, save_file


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_hf_dir(tmp_path_factory.mktemp("hf") / "qwen2", "qwen2")


def _rewrite(src: Path, dst: Path, edit) -> Path:
    """Copy ``src`` to ``dst`` with its tensors dict passed through ``edit``."""
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    save_file(edit(load_file(str(src / "model.safetensors"))), str(dst / "model.safetensors"))
    return dst


def test_sharded_save_round_trips_through_the_index(hf_dir: Path, tmp_path: Path) -> None:
    (hf_dir / "tokenizer_config.json").write_text("{}")
    tensors = load_file(str(hf_dir / "model.safetensors"))
    config = json.loads((hf_dir / "config.json").read_text())
    out = save_hf_dir(iter(tensors.items()), tmp_path / "out", config, tokenizer_dir=hf_dir, shard_bytes=40_000)
    index = json.loads((out / SAFE_INDEX).read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert (out / "tokenizer_config.json").is_file()
    reread = HfCheckpoint(out)
    reread.validate()
    assert reread.names() == set(tensors)
    assert all(torch.equal(reread.tensor(name), tensor) for name, tensor in tensors.items())


def test_failed_save_leaves_no_output(hf_dir: Path, tmp_path: Path) -> None:
    def broken_stream():
        yield "model.norm.weight", torch.ones(4)
        raise RuntimeError("engine died mid-export")

    with pytest.raises(RuntimeError, match="mid-export"):
        save_hf_dir(broken_stream(), tmp_path / "out", {}, shard_bytes=1)
    assert list(tmp_path.iterdir()) == []


def test_existing_non_empty_output_is_refused(tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("user data")
    with pytest.raises(ConversionError, match="already exists and is not empty"):
        save_hf_dir(iter([("x", torch.ones(1))]), tmp_path / "out", {})
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["keep.txt"]


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda t: {k: v for k, v in t.items() if k != "model.layers.1.mlp.up_proj.weight"}, "missing"),
        (lambda t: {**t, "model.layers.9.mlp.up_proj.weight": torch.zeros(1)}, "unexpected"),
        (lambda t: {**t, "model.norm.weight": torch.zeros(3)}, "has shape \\(3,\\)"),
    ],
    ids=["missing", "extra", "shape"],
)
def test_validate_names_the_bad_tensor(hf_dir: Path, tmp_path: Path, edit, message: str) -> None:
    with pytest.raises(ConversionError, match=message):
        HfCheckpoint(_rewrite(hf_dir, tmp_path / "bad", edit)).validate()


def test_tied_checkpoint_may_carry_a_redundant_lm_head(tmp_path: Path) -> None:
    tied = make_hf_dir(tmp_path / "tied", "llama", tied=True)
    with_head = _rewrite(
        tied, tmp_path / "with_head", lambda t: {**t, "lm_head.weight": t["model.embed_tokens.weight"].clone()}
    )
    HfCheckpoint(with_head).validate()


def test_directory_without_weights_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    with pytest.raises(ConversionError, match=r"neither model\.safetensors"):
        HfCheckpoint(tmp_path)
    with pytest.raises(ConversionError, match=r"config\.json does not exist"):
        HfCheckpoint(tmp_path / "nowhere")


def test_streamed_shards_have_a_padded_header_and_load_everywhere(hf_dir: Path, tmp_path: Path) -> None:
    """The header is written last into reserved space (padded with spaces); safetensors and transformers read it."""
    from transformers import AutoModelForCausalLM

    tensors = load_file(str(hf_dir / "model.safetensors"))
    config = json.loads((hf_dir / "config.json").read_text())
    out = save_hf_dir(iter(tensors.items()), tmp_path / "out", config)
    raw = (out / "model.safetensors").read_bytes()
    header_len = int.from_bytes(raw[:8], "little")
    assert header_len % 8 == 0 and raw[8 : 8 + header_len].endswith(b" ")
    assert load_file(str(out / "model.safetensors")).keys() == tensors.keys()
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    for name, value in model.state_dict().items():
        if name in tensors:
            assert torch.equal(value, tensors[name]), name


def test_a_header_larger_than_reserved_moves_the_data_once(tmp_path: Path) -> None:
    from megatron_mugrpo.conversion.hf_io import _write_shards

    tensors = {f"a.very.long.tensor.name.{i}": torch.arange(i + 1, dtype=torch.bfloat16) for i in range(40)}
    (tmp_path / "out").mkdir()
    weight_map = _write_shards(iter(tensors.items()), tmp_path / "out", 1 << 30, header_bytes=16, fsync=True)
    assert set(weight_map.values()) == {"model.safetensors"}
    reread = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert all(torch.equal(reread[name], value) for name, value in tensors.items())


def test_mapped_tensors_view_the_file_and_equal_the_stored_ones(hf_dir: Path) -> None:
    ckpt = HfCheckpoint(hf_dir)
    for name in sorted(ckpt.names()):
        mapped = ckpt.mapped(name)
        assert mapped.dtype == ckpt.tensor(name).dtype and torch.equal(mapped, ckpt.tensor(name)), name
