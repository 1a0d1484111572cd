"""No configuration key is silently ignored: every leaf of the schema is read by some component.

A key counts as read when the package's code (outside the section's own validation) accesses it as an
attribute, or when its whole section is handed to the component that owns it (a loss's options become
its keyword arguments, an engine's section becomes its constructor's keyword arguments) and the
component's signature takes it.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import typing
from pathlib import Path

from megatron_mugrpo.algorithms.losses import available_losses, loss_spec
from megatron_mugrpo.config import RunConfig
from megatron_mugrpo.rollout.engine import available_engines, engine_factory

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [p for d in ("megatron_mugrpo", "conversion") for p in (ROOT / d).rglob("*.py")]


def leaf_keys(cls: type = RunConfig, prefix: str = "") -> list[str]:
    """Every dotted leaf key of the schema (list-of-section fields such as eval.benchmarks count as leaves)."""
    hints = typing.get_type_hints(cls)
    keys = []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            keys += leaf_keys(hints[f.name], f"{prefix}{f.name}.")
        else:
            keys.append(prefix + f.name)
    return keys


def _code_outside_validation() -> str:
    """The package's source with ``self.<field>`` accesses removed (those are a section reading itself)."""
    return "\n".join(re.sub(r"\bself\.\w+", "", path.read_text()) for path in SOURCES)


def _consumed_wholesale() -> set[str]:
    """Keys read by handing the whole section to its owner, whose signature takes them."""
    keys = set()
    for name in available_losses():
        params = inspect.signature(loss_spec(name).fn).parameters
        keys |= {f"algo.{name}.{f.name}" for f in dataclasses.fields(loss_spec(name).options) if f.name in params}
    for name in available_engines():
        params = inspect.signature(engine_factory(name)).parameters
        section = typing.get_type_hints(RunConfig)["rollout"]
        cls = typing.get_type_hints(section)[name]
        keys |= {f"rollout.{name}.{f.name}" for f in dataclasses.fields(cls) if f.name in params}
    return keys


def test_every_config_key_is_read_somewhere() -> None:
    code = _code_outside_validation()
    wholesale = _consumed_wholesale()
    unread = [
        key
        for key in leaf_keys()
        if key not in wholesale and not re.search(rf"\.{re.escape(key.rsplit('.', 1)[-1])}\b", code)
    ]
    assert not unread, f"configuration keys that no component reads (remove them or wire them through): {unread}"


def test_every_engine_section_matches_its_constructor() -> None:
    section = typing.get_type_hints(typing.get_type_hints(RunConfig)["rollout"])
    for name in available_engines():
        params = inspect.signature(engine_factory(name)).parameters
        missing = [f.name for f in dataclasses.fields(section[name]) if f.name not in params]
        assert not missing, f"rollout.{name} keys {missing} are not parameters of the {name} engine"


def test_sequence_parallel_builds_on_cpu_with_norms_marked_for_the_tp_all_reduce() -> None:
    """parallel.sequence_parallel=true is accepted without CUDA (tests/training/test_moe_tp_ep.py runs it)."""
    from dist_utils import run_distributed

    run_distributed(_build_with_sequence_parallel, 2)


def _build_with_sequence_parallel(rank: int, world_size: int) -> None:
    import torch

    from megatron_mugrpo.training.model import tiny_hf_config
    from megatron_mugrpo.training.parallel import initialize_parallel
    from megatron_mugrpo.training.setup import build_policy

    groups = initialize_parallel(2, 1, seed=0)
    policy = build_policy(
        tiny_hf_config("qwen2"), groups=groups, dtype=torch.float32, optim=None, sequence_parallel=True
    )
    model = policy.unwrapped()[0]
    assert model.config.sequence_parallel
    norms = [p for name, p in model.named_parameters() if "layernorm" in name]
    assert norms and all(getattr(p, "sequence_parallel", False) for p in norms)
