"""Run a function on TP × PP ranks: in place under torchrun, else in spawned processes (gloo on CPU).

The converter's CLI calls ``run_on_ranks`` so ``--tp 2 --pp 2`` works from a plain shell. A rank's
ConversionError comes back to the caller as a ConversionError with the same message (so the CLI
prints one clear line); any other failure comes back as a RuntimeError carrying the rank's traceback.
The function receives the rank's ``ParallelGroups`` first:

    def _convert_rank(groups: ParallelGroups, hf_dir: str, tmp_dir: str) -> None: ...
    run_on_ranks(_convert_rank, tp=2, pp=2, args=(hf_dir, tmp_dir))
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
from megatron_mugrpo.conversion.errors import ConversionError

from megatron_mugrpo.errors import InputError


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _threads_per_rank(world_size: int) -> int:
    """Share the machine's cores between ranks instead of oversubscribing them."""
    return max(1, (os.cpu_count() or 1) // world_size)


def _rank_main(rank: int, fn: Callable[..., Any], tp: int, pp: int, port: int, errors: Any, args: tuple) -> None:
    world_size = tp * pp
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    torch.set_num_threads(_threads_per_rank(world_size))
    from megatron_mugrpo.training import parallel

    try:
        groups = parallel.initialize_parallel(tp, pp, seed=0)
        fn(groups, *args)
        parallel.destroy_parallel(destroy_process_group=True)
    except BaseException as err:  # the parent re-raises the first rank's error
        kind = "conversion" if isinstance(err, InputError) else "other"  # model / MoE config errors too
        message = str(err) if kind == "conversion" else traceback.format_exc()
        errors.put((rank, kind, message))
        raise SystemExit(1) from None


def run_on_ranks(fn: Callable[..., Any], *, tp: int, pp: int, args: tuple = ()) -> None:
    """Call ``fn(groups, *args)`` on every rank of a TP × PP model-parallel group (Megatron state initialised).

    Under an initialised ``torch.distributed`` (torchrun) the current ranks are used (world size
    must be a multiple of TP × PP); otherwise TP × PP processes are spawned on this machine (one GPU
    each with CUDA, gloo on CPU). ``fn`` must be a picklable top-level function.
    """
    if dist.is_initialized():
        from megatron_mugrpo.training import parallel

        fn(parallel.initialize_parallel(tp, pp, seed=0), *args)
        return
    if torch.cuda.is_available() and torch.cuda.device_count() < tp * pp:
        raise ConversionError(f"--tp {tp} --pp {pp} needs {tp * pp} GPUs, this machine has {torch.cuda.device_count()}")
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    context = mp.start_processes(
        _rank_main, args=(fn, tp, pp, _free_port(), errors, args), nprocs=tp * pp, join=False, start_method="spawn"
    )
    try:
        while not context.join():
            pass
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as exc:
        _raise_rank_error(errors, exc)


def _raise_rank_error(errors: Any, exc: Exception) -> None:
    if errors.empty():
        raise RuntimeError(f"a conversion rank failed without a report: {exc}") from None
    rank, kind, message = errors.get()
    if kind == "conversion":
        raise ConversionError(message) from None
    raise RuntimeError(f"conversion rank {rank} failed:\n{message}") from None
