"""The run directory's guarantees: one writer at a time, and a directory is a run only once set-up succeeded.

* **Lock.** Every verb that writes a run directory (train, generate, optimize, eval) holds an
  exclusive ``fcntl.flock`` on ``RUN_DIR/.lock`` on rank 0 (the writer) for as long as it runs. A
  second process gets ``RunLockedError`` naming the holder's pid and host. The kernel drops the lock
  when the holder exits, however it exits, so a killed run never leaves a stale lock.
* **Config written last.** ``RUN_DIR/config.yaml`` is what makes a directory a run. ``open_run``
  writes it (atomically) only after set-up succeeded; a failed first start removes the directory it
  created. A start that failed after set-up but before it produced anything (no rollout shard, no
  checkpoint) may be replaced by a new ``train --config``, which says so.
* **History.** ``RUN_DIR/config_history.json`` records when the run was created and every accepted
  change of its config on resume (time, verb, overrides), plus the config the run currently runs
  with: the reference against which hand edits of ``config.yaml`` are checked (see ``resume.py``).
  ``config.yaml`` repeats the history as comments at its top.

    lock = RunLock.acquire(run_dir)        # RunLockedError if another process holds it
    ...
    record_config(cfg, run_dir, event="train: created")
    lock.release()
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from omegaconf import OmegaConf

from megatron_mugrpo import durable
from megatron_mugrpo.errors import InputError

log = logging.getLogger(__name__)

CONFIG_FILE = "config.yaml"
HISTORY_FILE = "config_history.json"
LOCK_FILE = ".lock"
KEPT_ON_REPLACE = ("base_model", LOCK_FILE)
"""Entries of a failed start that a replacing start keeps: the lock it holds, and the built base model
(a cache, checked against the new config's settings before reuse)."""


class RunDirError(InputError, RuntimeError):
    """A run directory cannot be used as asked; the message says why and what to do."""


class RunLockedError(RunDirError):
    """Another process is writing this run directory."""


@dataclass
class RunLock:
    """An exclusive lock on ``RUN_DIR/.lock``, held until ``release()`` or the process exits."""

    path: Path
    handle: Any

    @classmethod
    def acquire(cls, run_dir: Path) -> RunLock:
        """Lock ``run_dir`` (created if missing) or raise RunLockedError naming the holder."""
        path = run_dir / LOCK_FILE
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            handle = path.open("a+")
        except OSError as exc:  # a file in the way, no permission, read-only file system
            raise RunDirError(f"cannot use {run_dir} as a run directory: {exc}") from exc
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "an unknown process"
            handle.close()
            raise RunLockedError(
                f"{run_dir} is in use by {holder}: one process writes a run directory at a time. Wait for it "
                "to finish (or stop it), then retry"
            ) from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()} on host {socket.gethostname()}\n")
        handle.flush()
        return cls(path=path, handle=handle)

    def release(self) -> None:
        """Unlock; safe to call twice. The file stays (removing it would race with a new holder)."""
        if self.handle is not None:
            fcntl.flock(self.handle, fcntl.LOCK_UN)
            self.handle.close()
            self.handle = None


@dataclass
class Claim:
    """Rank 0's hold on a run directory during set-up: the lock, and whether set-up created the directory."""

    run_dir: Path
    lock: RunLock
    created: bool

    def abandon(self) -> None:
        """Set-up failed: unlock, and remove the directory if this set-up created it (nothing is left)."""
        self.lock.release()
        if self.created:
            shutil.rmtree(self.run_dir, ignore_errors=True)


def claim(run_dir: Path, *, replace_failed_start: bool = False) -> Claim:
    """Lock ``run_dir`` for set-up. With ``replace_failed_start``, clear a start that produced nothing.

    The check that the old start produced nothing is repeated here, under the lock.
    """
    created = not run_dir.exists()
    lock = RunLock.acquire(run_dir)
    if replace_failed_start and is_run(run_dir):
        if not produced_nothing(run_dir):
            lock.release()
            raise RunDirError(
                f"{run_dir} already holds a run: continue it with `mugrpo train --resume {run_dir}` "
                "or choose another --run-dir"
            )
        removed = clear_failed_start(run_dir)
        log.warning(
            "%s held only the set-up of a start that failed before any rollout or checkpoint; replacing it "
            "(removed %s)",
            run_dir,
            ", ".join(removed),
        )
    return Claim(run_dir=run_dir, lock=lock, created=created)


def is_run(run_dir: Path) -> bool:
    """A directory is a run once its set-up succeeded, i.e. once config.yaml exists."""
    return (run_dir / CONFIG_FILE).is_file()


def produced_nothing(run_dir: Path) -> bool:
    """True when a run has no checkpoint and no rollout file: its start failed before any progress."""
    for sub in ("checkpoints", "rollouts"):
        folder = run_dir / sub
        if folder.is_dir() and any(path.is_file() for path in folder.rglob("*")):
            return False
    return True


def clear_failed_start(run_dir: Path) -> list[str]:
    """Remove what a start that produced nothing left (config, metrics, ...); returns the removed names."""
    removed = []
    for entry in sorted(run_dir.iterdir()):
        if entry.name in KEPT_ON_REPLACE:
            continue
        shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
        removed.append(entry.name)
    return removed


def read_history(run_dir: Path) -> dict[str, Any] | None:
    """``config_history.json`` as ``{"entries": [...], "config": {...}}``, or None for a run without one."""
    path = run_dir / HISTORY_FILE
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise RunDirError(f"{path} is unreadable ({exc}); restore it or delete it to skip the config check") from exc


class ConfigValues(Protocol):
    """A resolved run config (``config.RunConfig``): what the run directory records of it."""

    def to_dict(self) -> dict[str, Any]:
        """Plain values under the user's keys, as ``config.save_config`` writes them."""
        ...


def record_config(cfg: ConfigValues, run_dir: Path, *, event: str) -> None:
    """Write the run's config (history file first, config.yaml last, each atomically) with an entry for ``event``.

    ``event`` reads like ``"train: created"`` or ``"train --resume: stages.num_stages=3"``.
    """
    values = cfg.to_dict()
    history = read_history(run_dir) or {"entries": []}
    history["entries"].append({"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "event": event})
    history["config"] = values
    durable.atomic_write_json(run_dir / HISTORY_FILE, history, indent=2)
    # the same YAML as config.save_config (load_config reads it back)
    yaml_text = OmegaConf.to_yaml(OmegaConf.create(values))
    durable.atomic_write_text(run_dir / CONFIG_FILE, _config_header(history["entries"]) + yaml_text)


def _config_header(entries: list[dict[str, str]]) -> str:
    lines = [
        "# The configuration of this run: `mugrpo train --resume RUN_DIR` continues with these values.",
        "# On resume only keys that are safe mid-run may change (megatron_mugrpo/resume.py lists them:",
        "# the stage count, eval, logging, checkpoint cadence); other changes need a new run directory.",
        "# History (also in config_history.json):",
    ]
    lines += [f"#   {entry['time']}  {entry['event']}" for entry in entries]
    return "\n".join(lines) + "\n"
