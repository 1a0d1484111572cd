"""Shared by the end-to-end tests: one warm-started base model per session; ``tests/dist_utils.py``
importable as ``dist_utils`` whatever pytest's import mode and rootdir."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

_TESTS_DIR = str(Path(__file__).resolve().parent.parent)
if _TESTS_DIR not in sys.path:
    sys.path.insert(0, _TESTS_DIR)

DEMO = Path(__file__).resolve().parents[2] / "configs" / "demo_cpu.yaml"


@pytest.fixture(scope="session")
def base_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A warm-started tiny model (some problems solved, so advantages are non-zero)."""
    from megatron_mugrpo.config import load_config
    from megatron_mugrpo.warmstart import prepare_base_model

    cfg = load_config(DEMO, ["warmstart.steps=150"])
    return prepare_base_model(cfg, tmp_path_factory.mktemp("base") / "model")
