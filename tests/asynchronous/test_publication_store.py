"""The publication group's store as others see it (``asynchronous.transport``): it listens on the workers'
address only, its port is held from the bind (no race to lose), every key the group trusts needs the
launch's secret, a worker never joins a store that cannot prove it holds that secret; a broadcast that
never completes (a worker died during the last bucket) ends in an error naming the worker instead of
a wait without a bound; and where a worker stages publications (an SGLang worker: pinned host memory).
All in one process: the store's server and clients, no process group."""

from __future__ import annotations

import datetime
import json
import socket
import stat
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist

from megatron_mugrpo.asynchronous import transport
from megatron_mugrpo.asynchronous.liveness import RankFailedError
from megatron_mugrpo.asynchronous.transport import (
    GROUP_FILE,
    SECRET_FILE,
    GroupAddress,
    GroupSecret,
    PublishTimeoutError,
    Sender,
    host_group,
    join_group,
    listen_address,
    read_secret,
    staging_place,
    wait_until,
    write_secret,
)


def _client(address: GroupAddress) -> dist.TCPStore:
    """A client of the store that knows only what the group file says (no secret)."""
    return dist.TCPStore(address.host, address.port, None, False, datetime.timedelta(seconds=10))


def _listening(port: int) -> list[str]:
    """Local addresses this process listens on at ``port``."""
    return [
        c.laddr.ip for c in psutil.Process().net_connections("tcp") if c.status == "LISTEN" and c.laddr.port == port
    ]


