"""Rollout engines that fail are replaced, not waited on: a watchdog around each host's engine.

An engine host's ``generate`` call runs in a worker thread while the calling thread watches the
engine's progress, the rows it reports finished (``ProgressCallback``). The engine has failed when

- the call raises (the engine died: a CUDA error, a dead SGLang server's broken pipe, an injected
  ``MUGRPO_ENGINE_FAULT``), or
- no row finished for ``rollout.progress_timeout_s`` seconds (the engine hangs).

A failed engine is shut down and a new one is built from the stage's weights, kept on the host
(``HostWeights``); the same call is then made again. Every call of a stage is seeded from (run seed,
stage, shard, round) (``rollout.generate``), so the repeated call samples exactly what the failed one
would have: shards already written are kept, and the shard being generated comes out bitwise equal
to an uninterrupted run's with the seeded transformers engine on CPU (SGLang with
``rollout.sglang.deterministic``; without it SGLang ignores seeds and the shard is a different
sample of the same policy). ``rollout.max_restarts`` bounds the restarts of one engine between two
weight syncs (a stage's rollout phase); past it the run stops with an ``EngineFailedError`` that
names the engine, where it failed and its last error.

Errors that a new engine would raise again are not restarts: an ``InputError`` (bad engine output,
a refused configuration), ``ValueError`` and ``TypeError`` (a bad call) propagate as they are.

What abandoning a call can and cannot do (Python cannot kill a thread):

- The abandoned thread keeps running until its call returns; its result and progress are ignored.
  SGLang's shutdown kills the server's processes, which frees their GPU memory; whether a client
  call blocked on them then returns was not checked on a GPU (if not, its thread stays parked,
  holding no GPU memory). A transformers call blocked inside a kernel stays blocked, holding the
  old model's memory (on a GPU: the rebuilt engine needs room for a second
  copy of the weights, or the rebuild fails with out-of-memory and the run stops with that error).
- A call that hangs in C code *holding the GIL* stops the watching thread too: no Python-level
  watchdog can see that. torch's kernels and SGLang's client release the GIL while they wait, so
  this is a bug of an extension, which ``parallel.timeout_s`` (the other ranks' collective timeout)
  and the lost-rank report still catch.
- SGLang may end the whole process tree itself when one of its scheduler processes fails (its
  launcher's SIGQUIT handler); then this rank is gone, the other ranks report it lost, and a resume
  keeps every finished shard.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from megatron_mugrpo.errors import InputError
from megatron_mugrpo.metric_names import ENGINE_RESTARTS
from megatron_mugrpo.rollout.engine import (
    Generation,
    ProgressCallback,
    RolloutEngine,
    SamplingParams,
    shutdown_engine,
)

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

NOT_RESTARTED = (InputError, ValueError, TypeError)
"""Exceptions a rebuilt engine would raise again on the same call: reported as they are."""
MAX_POLL_S = 1.0
"""Longest wait between two looks at the engine's progress (shorter for short timeouts)."""
POLLS_PER_TIMEOUT = 10
"""Looks per ``progress_timeout_s``: a hang is seen at most a tenth of the timeout late."""
SHUTDOWN_WAIT_S = 60.0
"""Longest wait for a failed engine's shutdown (at most progress_timeout_s); a dead server's may never return."""
RESTARTS_METRIC = ENGINE_RESTARTS
"""Engine restarts of a stage's rollout phase, over every engine host (rank 0's record)."""


class EngineFailedError(InputError, RuntimeError):
    """An engine failed more often than ``rollout.max_restarts`` allows, or could not be rebuilt; the
    message names the engine, where it failed and its last error."""


@dataclass(frozen=True)
class Failure:
    """Why one generate call of an engine was given up."""

    kind: str
    """'died' (the call raised) or 'hung' (no row finished for progress_timeout_s)."""
    detail: str
    """One line: the error, or how long the engine went without progress."""
    error: BaseException | None = None


class _EngineFailedError(Exception):
    """Internal: a call failed; ``WatchedEngine.generate`` restarts the engine or gives up."""

    def __init__(self, failure: Failure):
        super().__init__(failure.detail)
        self.failure = failure


