"""FP8 recipe handling: a clear ConfigError, never a silent bf16 fallback, where FP8 cannot run."""

from __future__ import annotations

import contextlib

import pytest
import torch

from megatron_mugrpo import errors
from megatron_mugrpo.kernels import fp8
from megatron_mugrpo.kernels.config import KernelConfig

FP8_ONLY = tuple(r for r in fp8.FP8_RECIPES if r != "none")


def test_the_config_validates_against_the_kernels_recipes() -> None:
    for recipe in fp8.FP8_RECIPES:
        assert KernelConfig(fp8=recipe).fp8 == recipe
    with pytest.raises(errors.ConfigError, match=r"kernels\.fp8='fp4' is not one of"):
        KernelConfig(fp8="fp4")
    assert fp8.ConfigError is errors.ConfigError


def test_none_is_a_no_op() -> None:
    fp8.check_fp8_available("none")
    assert isinstance(fp8.fp8_context("none"), contextlib.nullcontext)
    assert fp8.megatron_fp8_kwargs("none") == {}


def test_unknown_recipe_is_rejected() -> None:
    with pytest.raises(errors.ConfigError, match="not one of"):
        fp8.check_fp8_available("e4m3")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
@pytest.mark.parametrize("recipe", FP8_ONLY)
def test_fp8_without_a_gpu_is_a_config_error(recipe: str) -> None:
    for ask in (fp8.check_fp8_available, fp8.fp8_context, fp8.megatron_fp8_kwargs):
        with pytest.raises(errors.ConfigError, match=r"needs a CUDA GPU.*kernels\.fp8=none"):
            ask(recipe)


def _fake_gpu(monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int]) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "FakeGPU")


@pytest.mark.parametrize(("recipe", "capability"), [("delayed", (8, 0)), ("current", (8, 6)), ("mxfp8", (9, 0))])
def test_too_old_gpu_is_a_config_error(monkeypatch: pytest.MonkeyPatch, recipe: str, capability: tuple) -> None:
    _fake_gpu(monkeypatch, capability)
    with pytest.raises(errors.ConfigError, match="compute capability"):
        fp8.check_fp8_available(recipe)


def test_missing_transformer_engine_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_gpu(monkeypatch, (9, 0))
    real_import = fp8.importlib.import_module

    def no_te(name: str, *args: object) -> object:
        if name.startswith("transformer_engine"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args)

    monkeypatch.setattr(fp8.importlib, "import_module", no_te)
    with pytest.raises(errors.ConfigError, match="Transformer Engine"):
        fp8.fp8_context("delayed")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA and Transformer Engine")
def test_fp8_context_on_a_supporting_gpu() -> None:
    pytest.importorskip("transformer_engine.pytorch")
    if torch.cuda.get_device_capability() < fp8.MIN_COMPUTE_CAPABILITY["delayed"]:
        pytest.skip("GPU without FP8 tensor cores")
    with fp8.fp8_context("delayed"):
        pass
    assert fp8.megatron_fp8_kwargs("current") == {"fp8": "hybrid", "fp8_recipe": "tensorwise"}
