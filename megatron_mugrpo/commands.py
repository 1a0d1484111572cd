"""Command lines that start ``mugrpo`` in a subprocess: what sweeps, benchmarks and end-to-end tests run.

A module of its own, importing nothing from the package, so that ``sweep`` (which starts runs) and
``cli`` (which starts sweeps) do not import each other.

    subprocess.run(train_argv("configs/demo_cpu.yaml", "runs/demo", ["stages.num_stages=1"]), check=True)
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

CLI_MODULE = "megatron_mugrpo.cli"


def mugrpo_argv(*args: str) -> list[str]:
    """``mugrpo ARGS...`` as a command for this interpreter (the console script may not be on PATH in a
    subprocess's environment)."""
    return [sys.executable, "-m", CLI_MODULE, *args]


def train_argv(config: str | Path, run_dir: str | Path, overrides: Sequence[str] = ()) -> list[str]:
    """``mugrpo train --config CONFIG --run-dir RUN_DIR OVERRIDES...`` (see :func:`mugrpo_argv`)."""
    return mugrpo_argv("train", "--config", str(config), "--run-dir", str(run_dir), *overrides)
