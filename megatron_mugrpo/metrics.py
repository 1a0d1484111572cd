"""Metrics in one place: components return dicts, one logger writes JSONL, TensorBoard and console.

Every metric name starts with one of ``rollout/``, ``train/``, ``perf/``, ``eval/``, ``replay/``. Each
``MetricsLogger.log`` call appends one JSON line to ``<run_dir>/metrics.jsonl``::

    {"step": 12, "wall_s": 84.2, "time": 1764482531.4, "train/loss": 0.31, ...}

``step`` is the optimizer-update count, ``wall_s`` the seconds since the run started (continued across
resumes from the file's last line), ``time`` the Unix time. The line is flushed at once so a killed run
keeps everything it logged. Non-finite values are written (JSON ``NaN`` / ``Infinity``, which
``read_metrics`` reads back) and their names listed under ``"nonfinite"``.

The file only grows, with one exception: a run that continues from a checkpoint first drops the
records logged after that checkpoint (work it is about to redo), in the JSONL file and in
TensorBoard: ``keep_records=N`` keeps the first N (the count the checkpoint stored). Records with a
``"source"`` field come from a standalone command (``mugrpo eval``), not from the training loop, and
are never dropped.

    logger = MetricsLogger(run_dir, rank=rank)
    timer = Timer()
    with timer("perf/t_rollout_s"):
        groups = generate(...)
    logger.log(rollout_metrics | timer.metrics(), step=update)
    logger.close()
"""

from __future__ import annotations

import json
import math
import time
import warnings
from collections import defaultdict
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from megatron_mugrpo import durable
from megatron_mugrpo.errors import InputError, MissingInputError
from megatron_mugrpo.metric_names import (
    CLIP_HIGH,
    CLIP_LOW,
    EVAL_AVG,
    LOSS,
    METRIC_PREFIXES,
    PERF_PREFIX,
    POST_TRIGGER_SUFFIX_LEN,
    RATIO_NEG,
    REWARD,
    T_TOTAL,
    TRIGGER_POS_FRAC,
    VETO_FRAC,
)

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
RESERVED_FIELDS = ("step", "wall_s", "time", "nonfinite", "source")
"""Keys of a JSONL record that are not metrics."""
CONSOLE_KEYS = (LOSS, REWARD, CLIP_LOW, CLIP_HIGH, VETO_FRAC, RATIO_NEG, EVAL_AVG, T_TOTAL)
"""Metrics shown on the console line when present (all of them go to JSONL and TensorBoard)."""
CONSOLE_FALLBACK_COUNT = 6
"""Metrics shown on the console line when none of CONSOLE_KEYS is in the record."""


@dataclass(kw_only=True)
class LoggingConfig:
    """``logging.*``: where the metrics go beside the JSONL file, and one sanity check on them."""

    tensorboard: bool = True
    """Also write TensorBoard event files under ``<run_dir>/tensorboard``."""
    progress_bars: bool = True
    """tqdm progress bars on the console."""
    report: bool = True
    """Draw ``<run_dir>/report`` (PNG plots and a summary) when ``train`` finishes; ``mugrpo report
    RUN_DIR`` draws the same at any time, so a sweep or a test can leave it off (a few seconds each)."""
    logprob_gap_tolerance: float = 1e-3
    """Warn when the first-update train-vs-rollout log-prob gap exceeds this (should be ~0)."""


class MetricsFileError(InputError, ValueError):
    """metrics.jsonl holds a line that is not a JSON record (not the last one, which a kill may cut)."""


def check_metric_name(name: object) -> str:
    """Return ``name`` if it is a string under one of METRIC_PREFIXES, else raise ValueError."""
    if not isinstance(name, str) or not name.startswith(METRIC_PREFIXES):
        raise ValueError(
            f"metric name {name!r} must be a string starting with one of {METRIC_PREFIXES}; "
            "rename it, e.g. 'train/loss' or 'perf/t_rollout_s'"
        )
    return name


def _to_float(name: str, value: Any) -> float:
    """Convert a Python/NumPy/0-d torch number to float; anything else is an error naming the metric."""
    try:
        return float(value)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ValueError(
            f"metric {name!r} has value {value!r} of type {type(value).__name__}; log a number "
            "(call .item() on a tensor, or summarise a list)"
        ) from exc


def _truncate_partial_line(path: Path) -> None:
    """Cut a half-written last line (the run was killed mid-write) so appended records stay parseable."""
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        keep = data.rfind(b"\n") + 1
        warnings.warn(f"{path}: dropping a truncated last line before appending", stacklevel=3)
        with path.open("r+b") as handle:
            handle.truncate(keep)


