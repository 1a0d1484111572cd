"""The engine watchdog (rollout/watchdog.py) with scripted engines: a call that raises or makes no
progress is given up, the engine shut down and rebuilt and the call made again; past
rollout.max_restarts the run stops with an error naming the engine, where it was and the last error.

No test here waits on a wall-clock deadline for a verdict: hangs are judged on a clock the test
moves (``FakeClock``), and blocked calls are released at the end of each test."""

from __future__ import annotations

import threading

import pytest
import torch

from megatron_mugrpo.errors import ConfigError
from megatron_mugrpo.rollout.config import RolloutConfig
from megatron_mugrpo.rollout.engine import EngineOutputError, Generation, RolloutEngine, SamplingParams
from megatron_mugrpo.rollout.watchdog import EngineFailedError, HostWeights, WatchedEngine, engine_label

PARAMS = SamplingParams(max_new_tokens=4, seed=7)
PROMPTS = [[1, 2], [3]]


class FakeClock:
    """Seconds that move only when a test (or a scripted engine) says so."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Scripted:
    """An engine whose generate does what its script says: 'ok', 'raise', 'bad_output' or 'hang'.

    'hang' blocks until ``unblock`` is set and moves the fake clock past any timeout while it blocks,
    as time passing without progress. Every engine of a test shares the log of what happened."""

    name = "scripted"
    vocab_size = 16

    def __init__(self, index: int, behaviour: str, log: list[str], clock: FakeClock, unblock: threading.Event):
        self.index, self.behaviour, self.log, self.clock, self.unblock = index, behaviour, log, clock, unblock

    def generate(self, prompts, n, params, progress=None):
        self.log.append(f"generate {self.index}")
        if progress is not None:
            progress(1)  # one row finished before things go wrong
        if self.behaviour == "raise":
            raise RuntimeError(f"CUDA error: an illegal memory access (engine {self.index})")
        if self.behaviour == "bad_output":
            raise EngineOutputError("scripted engine, prompt 0 response 0: log-probs are not finite")
        if self.behaviour == "hang":
            self.clock.now += 1e6  # a long time without a finished row
            self.unblock.wait()
            return [[Generation([9], [-0.5], "stop")]]  # an abandoned call's answer: must be ignored
        if progress is not None:
            progress(len(prompts) - 1)
        return [[Generation([params.seed % 16], [-1.0], "stop")] for _ in prompts]

    def load_hf_dir(self, path: str) -> None:
        self.log.append(f"load_hf_dir {self.index}")

    def load_weights(self, named_tensors) -> None:
        self.log.append(f"load_weights {self.index}")

    def release(self) -> None:
        self.log.append(f"release {self.index}")

    def shutdown(self) -> None:
        self.log.append(f"shutdown {self.index}")


@pytest.fixture
def world():
    """(make, log, clock): ``make(behaviours, **kw)`` is a WatchedEngine whose k-th engine (0: the
    first, then each rebuild) behaves as ``behaviours[k]``."""
    log: list[str] = []
    clock, unblock = FakeClock(), threading.Event()

    def make(behaviours: list[str], **kwargs) -> WatchedEngine:
        engines = iter(Scripted(i, b, log, clock, unblock) for i, b in enumerate(behaviours))
        # A short timeout only makes the watcher look often: every verdict is on the fake clock.
        settings = {"progress_timeout_s": 1.0, "max_restarts": 2, "label": "rollout engine 0 (rank 0 on test)"}
        settings |= {"where": lambda: "in stage 3's rollout phase", "clock": clock} | kwargs
        return WatchedEngine(next(engines), rebuild=lambda: next(engines), **settings)

    yield make, log, clock
    unblock.set()  # no scripted call stays blocked after its test


def test_an_engine_that_raises_is_rebuilt_and_the_call_made_again(world):
    make, log, _ = world
    engine, rows = make(["raise", "ok"]), []
    result = engine.generate(PROMPTS, 1, PARAMS, rows.append)
    assert [[g.response_ids for g in group] for group in result] == [[[7]], [[7]]]
    assert log == ["generate 0", "shutdown 0", "generate 1"]
    assert engine.restarts == 1 and [f.kind for f in engine.failures] == ["died"]
    assert "illegal memory access" in engine.failures[0].detail
    assert sum(rows) == len(PROMPTS)  # the failed call's row was taken back: the bar counts each row once
    assert engine.engine.index == 1  # the new engine is the one the run keeps


def test_an_engine_without_progress_is_abandoned_and_its_late_answer_ignored(world):
    make, log, _ = world
    engine, rows = make(["hang", "ok"]), []
    result = engine.generate(PROMPTS, 1, PARAMS, rows.append)
    assert [[g.response_ids for g in group] for group in result] == [[[7]], [[7]]]  # not the hung call's [9]
    assert log == ["generate 0", "shutdown 0", "generate 1"]
    assert engine.failures[0].kind == "hung"
    assert "rollout.progress_timeout_s=1)" in engine.failures[0].detail
    assert sum(rows) == len(PROMPTS)


def test_progress_resets_the_clock(world):
    """An engine slower than the timeout in total, but finishing a row within every timeout, is kept."""
    _, log, clock = world

    class Slow(Scripted):
        def generate(self, prompts, n, params, progress=None):
            for _ in range(5):
                clock.now += 20.0  # 100 s in all, never 30 s without a row
                progress(1)
            return [[Generation([1], [-1.0], "stop")] for _ in prompts]

    engine = WatchedEngine(
        Slow(0, "ok", log, clock, threading.Event()),
        rebuild=lambda: pytest.fail("a slow engine that makes progress must not be rebuilt"),
        progress_timeout_s=30.0,
        max_restarts=2,
        label="e",
        clock=clock,
    )
    assert len(engine.generate(PROMPTS, 1, PARAMS)) == 2 and engine.restarts == 0


def test_past_max_restarts_the_error_names_engine_stage_and_last_error(world):
    make, log, _ = world
    engine = make(["raise", "hang", "raise", "ok"], max_restarts=2)
    with pytest.raises(EngineFailedError) as caught:
        engine.generate(PROMPTS, 1, PARAMS)
    message = str(caught.value)
    assert message.startswith("rollout engine 0 (rank 0 on test) died in stage 3's rollout phase: RuntimeError: CUDA")
    assert "(engine 2)" in message and "restarted 2 time(s), rollout.max_restarts=2" in message
    assert [f.kind for f in engine.failures] == ["died", "hung", "died"]
    assert "generate 3" not in log


def test_max_restarts_zero_stops_at_the_first_failure(world):
    make, log, _ = world
    with pytest.raises(EngineFailedError, match="restarted 0 time"):
        make(["raise", "ok"], max_restarts=0).generate(PROMPTS, 1, PARAMS)
    assert log == ["generate 0"]


def test_errors_a_new_engine_would_repeat_are_not_restarts(world):
    """Bad engine output (an InputError) is reported as it is: rebuilding would sample it again."""
    make, log, _ = world
    with pytest.raises(EngineOutputError, match="not finite"):
        make(["bad_output", "ok"]).generate(PROMPTS, 1, PARAMS)
    assert log == ["generate 0"]


def test_a_failed_rebuild_stops_the_run_with_both_errors(world):
    _, log, clock = world

    def rebuild():
        raise MemoryError("CUDA out of memory: the hung call still holds the old weights")

    engine = WatchedEngine(
        Scripted(0, "raise", log, clock, threading.Event()),
        rebuild=rebuild,
        progress_timeout_s=60.0,
        max_restarts=1,
        label="rollout engine 0",
        clock=clock,
    )
    with pytest.raises(EngineFailedError, match=r"died: RuntimeError.*Rebuilding it failed: MemoryError: CUDA out of"):
        engine.generate(PROMPTS, 1, PARAMS)


def test_a_shutdown_that_blocks_does_not_block_the_restart(world):
    make, _, _ = world
    stuck = threading.Event()
    engine = make(["raise", "ok"], progress_timeout_s=0.2)
    engine.engine.shutdown = lambda: stuck.wait()  # a dead server's shutdown that never returns
    try:
        assert engine.generate(PROMPTS, 1, PARAMS)[0][0].response_ids == [7]
    finally:
        stuck.set()
    assert engine.restarts == 1


def test_the_watched_engine_is_the_engine_for_everything_else(world):
    make, log, _ = world
    engine = make(["raise", "ok"])
    assert isinstance(engine, RolloutEngine)
    assert engine.vocab_size == 16 and engine.name == "scripted"
    assert engine.release_frees_memory  # the protocol's default for engines that do not say
    engine.generate(PROMPTS, 1, PARAMS)  # engine 0 dies: engine 1 is the engine from now on
    engine.load_weights([])
    engine.load_hf_dir("next")
    engine.release()
    engine.shutdown()
    assert log[-4:] == ["load_weights 1", "load_hf_dir 1", "release 1", "shutdown 1"]


def test_host_weights_keep_a_copy_that_later_writes_do_not_change():
    weights, source = HostWeights(), torch.arange(4.0)
    passed = list(weights.tee([("w", source)]))
    source.add_(100.0)  # the trainer's buffer, reused after the sync
    assert passed[0][1] is source  # the engine gets the original, without a copy in the way
    assert [(n, t.tolist()) for n, t in weights] == [("w", [0.0, 1.0, 2.0, 3.0])]
    assert weights.nbytes == 16
    buffer = weights.tensors[0][1]
    list(weights.tee([("w", torch.full((4,), 7.0))]))  # the next sync refills the same buffer
    assert weights.tensors[0][1] is buffer and buffer.tolist() == [7.0] * 4
    list(weights.tee([("w", torch.zeros(2, dtype=torch.float64))]))  # another shape: a new buffer
    assert weights.tensors[0][1] is not buffer and weights.nbytes == 16


def test_engine_label_names_index_rank_and_machine():
    import socket

    assert engine_label(3, 12) == f"rollout engine 3 (rank 12 on {socket.gethostname()})"


@pytest.mark.parametrize(
    "override, message",
    [
        ({"progress_timeout_s": 0.0}, "rollout.progress_timeout_s=0.0 must be > 0 seconds"),
        ({"max_restarts": -1}, "rollout.max_restarts=-1 must be >= 0"),
    ],
)
def test_config_keys_are_validated(override, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        RolloutConfig(**override)


def test_config_defaults():
    cfg = RolloutConfig()
    assert cfg.progress_timeout_s == 600.0 and cfg.max_restarts == 2
