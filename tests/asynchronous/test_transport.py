"""Memory publication (``asynchronous.transport``): bucketing by hand-computed boundaries; a real
2-process gloo publication, received into staging by a worker's background thread and applied to a
transformers engine, with its version and its hash equal to the trainer's; and the timeouts that
name the worker that never joined or stopped receiving."""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

import pytest
import torch

from megatron_mugrpo.asynchronous.transport import (
    PublishTimeoutError,
    Receiver,
    Sender,
    TensorMeta,
    bucket_nbytes,
    host_group,
    join_group,
    pack,
    plan_buckets,
    unpack,
)

SPAWN = multiprocessing.get_context("spawn")
PROCESS_TIMEOUT_S = 240


def _shapes(buckets) -> list[list[tuple[str, tuple[int, ...], int]]]:
    return [[(m.name, m.shape, m.offset) for m, _ in bucket] for bucket in buckets]


def test_buckets_close_at_the_limit() -> None:
    tensors = [(f"t{i}", torch.zeros(4)) for i in range(5)]  # 16 bytes each
    buckets = list(plan_buckets(tensors, 40))  # two fit (32 B), a third would make 48 > 40
    assert _shapes(buckets) == [
        [("t0", (4,), 0), ("t1", (4,), 16)],
        [("t2", (4,), 0), ("t3", (4,), 16)],
        [("t4", (4,), 0)],
    ]
    assert _shapes(plan_buckets(tensors, 32))[0] == [("t0", (4,), 0), ("t1", (4,), 16)]  # exactly full
    assert list(plan_buckets([], 32)) == []


def test_a_tensor_larger_than_a_bucket_travels_alone() -> None:
    tensors = [("small", torch.zeros(2)), ("big", torch.zeros(100)), ("after", torch.zeros(1))]
    assert _shapes(plan_buckets(tensors, 16)) == [[("small", (2,), 0)], [("big", (100,), 0)], [("after", (1,), 0)]]
    buffer = torch.empty(16, dtype=torch.uint8)  # the sender grows its buffer for it; pack needs the room
    with pytest.raises(RuntimeError):
        pack(next(iter(plan_buckets([("big", torch.zeros(100))], 16))), buffer)


def test_mixed_dtypes_stay_aligned_and_round_trip_bit_for_bit() -> None:
    """The docstring's worked example: fp32[2] (8 B), bf16[3] (6 B, at 8), fp32[1] at 14 would be
    misaligned (SGLang's flat layout has no padding) so it starts the next bucket."""
    generator = torch.Generator().manual_seed(0)
    tensors = [
        ("a", torch.randn(2, generator=generator)),
        ("b", torch.randn(3, generator=generator).to(torch.bfloat16)),
        ("c", torch.randn(1, generator=generator)),
        ("d", torch.randn(8, generator=generator)),
        ("e", torch.arange(3, dtype=torch.int64)),
    ]
    buckets = list(plan_buckets(tensors, 16))
    assert _shapes(buckets) == [
        [("a", (2,), 0), ("b", (3,), 8)],
        [("c", (1,), 0)],
        [("d", (8,), 0)],
        [("e", (3,), 0)],
    ]
    received = []
    buffer = torch.empty(64, dtype=torch.uint8)
    for bucket in buckets:
        metas = [meta for meta, _ in bucket]
        flat = pack(bucket, buffer).clone()  # what arrives on the other side
        assert flat.numel() == bucket_nbytes(metas)
        received += unpack(metas, flat)
    for (name, sent), (got_name, got) in zip(tensors, received):
        assert name == got_name and got.dtype == sent.dtype and torch.equal(got, sent)
    assert TensorMeta("x", "bfloat16", (3, 5), 0).nbytes == 30


def test_an_unsupported_dtype_is_named() -> None:
    with pytest.raises(TypeError, match=r"'flags'.*torch\.bool"):
        list(plan_buckets([("flags", torch.zeros(3, dtype=torch.bool))], 16))


# --------------------------------------------------------------------------------------------- 2 processes


def _trainer(root: str, dirs: list[str], timeout_s: float, bucket_bytes: int, results) -> None:
    """Publication rank 0: send each directory's weights as versions 4, 8, ...; report digests and times."""
    torch.set_num_threads(1)
    from safetensors.torch import load_file

    from megatron_mugrpo.asynchronous.publish import Digest

    try:
        group = host_group(Path(root), world_size=2, timeout_s=timeout_s, data_backend="gloo")
        sender = Sender(group, bucket_bytes=bucket_bytes, device=torch.device("cpu"))
        for i, directory in enumerate(dirs):
            state = load_file(str(Path(directory) / "model.safetensors"))
            digest = Digest()
            stats = sender.send(
                digest.watch(iter(state.items())), name=f"p{i}", version=4 * (i + 1), digest=digest.hexdigest
            )
            results.put(("sent", f"p{i}", 4 * (i + 1), digest.hexdigest(), stats.buckets, stats.buffer_bytes))
        sender.close()
        results.put(("trainer done",))
    except BaseException as exc:
        results.put(("trainer error", type(exc).__name__, str(exc)))


