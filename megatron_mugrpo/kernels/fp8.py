"""FP8 recipe handling: transformer layers in FP8 (Transformer Engine), output layer and log-prob in bf16.

Only the transformer layers run under FP8; the output layer and the fused log-prob / loss take the
bf16 hidden states and the bf16 output weight with float32 accumulation, because the log-probs feed
an importance ratio exp(log π - log β) that FP8 rounding of the logits would bias.

Two ways to use it, both failing loudly (never silently falling back to bf16) when FP8 is asked for
on a machine without Transformer Engine or without a GPU that supports the recipe:

* ``megatron_fp8_kwargs(recipe)``: the ``fp8`` / ``fp8_recipe`` fields of Megatron's
  ``TransformerConfig``; Megatron's TE layers then enter ``fp8_autocast`` per layer themselves
  (the output layer is a plain column-parallel linear and stays in bf16).
* ``fp8_context(recipe)``: an explicit ``te.pytorch.fp8_autocast`` context for code that drives TE
  modules directly; ``nullcontext()`` for recipe ``'none'``.

Recipes: ``delayed`` (DelayedScaling, amax history), ``current`` (Float8CurrentScaling, per-tensor
current scaling), ``mxfp8`` (MXFP8BlockScaling, Blackwell). Transformer Engine cannot even be
imported without a CUDA driver, so it is imported lazily here.
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Any

import torch

from megatron_mugrpo.errors import ConfigError  # dependency-free: GPU check machines carry only torch + triton

FP8_RECIPES = ("none", "delayed", "current", "mxfp8")
"""kernels.fp8: FP8 recipes of the transformer layers ('none' trains in the model dtype)."""

MIN_COMPUTE_CAPABILITY = {"delayed": (8, 9), "current": (8, 9), "mxfp8": (10, 0)}
"""FP8 tensor cores: Ada / Hopper (sm_89, sm_90) for per-tensor scaling; MXFP8 needs Blackwell (sm_100)."""

_MEGATRON_RECIPE = {"delayed": "delayed", "current": "tensorwise", "mxfp8": "mxfp8"}
# MXFP8 scales 32-element blocks and uses E4M3 in both passes; per-tensor recipes use HYBRID
# (E4M3 forward, E5M2 gradients), TE's default.
_MEGATRON_FORMAT = {"delayed": "hybrid", "current": "hybrid", "mxfp8": "e4m3"}


def _fail(recipe: str, reason: str) -> ConfigError:
    return ConfigError(f"kernels.fp8={recipe!r} {reason}; set kernels.fp8=none to train in bf16")


def check_fp8_available(recipe: str) -> None:
    """Raise ConfigError unless ``recipe`` can run here ('none' always can).

    Checks, in order: the recipe name, a CUDA device, its compute capability, and that
    ``transformer_engine.pytorch`` imports.
    """
    if recipe not in FP8_RECIPES:
        raise ConfigError(f"kernels.fp8={recipe!r} is not one of {FP8_RECIPES}")
    if recipe == "none":
        return
    if not torch.cuda.is_available():
        raise _fail(recipe, "needs a CUDA GPU with FP8 tensor cores, and none is visible")
    capability = torch.cuda.get_device_capability()
    needed = MIN_COMPUTE_CAPABILITY[recipe]
    if capability < needed:
        name = torch.cuda.get_device_name()
        raise _fail(
            recipe,
            f"needs compute capability >= {needed[0]}.{needed[1]}, but {name} has {capability[0]}.{capability[1]}",
        )
    try:
        importlib.import_module("transformer_engine.pytorch")
    except Exception as exc:  # ImportError, or TE's own error when its CUDA libraries do not load
        raise _fail(
            recipe,
            f"needs Transformer Engine (pip install transformer-engine[pytorch]); importing it failed: {exc}",
        ) from exc


def build_te_recipe(recipe: str) -> Any:
    """The Transformer Engine recipe object for ``recipe`` (after check_fp8_available)."""
    check_fp8_available(recipe)
    if recipe == "none":
        raise ConfigError("build_te_recipe('none'): there is no FP8 recipe to build; use fp8_context('none')")
    te_recipe = importlib.import_module("transformer_engine.common.recipe")
    if recipe == "delayed":
        return te_recipe.DelayedScaling(
            fp8_format=te_recipe.Format.HYBRID, amax_history_len=1024, amax_compute_algo="max"
        )
    if recipe == "current":
        return te_recipe.Float8CurrentScaling(fp8_format=te_recipe.Format.HYBRID)
    return te_recipe.MXFP8BlockScaling(fp8_format=te_recipe.Format.E4M3)


def fp8_context(recipe: str) -> contextlib.AbstractContextManager:
    """``te.pytorch.fp8_autocast(enabled=True, fp8_recipe=...)`` for ``recipe``; nullcontext for 'none'.

    Wrap only the transformer layers with it, never the output layer or the log-prob.
    """
    check_fp8_available(recipe)
    if recipe == "none":
        return contextlib.nullcontext()
    te = importlib.import_module("transformer_engine.pytorch")
    te_recipe = build_te_recipe(recipe)
    if hasattr(te, "fp8_autocast"):
        return te.fp8_autocast(enabled=True, fp8_recipe=te_recipe)
    return te.autocast(enabled=True, recipe=te_recipe)  # TE >= 2.8 renamed the context


def megatron_fp8_kwargs(recipe: str) -> dict[str, Any]:
    """TransformerConfig fields for ``recipe`` ({} for 'none'); raises ConfigError if FP8 cannot run here.

    Megatron applies FP8 to its Transformer Engine layers only (build the model with the TE layer
    spec); ``output_layer`` is a tensor-parallel linear outside FP8, which is what the fused log-prob
    needs.
    """
    check_fp8_available(recipe)
    if recipe == "none":
        return {}
    return {"fp8": _MEGATRON_FORMAT[recipe], "fp8_recipe": _MEGATRON_RECIPE[recipe]}
