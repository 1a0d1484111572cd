"""Session-wide test setup.

Without CUDA the Triton kernels are tested under Triton's interpreter, which must be switched on
before ``triton`` is first imported: triton decorates its own ``tl`` library functions at import
time, and megatron-core imports triton, so any test module importing Megatron first would leave
them compiled-mode and break the interpreted kernels. Setting it here, before any test module is
collected, makes the order of test files irrelevant. The CPU code paths never call Triton.
"""

import json
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# pytest-xdist workers (``make test`` runs two) split the cores: each worker's torch, and the
# processes its tests start, get cores / workers threads, since oversubscribed OpenMP threads spin.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    _THREADS = max(1, (os.cpu_count() or 1) // _WORKERS)
    torch.set_num_threads(_THREADS)
    os.environ["OMP_NUM_THREADS"] = str(_THREADS)


@pytest.fixture
def qa_overrides(tmp_path: Path) -> list[str]:
    """Overrides that turn a demo config into a one-question search run (qa data and reward, a one-document
    corpus served on loopback), for the config and async-environment tests."""
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"question": "Where was Ada born?", "answers": ["Veloria"]}) + "\n")
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps({"id": "0", "title": "Ada", "text": "Ada was born in Veloria."}) + "\n")
    return [
        f"data.train_path={data}",
        "data.format=qa",
        "reward.kind=qa",
        "eval.benchmarks=[]",
        "env.enabled=true",
        f"env.search.corpus={corpus}",
        "env.max_total_tokens=256",  # the demo's tiny model holds 256 positions
    ]