def _drop_redone(path: Path, *, keep_records: int | None) -> tuple[list, list]:
    """Drop the training records logged after the checkpoint a continued run restarts from.

    Returns (kept, dropped); ``keep_records=None`` drops nothing. Records with a "source" (standalone
    commands) are always kept. Rewritten through ``durable`` (temporary name, fsync, rename), so a crash
    here leaves the old file or the new one, whole.
    """
    records = _read_records(path)

    def redone(index: int, record: dict[str, Any]) -> bool:
        return keep_records is not None and "source" not in record and index >= keep_records

    kept = [r for i, r in enumerate(records) if not redone(i, r)]
    dropped = [r for i, r in enumerate(records) if redone(i, r)]
    if dropped:
        durable.atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in kept))
    return kept, dropped


class MetricsLogger:
    """Send metric dicts to ``<run_dir>/metrics.jsonl``, TensorBoard and the console.

    Only ``rank`` 0 writes anything; other ranks still validate names so a bad metric fails everywhere.
    A run continued from a checkpoint passes ``keep_records`` (the record count the checkpoint stored):
    the records the interrupted run logged after that checkpoint (work the continued run repeats) are
    removed from the JSONL file and from TensorBoard, so every step appears once. ``source`` marks
    every record of a standalone command (e.g. ``"mugrpo eval of checkpoints/step_00000064"``);
    ``tensorboard_dir`` (relative to ``run_dir``) gives such a command its own TensorBoard run, since
    TensorBoard hides later points of a tag when an earlier step is written after them.
    """

    def __init__(
        self,
        run_dir: str | Path,
        *,
        tensorboard: bool = True,
        console: bool = True,
        rank: int = 0,
        keep_records: int | None = None,
        source: str | None = None,
        tensorboard_dir: str = TENSORBOARD_DIR,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.console = console
        self.rank = rank
        self.source = source
        self.records = 0
        """Records in the JSONL file (kept ones included): the count a checkpoint stores."""
        self._tensorboard = tensorboard
        self._tensorboard_dir = tensorboard_dir
        self._purge_step: int | None = None
        self._replay: list[dict[str, Any]] = []
        self._writer: Any = None
        self._file = None
        self._start = time.monotonic()
        self._wall_offset = 0.0
        if rank == 0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            path = self.run_dir / METRICS_FILE
            if path.exists():
                _truncate_partial_line(path)
                kept, dropped = _drop_redone(path, keep_records=keep_records)
                self._plan_tensorboard_purge(kept, dropped)
                self.records = len(kept)
                # A resumed run continues the wall clock so plots against wall_s stay monotone.
                self._wall_offset = float(kept[-1].get("wall_s", 0.0)) if kept else 0.0
            self._file = path.open("a", encoding="utf-8")

    def _plan_tensorboard_purge(self, kept: list[dict[str, Any]], dropped: list[dict[str, Any]]) -> None:
        """TensorBoard can only purge by step: drop from the first dropped step on, then write the kept
        records at or after that step again, so TensorBoard shows exactly what the JSONL file holds."""
        if dropped:
            self._purge_step = min(int(r["step"]) for r in dropped)
            self._replay = [r for r in kept if int(r["step"]) >= self._purge_step and "source" not in r]

    @property
    def path(self) -> Path:
        return self.run_dir / METRICS_FILE

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Record ``metrics`` (name → number) at optimizer update ``step``."""
        values = {check_metric_name(name): _to_float(name, value) for name, value in metrics.items()}
        if self.rank != 0:
            return
        if self._file is None:
            raise RuntimeError(f"MetricsLogger for {self.run_dir} is closed; create a new one to log again")
        nonfinite = [name for name, value in values.items() if not math.isfinite(value)]
        record: dict[str, Any] = {"step": int(step), "wall_s": self.wall_s(), "time": time.time()}
        record.update(values)
        if nonfinite:
            record["nonfinite"] = nonfinite
        if self.source is not None:
            record["source"] = self.source
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        self.records += 1
        self._log_tensorboard(values, int(step), record["time"])
        if self.console:
            tqdm.write(format_console_line(record))

    def wall_s(self) -> float:
        """Seconds since the run started (including earlier runs this one resumed)."""
        return self._wall_offset + time.monotonic() - self._start

    def _log_tensorboard(self, values: dict[str, float], step: int, walltime: float) -> None:
        writer = self._tensorboard_writer()
        if writer is None:
            return
        self._log_values(writer, values, step, walltime)
        writer.flush()

    @staticmethod
    def _log_values(writer: Any, values: dict[str, float], step: int, walltime: float) -> None:
        for name, value in values.items():
            writer.add_scalar(name, value, global_step=step, walltime=walltime)

    def _tensorboard_writer(self) -> Any:
        """Create the SummaryWriter on first use; warn once and turn TensorBoard off if it is missing."""
        if self._writer is not None or not self._tensorboard:
            return self._writer
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            warnings.warn(
                f"TensorBoard logging is off: {exc}. Install it (pip install tensorboard) or set "
                "logging.tensorboard=false; metrics are still written to metrics.jsonl",
                stacklevel=3,
            )
            self._tensorboard = False
            return None
        self._writer = SummaryWriter(log_dir=str(self.run_dir / self._tensorboard_dir), purge_step=self._purge_step)
        for record in self._replay:
            values = {name: float(value) for name, value in record.items() if name not in RESERVED_FIELDS}
            self._log_values(self._writer, values, int(record["step"]), record["time"])
        self._replay = []
        return self._writer

    def close(self) -> None:
        """Flush and close the files; safe to call twice."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


UNDEFINED_WHEN_EMPTY = (TRIGGER_POS_FRAC, POST_TRIGGER_SUFFIX_LEN)
"""Means over the responses that had a NAV trigger (algorithms/diagnostics.py): most updates have none,
and their NaN then says "no such response", not a fault. The console does not flag it; the JSONL
record still lists it under ``nonfinite``."""


def format_console_line(record: Mapping[str, Any]) -> str:
    """One compact line: step, wall time and a few key metrics (non-finite ones flagged with '!')."""
    names = [name for name in CONSOLE_KEYS if name in record]
    if not names:
        names = [name for name in record if name not in RESERVED_FIELDS][:CONSOLE_FALLBACK_COUNT]
    parts = [f"step {record['step']}", f"{record['wall_s']:.0f}s"]
    parts += [f"{name}={record[name]:.4g}" for name in names]
    nonfinite = [
        name for name in record.get("nonfinite", []) if not (name in UNDEFINED_WHEN_EMPTY and math.isnan(record[name]))
    ]
    if nonfinite:
        parts.append(f"! non-finite: {', '.join(nonfinite)}")
    return " | ".join(parts)


def _read_records(path: Path) -> list[dict[str, Any]]:
    """Parse a JSONL metrics file; a truncated final line (killed mid-write) is dropped with a warning."""
    records = []
    lines = path.read_text(encoding="utf-8").splitlines()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as exc:
            if number == len(lines):
                warnings.warn(f"{path}:{number}: dropping a truncated last line ({exc})", stacklevel=3)
                continue
            raise MetricsFileError(
                f"{path}:{number} is not a JSON record ({exc}); the file is corrupt: fix or delete that line"
            ) from exc
    return records


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """All records of ``<run_dir>/metrics.jsonl`` in file order."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        raise MissingInputError(
            f"{path} does not exist: {run_dir} is not a run directory written by MetricsLogger "
            "(pass the --run-dir of a training run)"
        )
    return _read_records(path)


def progress(total: int | None, desc: str, enabled: bool = True, **kwargs: Any) -> tqdm:
    """A tqdm progress bar, or a disabled one (same methods, prints nothing) when ``enabled`` is False.

    Pass ``enabled=logging.progress_bars and rank == 0``; console lines of MetricsLogger go through
    ``tqdm.write`` and so do not break an open bar.
    """
    return tqdm(total=total, desc=desc, disable=not enabled, dynamic_ncols=True, **kwargs)


class Timer:
    """Accumulate wall-clock durations of named ``perf/`` sections.

    ``sync`` is called before reading the clock (e.g. ``torch.cuda.synchronize`` so asynchronous GPU
    work is attributed to the section that launched it).
    """

    def __init__(self, sync: Any = None) -> None:
        self._sync = sync
        self._totals: dict[str, float] = defaultdict(float)

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        if not check_metric_name(name).startswith(PERF_PREFIX):
            raise ValueError(f"timer name {name!r} must start with 'perf/' (e.g. 'perf/t_rollout_s')")
        self._synchronize()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._synchronize()
            self._totals[name] += time.perf_counter() - start

    def _synchronize(self) -> None:
        if self._sync is not None:
            self._sync()

    def total(self, name: str) -> float:
        """Seconds accumulated under ``name`` so far (0.0 if never timed)."""
        return self._totals.get(name, 0.0)

    def metrics(self, reset: bool = False) -> dict[str, float]:
        """Accumulated seconds per name; ``reset`` starts every total again from zero."""
        out = dict(self._totals)
        if reset:
            self._totals.clear()
        return out
