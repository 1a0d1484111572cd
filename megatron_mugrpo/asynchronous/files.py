"""Small files that processes on different ranks (or nodes) read while others rewrite them.

Every such file is replaced atomically and durably (``durable.atomic_write_json``): a reader sees the
old content or the new, never half of it; a writer killed mid-write leaves a ``.tmp`` file that
nobody reads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from megatron_mugrpo import durable


def write_json(path: Path, value: Any) -> None:
    durable.atomic_write_json(path, value, sort_keys=True)


class AsyncPaths:
    """Where async mode keeps its files in a run directory.

    RUN_DIR/rollouts/queue/       the rollout queue (``rollout.queue``)
    RUN_DIR/async/weights/        published policies (``asynchronous.publish``)
    RUN_DIR/async/heartbeat/      trainer.json and worker_NNN.json (``asynchronous.liveness``)
    RUN_DIR/async/acks/           worker_NNN.json: the publication each worker serves (``asynchronous.publish``)
    RUN_DIR/async/publish_group.json   where memory publication's group meets (``asynchronous.transport``)
    """

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.queue = run_dir / "rollouts" / "queue"
        self.weights = run_dir / "async" / "weights"
        self.heartbeats = run_dir / "async" / "heartbeat"
        self.acks = run_dir / "async" / "acks"

    @property
    def trainer_heartbeat(self) -> Path:
        return self.heartbeats / "trainer.json"

    def worker_heartbeat(self, index: int) -> Path:
        return self.heartbeats / f"worker_{index:03d}.json"

    def ack(self, index: int) -> Path:
        return self.acks / f"worker_{index:03d}.json"

    def make(self) -> None:
        for path in (self.queue, self.weights, self.heartbeats, self.acks):
            path.mkdir(parents=True, exist_ok=True)
