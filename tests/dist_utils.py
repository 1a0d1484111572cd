"""Run a test function on N gloo ranks in spawned processes, re-raising a rank's failure.

The one way tests start ranks: every multi-rank test calls ``run_distributed`` and its rank body
sets up process groups with ``initialize_parallel`` (only the end-to-end launcher test goes through
``torchrun`` itself, since that is what it tests; it takes its port from ``free_port`` here).

    def _body(rank: int, world_size: int, tmp: str) -> None:   # top level: it must pickle
        groups = initialize_parallel(tp=2, pp=1, seed=0)
        ...

    def test_something(tmp_path):
        run_distributed(_body, 2, str(tmp_path))

Each rank sets RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT, limits torch to one
thread (the CI machine has two cores shared by every rank), activates the CPU compatibility layer
and calls ``fn(rank, world_size, *args)``. ``world_size=1`` runs ``fn`` in the calling process
without spawning (cheap for simple tests), then destroys the parallel state and the process group
and deactivates the compatibility layer if it activated it, leaving the process as it was.
"""

from __future__ import annotations

import os
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

RANK_THREADS = 1
"""torch threads per rank: more only oversubscribes the 2-core CI machine."""


def free_port() -> int:
    """A TCP port that was free a moment ago (for MASTER_PORT)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _setup_env(rank: int, world_size: int, port: int) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )


def _teardown() -> None:
    from megatron_mugrpo.training.parallel import destroy_parallel

    destroy_parallel(destroy_process_group=True)


def _rank_main(rank: int, fn: Callable[..., Any], world_size: int, port: int, error_queue: Any, args: tuple) -> None:
    _setup_env(rank, world_size, port)
    torch.set_num_threads(RANK_THREADS)
    from megatron_mugrpo.training import cpu_compat

    cpu_compat.activate()
    try:
        fn(rank, world_size, *args)
        _teardown()
    except BaseException:  # report every failure, including assertion errors, to the parent
        error_queue.put((rank, traceback.format_exc()))
        raise SystemExit(1) from None


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; raise the first failure.

    ``fn`` must be a picklable top-level function. The failing rank's traceback is part of the
    raised error's message.
    """
    if world_size == 1:
        _run_in_process(fn, args)
        return
    for attempt in range(PORT_ATTEMPTS):
        try:
            _spawn(fn, world_size, args)
            return
        except RuntimeError as exc:
            # free_port()'s port can be taken by another process before rank 0's store binds it (a busy
            # machine running several test workers): only that failure, at start-up, is tried again.
            if "EADDRINUSE" not in str(exc) or attempt + 1 == PORT_ATTEMPTS:
                raise


PORT_ATTEMPTS = 3


def _spawn(fn: Callable[..., Any], world_size: int, args: tuple) -> None:
    ctx = mp.get_context("spawn")
    error_queue = ctx.SimpleQueue()
    port = free_port()
    context = mp.start_processes(
        _rank_main,
        args=(fn, world_size, port, error_queue, args),
        nprocs=world_size,
        join=False,
        start_method="spawn",
    )
    try:
        while not context.join():
            pass
    except mp.ProcessRaisedException as exc:
        raise RuntimeError(_first_error(error_queue) or str(exc)) from None
    except mp.ProcessExitedException as exc:
        raise RuntimeError(_first_error(error_queue) or str(exc)) from None


def _first_error(error_queue: Any) -> str | None:
    if error_queue.empty():
        return None
    rank, text = error_queue.get()
    return f"rank {rank} failed:\n{text}"


def _run_in_process(fn: Callable[..., Any], args: tuple) -> None:
    """World size 1: run in this process with a fresh single-rank gloo group."""
    saved = {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    if dist.is_initialized():
        raise RuntimeError("run_distributed(world_size=1) needs torch.distributed to be uninitialised")
    _setup_env(0, 1, free_port())
    from megatron_mugrpo.training import cpu_compat

    activated_here = not cpu_compat.is_active()
    cpu_compat.activate()
    try:
        fn(0, 1, *args)
    finally:
        _teardown()
        if activated_here:  # leave the pytest process as we found it for other tests
            cpu_compat.deactivate()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
