"""The checkpoint I/O's contract with megatron-core: public extension points only, private names checked.

- every hook of ``mcore_compat`` resolves against the installed megatron-core / torch, and a missing
  or changed one is a loud ``CompatError`` naming it (not a silent fallback);
- a save and a load through our strategies assign nothing into megatron-core's modules, write through
  the writer threads (their digests cover every ``.distcp`` file) and read through the direct path
  (checked while they run, from inside the writer's planning and the reader's reads);
- the background queue finalizes in order, only once the write has finished.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from dist_utils import run_distributed
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest

from megatron_mugrpo.training import mcore_compat
from megatron_mugrpo.training.checkpoint_async import ThreadAsyncCallsQueue, run_request
from megatron_mugrpo.training.checkpoint_reader import DirectFileSystemReader, DirectLoadStrategy
from megatron_mugrpo.training.checkpoint_writer import ThreadedFileWriter, ThreadedSaveStrategy
from megatron_mugrpo.training.model import unwrap_model
from megatron_mugrpo.training.optimizer import OptimConfig
from megatron_mugrpo.training.parallel import ParallelGroups, initialize_parallel
from megatron_mugrpo.training.setup import build_policy

from .common import hf_config

MEGATRON_CHECKPOINT_MODULES = (
    "megatron.core.dist_checkpointing.serialization",
    "megatron.core.dist_checkpointing.strategies.torch",
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.core.dist_checkpointing.strategies.async_utils",
    "torch.distributed.checkpoint.filesystem",
    "torch.distributed.checkpoint.state_dict_loader",
)


def test_every_compat_hook_resolves_against_the_installed_megatron_core():
    resolved = mcore_compat.check()
    assert set(resolved) == {hook.name for hook in mcore_compat.HOOKS}
    assert all(callable(value) for value in resolved.values())
    low, high = mcore_compat.TESTED_MCORE
    assert low <= mcore_compat.mcore_version() < high, "setup.py allows only the tested megatron-core range"
    info = mcore_compat.storage_info("__0_0.distcp", 5, 7)
    assert (info.relative_path, info.offset, info.length) == ("__0_0.distcp", 5, 7)


def test_a_missing_or_changed_hook_is_a_loud_error():
    gone = mcore_compat.Hook(
        "megatron.core.dist_checkpointing.strategies.torch", "_no_such_helper", ("x",), "a helper that moved"
    )
    with pytest.raises(mcore_compat.CompatError, match=r"strategies.torch._no_such_helper is missing.*supports"):
        mcore_compat._resolve(gone)
    changed = mcore_compat.Hook(
        "megatron.core.dist_checkpointing.strategies.torch", "_restore_dict_types", ("renamed",), "changed"
    )
    with pytest.raises(mcore_compat.CompatError, match=r"_restore_dict_types takes \(x, keys_template\)"):
        mcore_compat._resolve(changed)


def _module_namespaces() -> dict[str, dict[str, int]]:
    import importlib

    return {
        name: {k: id(v) for k, v in vars(importlib.import_module(name)).items()} for name in MEGATRON_CHECKPOINT_MODULES
    }


class _Watch:
    """What the instrumented writer and reader below saw while a save / load ran."""

    namespaces: ClassVar[list[dict[str, dict[str, int]]]] = []
    direct: ClassVar[int] = 0


class _WatchedWriter(ThreadedFileWriter):
    def prepare_write_data(self, plan, planner):  # runs inside the strategy's async_save (planning)
        _Watch.namespaces.append(_module_namespaces())
        super().prepare_write_data(plan, planner)


class _WatchedReader(DirectFileSystemReader):
    def _read_direct(self, stream, item, planner):  # runs inside the strategy's load
        _Watch.namespaces.append(_module_namespaces())
        target = super()._read_direct(stream, item, planner)
        _Watch.direct += target is not None
        return target


def _save_and_load_touch_nothing(rank: int, world_size: int, root: str) -> None:
    groups = initialize_parallel(1, 1, seed=0)
    policy = build_policy(hf_config(), groups=groups, dtype=torch.float32, optim=OptimConfig(lr=1e-3))
    model = unwrap_model(policy.model_chunks[0])
    before = _module_namespaces()

    strategy = ThreadedSaveStrategy(groups=groups, thread_count=2, fsync=False, snapshot=True)
    strategy.writer_class = _WatchedWriter
    request = dist_checkpointing.save(
        model.sharded_state_dict(prefix=""), root, sharded_strategy=strategy, async_sharded_save=True
    )
    with torch.no_grad():
        saved = {name: p.detach().clone() for name, p in model.named_parameters()}
    run_request(request, groups)
    written = {p.name for p in Path(root).glob("*.distcp")}
    assert written == {"__0_0.distcp", "__0_1.distcp"}
    assert {d.path for d in strategy.digests()} == written  # written (and hashed) by the writer threads

    with torch.no_grad():
        for param in model.parameters():
            param.zero_()
    reader = DirectLoadStrategy(groups=groups)
    reader.reader_class = _WatchedReader
    loaded = dist_checkpointing.load(model.sharded_state_dict(prefix=""), root, sharded_strategy=reader)
    model.load_state_dict(loaded, strict=True)
    assert all(torch.equal(p, saved[name]) for name, p in model.named_parameters())
    assert _Watch.direct >= len(saved), "whole stored tensors must be read by position, not fall back"
    assert _Watch.namespaces and all(seen == before for seen in _Watch.namespaces), (
        "the checkpoint I/O assigned into megatron-core or torch modules while it ran"
    )
    assert _module_namespaces() == before


def test_save_and_load_assign_nothing_into_megatron_core(tmp_path):
    (tmp_path / "model").mkdir()
    run_distributed(_save_and_load_touch_nothing, 1, str(tmp_path / "model"))


def test_the_queue_finalizes_in_order_once_the_write_has_finished():
    release = threading.Event()
    events: list[str] = []
    first = AsyncRequest(release.wait, (), [lambda: events.append("first")], preload_fn=lambda: events.append("snap"))
    second = AsyncRequest(None, (), [lambda: events.append("second")])
    queue = ThreadAsyncCallsQueue(ParallelGroups.local())
    ids = [queue.schedule_async_request(first), queue.schedule_async_request(second)]
    assert events == ["snap"]  # the snapshot is taken in the caller, at scheduling
    assert queue.maybe_finalize_async_calls() == [] and queue.get_num_unfinalized_calls() == 2
    release.set()
    assert queue.maybe_finalize_async_calls(blocking=True) == ids
    assert events == ["snap", "first", "second"]
