"""Shared by the end-to-end tests: one warm-started base model per session."""

from __future__ import annotations

from pathlib import Path

import pytest

DEMO = Path(__file__).resolve().parents[2] / "configs" / "demo_cpu.yaml"


@pytest.fixture(scope="session")
def base_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A warm-started tiny model (some problems solved, so advantages are non-zero)."""
    from megatron_mugrpo.config import load_config
    from megatron_mugrpo.warmstart import prepare_base_model

    cfg = load_config(DEMO, ["warmstart.steps=150"])
    return prepare_base_model(cfg, tmp_path_factory.mktemp("base") / "model")
