"""Session-wide test setup.

Without CUDA the Triton kernels are tested under Triton's interpreter, which must be switched on
before ``triton`` is first imported: triton decorates its own ``tl`` library functions at import
time, and megatron-core imports triton, so any test module importing Megatron first would leave
them compiled-mode and break the interpreted kernels. Setting it here, before any test module is
collected, makes the order of test files irrelevant. The CPU code paths never call Triton.
"""

import json
import os
from collections.abc import Callable
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


def _search_run_overrides(
    inputs: Path, base: Path, *, mini_groups: int, updates: int, mode: str = "staged", eval_questions: int = 0
) -> list[str]:
    """Overrides that make ``configs/demo_search_cpu.yaml`` a short multi-turn search run of ``updates``
    updates of ``mini_groups`` groups, one stage, on the task ``envs.fictional.write_task`` wrote to
    ``inputs`` and the base model in ``base``. ``mode="async"``: one trainer and one rollout worker whose
    batches of 2 groups are never dropped. ``eval_questions``: held-out questions evaluated as trajectories
    (``inputs/test.jsonl``, k = 1; 0: no evaluation). The turn and token limits fit the searching models of
    ``tests/envs/search_models.py`` (448 positions)."""
    overrides = [
        f"mode={mode}",
        f"model.hf_dir={base}",
        f"data.train_path={inputs / 'train.jsonl'}",
        f"env.search.corpus={inputs / 'corpus.jsonl'}",  # served on loopback by the process that rolls out
        "env.max_turns=2",
        "env.max_total_tokens=448",
        "env.max_observation_tokens=96",
        "rollout.max_prompt_tokens=320",
        "rollout.max_new_tokens=40",
        "rollout.group_size=4",
        "rollout.cpu_threads=1",
        "stages.num_stages=1",
        f"stages.train_groups={mini_groups * updates}",
        f"stages.mini_groups={mini_groups}",
        "parallel.micro_batch_size=8",
        "logging.progress_bars=false",
        "logging.tensorboard=false",
        "logging.report=false",
    ]
    if mode == "async":
        # max_lag above the run's updates: nothing is dropped, so queue positions are exact.
        overrides += ["async.batch_groups=2", "async.queue_groups=4", "async.sync_every=1", "async.max_lag=8"]
    if not eval_questions:
        return [*overrides, "eval.benchmarks=[]"]
    return [
        *overrides,
        f"eval.benchmarks.0.path={inputs / 'test.jsonl'}",
        f"eval.benchmarks.0.limit={eval_questions}",
        "eval.benchmarks.0.k=1",
        "eval.max_new_tokens=40",
    ]


@pytest.fixture
def search_run_overrides() -> Callable[..., list[str]]:
    """``search_run_overrides(inputs, base, *, mini_groups, updates, mode="staged", eval_questions=0)``: the
    overrides of the multi-turn search runs (the async, resume, MoE and vLLM ones), in one place."""
    return _search_run_overrides
