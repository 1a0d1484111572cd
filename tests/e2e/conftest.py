"""Session fixtures of the end-to-end tests: a warm-started base model and one finished small run.

Under pytest-xdist (``make test`` runs two workers) every worker would build its own session
fixtures; ``built_once`` makes the workers share one directory per fixture instead: the first worker
to take its lock builds it, the others wait and reuse it (``e2e_runs.built_once``).

Also makes ``e2e_runs`` (the CLI helpers) and ``tests/dist_utils.py`` importable whatever pytest's
import mode.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

for _path in (Path(__file__).resolve().parent, Path(__file__).resolve().parent.parent):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from e2e_runs import DEMO, EASY_TASK, built_once, train  # noqa: E402


@pytest.fixture(scope="session")
def base_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A warm-started tiny model (some problems solved, so advantages are non-zero)."""
    from megatron_mugrpo.config import load_config
    from megatron_mugrpo.warmstart import prepare_base_model

    cfg = load_config(DEMO, ["warmstart.steps=150"])
    # One thread: on a shared 2-core machine more only makes OpenMP spin (measured: 30 s vs > 15 min).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with built_once(tmp_path_factory, "base") as shared:
            return prepare_base_model(cfg, shared / "model")  # reused when its marker matches
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def easy_base_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A short warm start on the one-digit task: it already solves some problems, so groups have mixed
    outcomes (the two-digit ``base_model`` solves almost none), at a fraction of the demo's warm start."""
    from megatron_mugrpo.config import load_config
    from megatron_mugrpo.warmstart import prepare_base_model

    cfg = load_config(DEMO, ["warmstart.steps=80", f"data.builtin_task={EASY_TASK}"])
    with built_once(tmp_path_factory, "easy_base") as shared:
        return prepare_base_model(cfg, shared / "model")


@pytest.fixture(scope="session")
def uninterrupted(
    tmp_path_factory: pytest.TempPathFactory, base_model: Path
) -> tuple[Path, subprocess.CompletedProcess]:
    with built_once(tmp_path_factory, "uninterrupted") as shared:
        run_dir, done = shared / "full", shared / "process.json"
        if not done.is_file():
            shutil.rmtree(run_dir, ignore_errors=True)  # a worker's failed attempt
            proc = train(run_dir, base_model, "logging.report=true")
            done.write_text(json.dumps({"args": proc.args, "stdout": proc.stdout, "stderr": proc.stderr}))
        kept = json.loads(done.read_text())
        return run_dir, subprocess.CompletedProcess(kept["args"], 0, kept["stdout"], kept["stderr"])
