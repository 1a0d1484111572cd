"""The engine watchdog's life cycle with the SGLang engine, against the stand-in ``sglang`` of each
checked-in snapshot (``sglang_standin``): a server that died, or whose client call never returns, is
shut down, a new ``sglang.Engine`` is started with the same server arguments, the stage's weights are
pushed again from the host's copy (inside a weight-update session where SGLang has one), and the call
is made again. In deterministic mode the answer equals an uninterrupted engine's. A test of our calls,
not of SGLang on a GPU."""

from __future__ import annotations

import json
import sys
import threading

import pytest
import torch
from sglang_standin import build_module, load_snapshot, snapshot_versions

from megatron_mugrpo.rollout import sglang_engine
from megatron_mugrpo.rollout.engine import SamplingParams
from megatron_mugrpo.rollout.sglang_engine import SGLangEngine
from megatron_mugrpo.rollout.watchdog import EngineFailedError, HostWeights, WatchedEngine

PARAMS = SamplingParams(max_new_tokens=6, temperature=0.8, seed=3)
PROMPTS = [[3, 4, 5], [6, 7], [8, 9, 10, 11]]


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(params=snapshot_versions())
def sglang(request, monkeypatch):
    module = build_module(load_snapshot(request.param))
    monkeypatch.setitem(sys.modules, "sglang", module)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv(sglang_engine.ORIGINAL_LOGPROB_ENV, raising=False)
    return module


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 32, "eos_token_id": 1}))
    return tmp_path


def stage_tensors() -> list[tuple[str, torch.Tensor]]:
    return [(f"model.layers.{i}.mlp.weight", torch.full((16, 16), float(i))) for i in range(3)]


def synced(model_dir) -> SGLangEngine:
    """An engine as a weight sync leaves it: started, then given the stage's tensors."""
    return SGLangEngine(model_dir, deterministic=True, seed=11, mem_fraction_static=0.5)


def watched(model_dir, clock: FakeClock | None = None, **settings) -> WatchedEngine:
    kept = HostWeights()
    engine = synced(model_dir)
    engine.load_weights(kept.tee(stage_tensors()))

    def rebuild() -> SGLangEngine:
        new = synced(model_dir)
        new.load_weights(kept)
        return new

    return WatchedEngine(
        engine,
        rebuild=rebuild,
        label="rollout engine 0 (rank 0 on test)",
        clock=clock or FakeClock(),
        **({"progress_timeout_s": 60.0, "max_restarts": 2} | settings),
    )


def reference(model_dir) -> list:
    engine = synced(model_dir)
    engine.load_weights(stage_tensors())
    return engine.generate(PROMPTS, 2, PARAMS)


def weight_pushes(sglang, engine: int) -> list[str]:
    """The weight calls engine ``engine`` received, in order."""
    pushes = ("begin_weight_update", "update_weights_from_tensor", "end_weight_update")
    return [name for name in sglang.recorder.names(engine) if name in pushes]


def test_a_dead_server_is_shut_down_restarted_and_given_the_weights_again(sglang, model_dir):
    engine = watched(model_dir)
    sglang.recorder.engines[0].dead = True  # the scheduler died: every call but shutdown now raises
    result = engine.generate(PROMPTS, 2, PARAMS)
    assert engine.restarts == 1 and engine.failures[0].kind == "died"
    assert "RuntimeError: generate on an engine that was shut down" in engine.failures[0].detail
    assert sglang.recorder.names(0)[-1] == "shutdown"
    assert sglang.recorder.engines[1].server_args == sglang.recorder.engines[0].server_args
    assert weight_pushes(sglang, 1) == weight_pushes(sglang, 0)  # the same push, session included
    assert sglang.recorder.names(1)[-1] == "generate"
    assert result == reference(model_dir)  # deterministic mode: the same rows as an uninterrupted engine


def test_a_client_call_that_never_returns_is_abandoned_and_the_shutdown_frees_it(sglang, model_dir):
    """A generate that blocks until its engine is shut down, then raises (as a client whose server
    processes were killed may): the watchdog shuts it down, and the late error is ignored."""
    clock, unblocked = FakeClock(), threading.Event()
    engine = watched(model_dir, clock, progress_timeout_s=1.0)  # judged on the fake clock: looks every 0.1 s
    first = sglang.recorder.engines[0]
    shutdown = first.shutdown

    def blocked_generate(*args, **kwargs):
        clock.now += 1e6  # a long time without a finished row
        unblocked.wait(60)
        raise RuntimeError("connection to the scheduler lost")

    def shutdown_and_unblock():
        shutdown()
        unblocked.set()

    first.generate, first.shutdown = blocked_generate, shutdown_and_unblock
    result = engine.generate(PROMPTS, 2, PARAMS)
    assert engine.failures[0].kind == "hung" and unblocked.is_set()
    assert weight_pushes(sglang, 1) == weight_pushes(sglang, 0)
    for thread in engine.abandoned:
        thread.join(60)
    assert result == reference(model_dir)


def test_a_server_that_keeps_dying_stops_the_run_naming_it(sglang, model_dir, monkeypatch):
    engine = watched(model_dir, max_restarts=1)
    sglang.recorder.engines[0].dead = True
    original = SGLangEngine.load_weights

    def load_then_die(self, named):
        original(self, named)
        sglang.recorder.engines[-1].dead = True  # every rebuilt server dies as well

    monkeypatch.setattr(SGLangEngine, "load_weights", load_then_die)
    with pytest.raises(EngineFailedError, match=r"rollout engine 0 \(rank 0 on test\) died: RuntimeError"):
        engine.generate(PROMPTS, 2, PARAMS)
    assert len(sglang.recorder.engines) == 2 and sglang.recorder.names(1)[-1] != "generate"