class HostWeights:
    """The stage's Hugging Face tensors as the trainer exported them, copied into this host's memory as
    they stream to the engine (``tee``), so a rebuilt engine gets the stage's weights without a
    collective: the other ranks may be generating or already waiting at the stage's barrier, and
    the export is a collective over the trainer's parallel groups.

    Why host memory and not the run directory: the copy costs one device-to-host copy per weight sync
    and one model's bytes of host RAM per engine host, and writes nothing; a copy on disk would add a
    full write (and fsync) to every stage boundary, for restarts that are rare. Reloading from memory
    is as fast as the first sync's load. The buffers are reused from one sync to the next (same names,
    shapes and dtypes), so only the first sync allocates. Kept only when ``rollout.max_restarts`` > 0.
    Engines copy what they are given (``load_weights``), so no engine aliases these buffers.
    """

    def __init__(self) -> None:
        self.tensors: list[tuple[str, torch.Tensor]] = []

    def tee(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Pass the tensors through, copying each into this host's buffer of that name (the originals
        may be buffers the trainer reuses)."""
        import torch

        buffers, self.tensors = dict(self.tensors), []
        for name, tensor in named_tensors:
            kept = buffers.get(name)
            if kept is None or kept.shape != tensor.shape or kept.dtype != tensor.dtype:
                kept = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
            kept.copy_(tensor.detach())
            self.tensors.append((name, kept))
            yield name, tensor

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self.tensors)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.tensors)


@dataclass(kw_only=True)
class _Call:
    """One attempt of a generate call in its worker thread; the watcher reads its clock and result."""

    progress: ProgressCallback | None
    clock: Callable[[], float]
    last_progress: float = 0.0
    forwarded: int = 0
    """Rows passed on to the caller's progress callback (taken back when the attempt fails)."""
    abandoned: bool = False
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    error: BaseException | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def report(self, rows: int) -> None:
        """The engine's progress callback: stamp the clock, pass the rows on unless abandoned."""
        with self.lock:
            if self.abandoned:
                return
            self.last_progress = self.clock()
            self.forwarded += rows
            if self.progress is not None:
                self.progress(rows)

    def run(self, call: Callable[[], Any]) -> None:
        try:
            self.result = call()
        except BaseException as exc:  # handed to the watching thread, which decides
            self.error = exc
        finally:
            self.done.set()

    def abandon(self) -> None:
        """Ignore the thread from now on, and take back the rows it reported (the call is made again)."""
        with self.lock:
            self.abandoned = True
            if self.progress is not None and self.forwarded:
                self.progress(-self.forwarded)


def engine_label(engine_index: int, rank: int) -> str:
    """How errors and logs name an engine: its index, the rank hosting it and the machine."""
    return f"rollout engine {engine_index} (rank {rank} on {socket.gethostname()})"