def test_the_store_listens_on_the_workers_address_only(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")  # one node: torchrun's rendezvous is on loopback
    group = host_group(tmp_path, world_size=2, timeout_s=5.0, data_backend="gloo")
    assert group.address.host == "127.0.0.1"
    assert _listening(group.address.port) == ["127.0.0.1"]  # not 0.0.0.0 / :: (every interface)
    assert json.loads((tmp_path / GROUP_FILE).read_text())["host"] == "127.0.0.1"


def test_listen_address_is_the_local_end_of_the_route_to_master_addr() -> None:
    assert listen_address({}) == "127.0.0.1"
    assert listen_address({"MASTER_ADDR": "localhost"}) == "127.0.0.1"
    assert listen_address({"MASTER_ADDR": "127.0.0.5"}) == "127.0.0.1"
    own = [
        a.address
        for addresses in psutil.net_if_addrs().values()
        for a in addresses
        if a.family == socket.AF_INET and not a.address.startswith("127.")
    ]
    if own:  # this host's own address routes to itself
        assert listen_address({"MASTER_ADDR": own[0]}) == own[0]
    with pytest.raises(RuntimeError, match=r"MASTER_ADDR='no-such-host\.invalid'.*async\.publish=disk"):
        listen_address({"MASTER_ADDR": "no-such-host.invalid"})


def test_the_port_is_held_from_the_bind_so_no_other_program_can_take_it(tmp_path: Path, monkeypatch) -> None:
    """A program that binds the port between the trainer choosing it and the store listening on it (the old
    pick-then-bind's race) finds it taken; the store starts anyway."""
    real = dist.TCPStore
    stolen: list[socket.socket] = []

    def racing_store(host, port, *args, **kwargs):
        if len(args) > 1 and args[1]:  # the server: another program tries the port first
            thief = socket.socket()
            try:
                thief.bind(("", port))
                thief.listen(1)
                stolen.append(thief)
            except OSError:
                thief.close()
        return real(host, port, *args, **kwargs)

    monkeypatch.setattr(transport.dist, "TCPStore", racing_store)
    try:
        group = host_group(tmp_path, world_size=2, timeout_s=5.0, data_backend="gloo", host="127.0.0.1")
        assert stolen == [] and group.has("nothing") is False
    finally:
        for thief in stolen:
            thief.close()


def test_the_secret_is_private_and_every_trusted_key_needs_it(tmp_path: Path) -> None:
    group = host_group(tmp_path, world_size=2, timeout_s=5.0, data_backend="gloo", host="127.0.0.1")
    secret_file = tmp_path / SECRET_FILE
    assert stat.S_IMODE(secret_file.stat().st_mode) == 0o600
    token = secret_file.read_text()
    assert len(token) == 32 and token not in (tmp_path / GROUP_FILE).read_text()
    assert token == group.secret.token

    # Someone who reaches the port and read the group file forges a join, a receipt and an announcement
    # under every prefix it can know: the group sees none of them.
    outsider = _client(group.address)
    for key in ("joined/1", "received/1/0", "progress/1", "announce/0", "closed/1"):
        outsider.set(key, "1")
        outsider.set(f"{group.address.prefix}/{key}", "1")
    assert not any(group.has(key) for key in ("joined/1", "received/1/0", "progress/1", "announce/0", "closed/1"))

    worker = join_group(tmp_path, 1, timeout_s=5.0, alive=lambda: None)  # reads the secret: it joins
    assert read_secret(tmp_path / "missing") is None
    (tmp_path / "torn").write_text(token[:10])  # never a secret of the wrong length
    assert read_secret(tmp_path / "torn") is None
    assert group.has("joined/1") and worker.keys.check(["joined/1"])


class _StoppedError(Exception):
    pass


def test_a_worker_never_joins_a_store_that_cannot_prove_the_secret(tmp_path: Path) -> None:
    """The group file names a live store of another launch (a reused port, someone else's store): the
    worker's secret does not verify its proof, so it goes on looking and sends that store nothing."""
    (tmp_path / "other").mkdir()
    impostor = host_group(tmp_path / "other", world_size=2, timeout_s=5.0, data_backend="gloo", host="127.0.0.1")
    root = tmp_path / "run"
    root.mkdir()
    (root / GROUP_FILE).write_text((tmp_path / "other" / GROUP_FILE).read_text())
    ours = GroupSecret.fresh()
    write_secret(root / SECRET_FILE, ours)
    attempts = []

    def alive() -> None:
        attempts.append(1)
        if len(attempts) > 3:
            raise _StoppedError

    with pytest.raises(_StoppedError):
        join_group(root, 1, timeout_s=5.0, alive=alive)
    seen = dist.PrefixStore(ours.keys(impostor.address), impostor.store)
    assert not seen.check(["joined/1"]) and not impostor.has("joined/1")
    assert not GroupSecret.fresh().verifies(impostor.address, impostor.secret.proof(impostor.address).encode())
    assert impostor.secret.verifies(impostor.address, impostor.secret.proof(impostor.address).encode())


# ------------------------------------------------------------------------------- bounded waits on the wire


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_wait_until_ends_at_the_deadline_or_when_watch_names_a_dead_worker() -> None:
    clock = _Clock()
    with pytest.raises(PublishTimeoutError, match="late"):
        wait_until(
            lambda: False,
            deadline=1.0,
            watch=lambda: None,
            expired=lambda: PublishTimeoutError("late"),
            clock=clock,
            sleep=clock.sleep,
        )
    assert 1.0 < clock.now < 1.1

    looks = []

    def watch() -> None:
        looks.append(1)
        if len(looks) == 3:
            raise RankFailedError("rollout worker 0 (rank 1) stopped: its heartbeat is 30 s old")

    clock = _Clock()
    with pytest.raises(RankFailedError, match="rollout worker 0"):
        wait_until(
            lambda: False, deadline=1e9, watch=watch, expired=lambda: AssertionError, clock=clock, sleep=clock.sleep
        )
    assert len(looks) == 3

    done = iter([False, False, True])  # completes during the last sleep: not late
    clock = _Clock()
    wait_until(
        lambda: next(done),
        deadline=0.0,
        watch=lambda: None,
        expired=lambda: AssertionError,
        clock=clock,
        sleep=clock.sleep,
    )


class _NeverCompletes:
    """A broadcast whose peer died: NCCL would leave ``cuda.synchronize`` waiting until its watchdog."""

    def is_completed(self) -> bool:
        return False

    def wait(self) -> bool:
        raise AssertionError("a blocking wait on a broadcast that never completes")


def test_a_broadcast_that_never_completes_ends_in_an_error_naming_the_worker(tmp_path: Path) -> None:
    group = host_group(tmp_path, world_size=3, timeout_s=0.3, data_backend="gloo", host="127.0.0.1")
    group.keys.set("progress/1", "3 bucket(s) of version 4")  # worker 0 got three buckets, worker 1 nothing
    group.keys.set("received/2/0", "1")  # ... and worker 1 already has the whole publication
    sender = Sender(group, bucket_bytes=1024, device=torch.device("cpu"))
    deadline = transport.time.monotonic() + group.timeout_s
    with pytest.raises(PublishTimeoutError) as error:
        sender._drain([_NeverCompletes()], deadline, lambda: None, "sending bucket 4")
    message = str(error.value)
    assert "publication 0 is still sending bucket 4" in message
    assert "rollout worker 0 (publication rank 1) received 3 bucket(s) of version 4" in message
    assert "rollout worker 1" not in message and "async.publish_timeout_s=0.3" in message


def test_an_nccl_broadcast_that_never_completes_is_aborted_before_the_error(tmp_path: Path) -> None:
    """Over NCCL the abandoned broadcast's communicator is aborted, so neither the stream nor the exit waits
    for NCCL's watchdog; the error names the worker whose heartbeat stopped."""

    class _Communicator:
        aborted = False

        def abort(self) -> None:
            self.aborted = True

    group = host_group(tmp_path, world_size=2, timeout_s=60.0, data_backend="nccl", host="127.0.0.1")
    group.data = _Communicator()
    sender = Sender(group, bucket_bytes=1024, device=torch.device("cpu"))

    def watch() -> None:
        raise RankFailedError("rollout worker 0 (rank 1) stopped: its heartbeat is 30 s old")

    with pytest.raises(RankFailedError, match=r"rollout worker 0 \(rank 1\)"):
        sender._drain([_NeverCompletes()], transport.time.monotonic() + 60.0, watch, "sending bucket 9")
    assert group.data.aborted


# ------------------------------------------------------------------------------------ where staging lives


def test_sglang_workers_stage_in_pinned_host_memory() -> None:
    gpu, cpu = torch.device("cuda", 3), torch.device("cpu")
    over_nccl = staging_place("sglang", data_backend="nccl", gpu=gpu)
    assert (over_nccl.wire, over_nccl.hold, over_nccl.pinned) == (gpu, cpu, True)  # one bucket on the GPU
    over_gloo = staging_place("sglang", data_backend="gloo", gpu=gpu)
    assert (over_gloo.wire, over_gloo.hold, over_gloo.pinned) == (cpu, cpu, True)
    transformers = staging_place("transformers", data_backend="nccl", gpu=gpu)
    assert (transformers.wire, transformers.hold, transformers.pinned) == (gpu, gpu, False)
    for engine in ("sglang", "transformers"):
        place = staging_place(engine, data_backend="gloo", gpu=None)
        assert (place.wire, place.hold, place.pinned) == (cpu, cpu, False)


class _ScriptedGroup:
    """Plays the trainer's side of one publication of ``tensors`` in one bucket (``transport``'s messages)."""

    def __init__(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        buffer = torch.empty(1 << 16, dtype=torch.uint8)
        (bucket,) = transport.plan_buckets(tensors, 1 << 16)
        metas = [[m.name, m.dtype, list(m.shape), m.offset] for m, _ in bucket]
        flat = transport.pack(bucket, buffer).clone()
        end = {"name": "p0", "version": 4, "digest": ""}
        self.messages = [*self._message(transport.BUCKET, metas), flat, *self._message(transport.END, end)]
        self.keys, self.rank = dist.HashStore(), 1

    @staticmethod
    def _message(kind: int, meta: object) -> list[torch.Tensor]:
        encoded = torch.frombuffer(bytearray(json.dumps(meta).encode()), dtype=torch.uint8)
        return [torch.tensor([kind, encoded.numel(), 0, 4]), encoded]

    def broadcast(self, tensor: torch.Tensor, *, data: bool = False) -> None:
        tensor.copy_(self.messages.pop(0).to(tensor.device))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (pinned memory, a GPU landing buffer)")
def test_an_sglang_worker_receives_on_the_gpu_and_holds_in_pinned_host_memory() -> None:
    tensors = [("a", torch.randn(64, 8)), ("b", torch.arange(10, dtype=torch.int64))]
    place = staging_place("sglang", data_backend="nccl", gpu=torch.device("cuda", 0))
    receiver = transport.Receiver(
        _ScriptedGroup(tensors), device=place.wire, hold=place.hold, pinned=place.pinned, alive=lambda: None
    )
    received = receiver._receive()
    assert (received.name, received.version) == ("p0", 4)
    for (name, sent), (got_name, got) in zip(tensors, received.tensors, strict=True):
        assert got_name == name and got.device.type == "cpu" and torch.equal(got, sent)
    assert all(buffer.is_pinned() for buffer in received.buffers)
    assert receiver._wire is not None and receiver._wire.is_cuda  # the one landing buffer on the GPU


def test_a_cpu_worker_receives_and_holds_in_the_same_buffer() -> None:
    tensors = [("a", torch.randn(4, 3)), ("b", torch.ones(5, dtype=torch.bfloat16))]
    receiver = transport.Receiver(_ScriptedGroup(tensors), device=torch.device("cpu"), alive=lambda: None)
    received = receiver._receive()
    for (name, sent), (got_name, got) in zip(tensors, received.tensors, strict=True):
        assert got_name == name and torch.equal(got, sent)
    assert receiver._wire is None


def test_the_sglang_engine_moves_pinned_host_tensors_to_its_gpu_one_bucket_at_a_time(monkeypatch) -> None:
    """What an SGLang worker staged in pinned host memory reaches SGLang on the GPU (by CUDA IPC, as the
    trainer's tensors did); other tensors go as they are. The meta device stands in for the GPU on CPU."""
    from megatron_mugrpo.rollout.sglang_engine import _on_gpu

    pinned, plain = torch.ones(3), torch.zeros(2)
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: self is pinned)
    moved = _on_gpu([("pinned", pinned), ("plain", plain)], torch.device("meta"))
    assert [(name, t.device.type) for name, t in moved] == [("pinned", "meta"), ("plain", "cpu")]
    assert moved[1][1] is plain
