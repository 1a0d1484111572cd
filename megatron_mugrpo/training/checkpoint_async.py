"""Background saves: megatron-core ``AsyncRequest``s run in a thread of the trainer, finalized collectively.

megatron-core's ``AsyncCallsQueue`` forks a process per save (or keeps a persistent one); the
writers here are threads (``checkpoint_writer``), so the queue runs each request's function in a
thread of this process instead. The protocol is megatron's: every rank schedules the same requests
in the same order; ``maybe_finalize_async_calls`` asks all ranks (one small all-reduce) whether the
oldest request is done everywhere, and only then runs its finalize functions, on every rank. The
ranks are ``groups``' trainer world (``ParallelGroups``); in one process nothing is communicated.

A request's ``preload_fn`` runs in the caller before the thread starts (the snapshot of an async
save); its result is not used. ``async_fn`` should not raise: ranks finalize collectively, so a
failure must travel with the request to its finalize functions and be raised there on every rank
(``training.checkpoint`` does this).

    queue = ThreadAsyncCallsQueue(groups)
    call = queue.schedule_async_request(request)
    queue.maybe_finalize_async_calls(blocking=False)   # [] while any rank still writes, then [call]
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest

from megatron_mugrpo.training.parallel import ParallelGroups


def run_request(request: AsyncRequest, groups: ParallelGroups) -> None:
    """Run ``request`` now, in the caller: preload, write, barrier on ``groups``, finalize (a sync save)."""
    if request.preload_fn is not None:
        request.preload_fn()
    if request.async_fn is not None:
        request.async_fn(*request.async_fn_args, **request.async_fn_kwargs)
    groups.barrier()
    for finalize in request.finalize_fns:
        finalize()


@dataclass
class _Running:
    call_id: int
    thread: threading.Thread | None
    request: AsyncRequest


class ThreadAsyncCallsQueue:
    """Schedule requests now (each writes from a thread), finalize them in order once every rank is done."""

    def __init__(self, groups: ParallelGroups) -> None:
        self.groups = groups
        self._running: deque[_Running] = deque()
        self._last_id = 0

    def schedule_async_request(self, request: AsyncRequest) -> int:
        """Take the request's snapshot here, start its write in a thread; returns the call's id. Collective."""
        self._last_id += 1
        if request.preload_fn is not None:
            request.preload_fn()
        thread = None
        if request.async_fn is not None:
            thread = threading.Thread(
                target=request.async_fn,
                args=request.async_fn_args,
                kwargs=request.async_fn_kwargs,
                name="ckpt-async-save",
                daemon=True,
            )
            thread.start()
        self._running.append(_Running(self._last_id, thread, request))
        return self._last_id

    def maybe_finalize_async_calls(self, blocking: bool = False) -> list[int]:
        """Finalize, oldest first, the calls every rank has finished (all of them when ``blocking``). Collective."""
        finalized = []
        while self._running:
            oldest = self._running[0]
            alive = oldest.thread is not None and oldest.thread.is_alive()
            if self.groups.any_rank(alive) and not blocking:
                break
            if oldest.thread is not None:
                oldest.thread.join()
            self._running.popleft()
            for finalize in oldest.request.finalize_fns:
                finalize()
            finalized.append(oldest.call_id)
        return finalized

    def get_num_unfinalized_calls(self) -> int:
        return len(self._running)

    def close(self) -> None:
        """Wait for and finalize every call."""
        self.maybe_finalize_async_calls(blocking=True)