def _worker(root: str, base: str, timeout_s: float, results) -> None:
    """Publication rank 1: a transformers engine, a staging thread, and a main loop that keeps
    generating and applies whatever is staged between its "batches"."""
    torch.set_num_threads(1)
    from megatron_mugrpo.asynchronous.publish import Staging, engine_digest
    from megatron_mugrpo.rollout.engine import SamplingParams
    from megatron_mugrpo.rollout.transformers_engine import TransformersEngine

    try:
        engine = TransformersEngine(base, device="cpu", batch_size=4)
        staging = Staging(Path(root), rank=1, timeout_s=timeout_s, gpu=None, engine="transformers").start()
        batches, applied = 0, []
        while len(applied) < 2:
            engine.generate([[1, 2, 3]], 2, SamplingParams(max_new_tokens=4, seed=batches))  # a "batch"
            batches += 1
            received = staging.take()  # the safe point
            if received is not None:
                engine.load_weights(iter(received.tensors))
                staging.applied(received)
                held = engine_digest(engine, [name for name, _ in received.tensors])
                applied.append((received.name, received.version, received.digest, held))
        results.put(("worker", applied, batches))
    except BaseException as exc:
        results.put(("worker error", type(exc).__name__, str(exc)))


def _collect(results, count: int) -> list[tuple]:
    out = []
    deadline = time.monotonic() + PROCESS_TIMEOUT_S
    while len(out) < count and time.monotonic() < deadline:
        try:
            out.append(results.get(timeout=1.0))
        except Exception:  # queue.Empty
            continue
    return out


def _stop(*processes) -> None:
    for process in processes:
        process.join(timeout=10)
        if process.is_alive():
            process.kill()
            process.join()


@pytest.mark.multiprocess
def test_publish_stage_apply_on_two_gloo_processes(tmp_path: Path) -> None:
    """Two publications go from a trainer process to a worker process in several buckets each; the
    worker applies them at its safe points while it generates, with the trainer's version, and the
    weights its engine then holds hash to the trainer's digest."""
    from megatron_mugrpo.training.tiny import tiny_hf_dir

    dirs = [str(tiny_hf_dir(tmp_path / f"m{seed}", seed=seed, tokenizer=False)) for seed in range(3)]
    root = tmp_path / "weights"
    root.mkdir()
    results = SPAWN.Queue()
    trainer = SPAWN.Process(target=_trainer, args=(str(root), dirs[1:], 120.0, 64 * 1024, results))
    worker = SPAWN.Process(target=_worker, args=(str(root), dirs[0], 120.0, results))
    worker.start()
    trainer.start()
    try:
        got = _collect(results, 4)
    finally:
        _stop(trainer, worker)
    errors = [g for g in got if "error" in g[0]]
    assert not errors, errors
    sent = [g for g in got if g[0] == "sent"]
    (report,) = [g for g in got if g[0] == "worker"]
    assert len(sent) == 2 and all(buckets > 2 for *_, buckets, _ in sent)  # really bucketed
    assert all(buffer <= 2 * 64 * 1024 for *_, buffer in sent)  # two bucket buffers, never the whole model
    applied = report[1]
    assert [(name, version) for name, version, _, _ in applied] == [("p0", 4), ("p1", 8)]
    for (_, _, _, digest, _, _), (_, _, carried, held) in zip(sent, applied):
        assert carried == digest and held == digest
    assert sent[0][3] != sent[1][3]


def _silent_worker(root: str, timeout_s: float) -> None:
    """Joins the group, builds it with the trainer, then never receives a byte."""
    torch.set_num_threads(1)
    group = join_group(Path(root), 1, timeout_s=timeout_s, alive=lambda: None)
    Receiver(group, device=torch.device("cpu"), alive=lambda: None)
    while not group.has("open"):
        time.sleep(0.02)
    group.open(torch.device("cpu"))
    time.sleep(PROCESS_TIMEOUT_S)


def _send_one(root: Path, timeout_s: float, nbytes: int, *, joined: bool) -> None:
    """Publish ``nbytes`` of weights to one worker; ``joined``: first wait (untimed) until it has reached
    the store, so the timeout measures the publication and not the spawned process's imports."""
    group = host_group(root, world_size=2, timeout_s=timeout_s, data_backend="gloo")
    while joined and not group.has("joined/1"):
        time.sleep(0.05)
    sender = Sender(group, bucket_bytes=1 << 20, device=torch.device("cpu"))
    sender.send(iter([("w", torch.zeros(nbytes // 4))]), name="p0", version=4)


@pytest.mark.multiprocess
def test_a_worker_that_never_joins_is_named(tmp_path: Path) -> None:
    started = time.monotonic()
    with pytest.raises(PublishTimeoutError, match=r"rollout worker 0 \(publication rank 1\) never joined"):
        _send_one(tmp_path, 3.0, 1024, joined=False)
    assert time.monotonic() - started < 60


@pytest.mark.multiprocess
def test_a_worker_that_stops_receiving_is_named(tmp_path: Path) -> None:
    worker = SPAWN.Process(target=_silent_worker, args=(str(tmp_path), 60.0))
    worker.start()
    try:
        started = time.monotonic()
        with pytest.raises(PublishTimeoutError) as error:
            _send_one(tmp_path, 5.0, 16 << 20, joined=True)
        elapsed = time.monotonic() - started
    finally:
        worker.kill()
        worker.join()
    message = str(error.value)
    assert "rollout worker 0 (publication rank 1) received nothing" in message, message
    assert "async.publish_timeout_s=5" in message
    assert elapsed < 60
