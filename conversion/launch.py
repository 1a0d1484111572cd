"""Run a function on TP × PP × EP ranks: in place under torchrun, else in spawned processes (gloo on CPU).

The converter's CLI calls ``run_on_ranks`` so ``--tp 2 --pp 2`` (or ``--ep 2``) works from a plain
shell. Expert parallelism is carved out of data parallelism (``initialize_parallel``), so EP > 1
needs TP × PP × EP ranks, DP = EP: each rank holds E / EP experts of every MoE layer. A rank's
ConversionError comes back to the caller as a ConversionError with the same message (so the CLI
prints one clear line); any other failure comes back as a RuntimeError carrying the rank's traceback.
The function receives the rank's ``ParallelGroups`` first:

    def _convert_rank(groups: ParallelGroups, hf_dir: str, tmp_dir: str) -> None: ...
    run_on_ranks(_convert_rank, tp=2, pp=2, ep=1, args=(hf_dir, tmp_dir))
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


def check_world_size(world: int, tp: int, pp: int, ep: int) -> None:
    """ConversionError unless ``world`` ranks hold whole TP × PP × EP grids (EP is carved out of DP)."""
    if world % (tp * pp * ep):
        raise ConversionError(
            f"--tp {tp} --pp {pp} --ep {ep} needs a multiple of tp × pp × ep = {tp * pp * ep} ranks; "
            f"this launch has {world}"
        )


def _rank_main(
    rank: int, fn: Callable[..., Any], sizes: tuple[int, int, int], port: int, errors: Any, args: tuple
) -> None:
    tp, pp, ep = sizes
    world_size = tp * pp * ep
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    torch.set_num_threads(_threads_per_rank(world_size))
    from megatron_mugrpo.training import parallel

    try:
        groups = parallel.initialize_parallel(tp, pp, seed=0, ep=ep)
        fn(groups, *args)
        parallel.destroy_parallel(destroy_process_group=True)
    except BaseException as err:  # the parent re-raises the first rank's error
        kind = "conversion" if isinstance(err, InputError) else "other"  # model / MoE config errors too
        message = str(err) if kind == "conversion" else traceback.format_exc()
        errors.put((rank, kind, message))
        raise SystemExit(1) from None


def run_on_ranks(fn: Callable[..., Any], *, tp: int, pp: int, ep: int = 1, args: tuple = ()) -> None:
    """Call ``fn(groups, *args)`` on every rank of a TP × PP × EP grid (Megatron state initialised).

    Under an initialised ``torch.distributed`` (torchrun) the current ranks are used (world size
    must be a multiple of TP × PP × EP); otherwise TP × PP × EP processes are spawned on this machine
    (one GPU each with CUDA, gloo on CPU). ``fn`` must be a picklable top-level function.
    """
    if dist.is_initialized():
        from megatron_mugrpo.training import parallel

        check_world_size(dist.get_world_size(), tp, pp, ep)
        fn(parallel.initialize_parallel(tp, pp, seed=0, ep=ep), *args)
        return
    nprocs = tp * pp * ep
    if torch.cuda.is_available() and torch.cuda.device_count() < nprocs:
        raise ConversionError(
            f"--tp {tp} --pp {pp} --ep {ep} needs {nprocs} GPUs, this machine has {torch.cuda.device_count()}"
        )
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    context = mp.start_processes(
        _rank_main, args=(fn, (tp, pp, ep), _free_port(), errors, args), nprocs=nprocs, join=False, start_method="spawn"
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