class WatchedEngine:
    """A rollout engine under the watchdog (see the module docstring); a ``RolloutEngine`` itself.

    Args:
        engine: the engine, loaded with the stage's weights.
        rebuild: builds a new engine holding the same weights (None: no restart, a failure is an error).
        host_weights: the host copy ``rebuild`` loads; the next weight sync reuses its buffers.
        progress_timeout_s: seconds without a finished row before the engine counts as hung.
        max_restarts: restarts allowed for this engine's life between two weight syncs.
        label: names the engine in errors (``engine_label``).
        where: says where the run is when a failure is reported (e.g. "in stage 2's rollout phase").
        clock: seconds for the progress timeout (tests pass their own).

    Only ``generate`` is watched. Weight loads go to the current engine as they are; any other
    attribute is the current engine's own, multi-turn ``generate_trajectories`` (``env.enabled``)
    included, which runs unwatched (its environment calls have their own timeouts).
    """

    def __init__(
        self,
        engine: RolloutEngine,
        *,
        rebuild: Callable[[], RolloutEngine] | None,
        host_weights: HostWeights | None = None,
        progress_timeout_s: float,
        max_restarts: int,
        label: str,
        where: Callable[[], str] = lambda: "",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if progress_timeout_s <= 0 or max_restarts < 0:
            raise ValueError(f"progress_timeout_s={progress_timeout_s} must be > 0, max_restarts={max_restarts} >= 0")
        self.engine = engine
        self._rebuild = rebuild
        self.host_weights = host_weights
        self.progress_timeout_s = progress_timeout_s
        self.max_restarts = max_restarts if rebuild is not None else 0
        self.label = label
        self._where = where
        self._clock = clock
        self.restarts = 0
        self.failures: list[Failure] = []
        self.abandoned: list[threading.Thread] = []
        """Threads of given-up calls, possibly still running (a hung call returns when it returns)."""

    def __getattr__(self, name: str) -> Any:  # only called for names this class lacks
        engine = self.__dict__.get("engine")
        if engine is None:
            raise AttributeError(name)
        return getattr(engine, name)

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    def load_hf_dir(self, path: str) -> None:
        self.engine.load_hf_dir(path)

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.engine.load_weights(named_tensors)

    @property
    def release_frees_memory(self) -> bool:
        return bool(getattr(self.engine, "release_frees_memory", True))

    def release(self) -> None:
        self.engine.release()

    def shutdown(self) -> None:
        shutdown_engine(self.engine)

    def generate(
        self,
        prompts: list[list[int]],
        n: int | list[int],
        params: SamplingParams,
        progress: ProgressCallback | None = None,
    ) -> list[list[Generation]]:
        """The engine's ``generate``, watched; on a failure the engine is replaced and the call made again."""
        while True:
            try:
                return self._attempt(prompts, n, params, progress)
            except _EngineFailedError as failed:
                self._replace(failed.failure)

    def _attempt(
        self, prompts: list[list[int]], n: int | list[int], params: SamplingParams, progress: ProgressCallback | None
    ) -> list[list[Generation]]:
        """One call in a worker thread, watched until it returns, raises or stops making progress."""
        call, engine = _Call(progress=progress, clock=self._clock), self.engine
        call.last_progress = self._clock()
        worker = threading.Thread(
            target=call.run,
            args=(lambda: engine.generate(prompts, n, params, call.report),),
            name=f"{self.label} generate",
            daemon=True,  # an abandoned hung call must not keep the process alive at exit
        )
        worker.start()
        poll = min(MAX_POLL_S, self.progress_timeout_s / POLLS_PER_TIMEOUT)
        while not call.done.wait(poll):
            idle = self._clock() - call.last_progress
            if idle > self.progress_timeout_s:
                call.abandon()
                self.abandoned.append(worker)
                raise _EngineFailedError(
                    Failure(
                        "hung",
                        f"no row finished for {idle:.1f} s (rollout.progress_timeout_s={self.progress_timeout_s:g}); "
                        f"{call.forwarded} rows of this call had finished",
                    )
                )
        if call.error is None:
            return call.result
        if isinstance(call.error, NOT_RESTARTED):
            raise call.error  # a new engine would fail the same call the same way
        call.abandon()
        raise _EngineFailedError(Failure("died", f"{type(call.error).__name__}: {call.error}", call.error))

    def _replace(self, failure: Failure) -> None:
        """Shut the failed engine down and build a new one, or raise EngineFailedError past max_restarts."""
        self.failures.append(failure)
        where = self._where()
        summary = f"{self.label} {failure.kind}{' ' + where if where else ''}: {failure.detail}"
        if self.restarts >= self.max_restarts:
            raise EngineFailedError(
                f"{summary}. It was restarted {self.restarts} time(s), rollout.max_restarts={self.max_restarts}; "
                "the finished shards are kept: fix the engine (see the log's earlier failures) or raise "
                "rollout.max_restarts / rollout.progress_timeout_s, then resume the run"
            ) from failure.error
        log.warning("%s; restarting it (restart %d of at most %d)", summary, self.restarts + 1, self.max_restarts)
        started = time.monotonic()
        _stop(self.engine, self.label, min(SHUTDOWN_WAIT_S, self.progress_timeout_s))
        try:
            self.engine = self._rebuild()
        except Exception as exc:
            raise EngineFailedError(f"{summary}. Rebuilding it failed: {type(exc).__name__}: {exc}") from exc
        self.restarts += 1
        log.warning("%s rebuilt with the stage's weights in %.1f s", self.label, time.monotonic() - started)


def _stop(engine: RolloutEngine, label: str, timeout_s: float) -> None:
    """Shut a failed engine down in a thread of its own, waiting at most ``timeout_s``: a dead server's
    shutdown may block too. Its errors are logged, not raised: the engine is being replaced anyway."""

    def stop() -> None:
        try:
            shutdown_engine(engine)
        except Exception as exc:  # a failed engine's shutdown failing is expected
            log.warning("%s: shutting the failed engine down raised %s: %s", label, type(exc).__name__, exc)

    worker = threading.Thread(target=stop, name=f"{label} shutdown", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        log.warning("%s: its shutdown did not return within %.0f s; left behind", label, timeout_s)
