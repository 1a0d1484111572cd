"""`mugrpo sweep`: a grid of config variants × seeds, run resumably, summarised as mean ± std over seeds.

    mugrpo sweep experiments/f1_mu_vs_grpo.yaml --out runs/sweeps/f1 --parallel 2 [key=value ...]

A sweep file (YAML; relative paths are relative to the file, like a config's ``inherit:``)::

    description: μ-GRPO vs standard GRPO on the CPU demo     # optional, the summary's title
    base: ../configs/demo_cpu.yaml                           # the config every variant starts from
    overrides: [logging.progress_bars=false]                 # optional, applied to every run
    seeds: [0, 1, 2]
    seed_keys: [seed, stages.seed, data.seed]                # optional; this is the default
    variants:
      mu_grpo: []                                            # the base config as it is
      grpo: [inherit ../configs/demo_grpo_cpu.yaml]          # another config file instead of base
      no_veto: [algo.mu_grpo.veto_scope=none]                # dotted overrides, as on `mugrpo train`

A variant is a list of entries: ``key=value`` overrides, and at most one ``inherit PATH`` that
replaces ``base`` for that variant. Overrides apply in the order base file → ``overrides`` →
the variant's overrides → extra command-line overrides → the seed.

**Seeds.** Seed s sets every key of ``seed_keys`` to s, so that seeds differ as two machines
would: ``seed`` (model initialisation and warm start of the demo's base model, rollout-engine and
evaluation sampling), ``stages.seed`` (rollout sampling and the minibatch order) and ``data.seed``
(prompt order; for the built-in task also which training and held-out problems are drawn). Drop
``data.seed`` from ``seed_keys`` to keep the problems and evaluation set fixed across seeds. A
variant or ``overrides`` may not set a seed key itself.

**Layout.** ``DIR/<variant>/seed_<s>/`` is an ordinary run directory (``mugrpo train --run-dir``)
plus ``sweep.log`` (the run's output, appended per attempt) and ``sweep_status.json``. A run whose
config leaves ``model.hf_dir`` empty builds the demo's warm-started base model; runs with the same
warm-start settings and seed share one, built once under ``DIR/_base/<hash>/`` and passed as
``model.hf_dir``. ``DIR/summary.csv``, ``summary.md``, ``runs.csv`` and the band plots
(``report.write_sweep_report``) are written at the end (``--report-dir`` puts them elsewhere).

**Resuming.** Running the same command again skips finished runs, resumes interrupted or failed
ones (``mugrpo train --resume``) and starts the rest. A run directory whose ``config.yaml`` differs
from what the sweep file now asks for is an error (delete the run directory to redo it). A run that
fails keeps its log; the others go on, and the sweep exits with status 1 at the end.

**Cores.** ``--parallel N`` runs N at once; each gets ``cpus // N`` threads through
OMP_NUM_THREADS (which torch reads at start-up for its intra-op pool), MKL_NUM_THREADS,
OPENBLAS_NUM_THREADS and RAYON_NUM_THREADS (tokenizers). Reward-verifier processes inherit the same
environment; they run only while their trainer waits for scores, so with ``reward.workers``
≤ threads per run they do not oversubscribe the cores (the sweep warns otherwise).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import platform
import re
import signal
import subprocess
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from megatron_mugrpo import durable
from megatron_mugrpo.commands import mugrpo_argv, train_argv
from megatron_mugrpo.errors import ConfigError, InputError
from megatron_mugrpo.rundir import CONFIG_FILE

SWEEP_KEYS = ("description", "base", "overrides", "seeds", "seed_keys", "variants")
DEFAULT_SEED_KEYS = ("seed", "stages.seed", "data.seed")
INHERIT = "inherit"
VARIANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
"""Variant names are directory names; a leading '_' or '.' is kept for the sweep's own entries."""
BASE_DIR = "_base"
STATUS_FILE = "sweep_status.json"
LOG_FILE = "sweep.log"
LOCK_FILE = ".sweep.lock"
PLAN_FILE = "sweep.json"
FINISHED, FAILED = "finished", "failed"
THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "RAYON_NUM_THREADS")
POLL_S = 0.5
"""How often the scheduler looks for finished runs."""
STOP_TIMEOUT_S = 30.0
"""How long an interrupted sweep waits for a stopped run to exit before killing it."""
FAILURE_TAIL_LINES = 3
"""Lines of a failed run's log echoed with its failure."""
SPEC_HASH_CHARS = 12
EXIT_RUNS_FAILED = 1
EXIT_INTERRUPTED = 130


ConfigLoader = Callable[[Path, list[str]], Any]
"""``config.load_config``: the entry point hands it in (components do not import the config root)."""


class SweepError(InputError, ValueError):
    """A sweep file or sweep directory cannot be used; the message names the file, entry and fix."""


# ---------------------------------------------------------------------------------------------------
# The sweep file
# ---------------------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class Variant:
    """One named point of the grid."""

    name: str
    config: Path
    """Config file the variant starts from (the sweep's ``base``, or its own ``inherit PATH``)."""
    overrides: list[str] = field(default_factory=list)
    """The variant's dotted ``key=value`` overrides, in order."""


@dataclass(kw_only=True)
class SweepSpec:
    """A parsed sweep file (see the module docstring for the format)."""

    path: Path
    description: str
    overrides: list[str]
    """The file's ``overrides``: every run, before the variant's own."""
    extra_overrides: list[str] = field(default_factory=list)
    """Command-line overrides: every run, after the variant's own."""
    seeds: list[int]
    seed_keys: list[str]
    """Config keys that a seed sets (each to the seed's value)."""
    variants: list[Variant]


def load_sweep(path: str | Path, extra_overrides: Sequence[str] = ()) -> SweepSpec:
    """Parse and check a sweep file; ``extra_overrides`` (from the command line) apply to every run."""
    path = Path(path)
    raw = _read_yaml(path)
    unknown = sorted(set(raw) - set(SWEEP_KEYS))
    _require(not unknown, path, f"unknown key(s) {unknown}; a sweep file has {list(SWEEP_KEYS)}")
    _require("base" in raw, path, "'base: CONFIG.yaml' is missing (the config every variant starts from)")
    base = _config_path(path, raw["base"], "base")
    seed_keys = _string_list(path, raw.get("seed_keys", list(DEFAULT_SEED_KEYS)), "seed_keys")
    _require(bool(seed_keys), path, f"seed_keys is empty: name the keys a seed sets, e.g. {list(DEFAULT_SEED_KEYS)}")
    overrides = _string_list(path, raw.get("overrides") or [], "overrides")
    for item in overrides:
        _check_override(path, "overrides", item, seed_keys)
    for item in extra_overrides:
        _check_override(path, "command-line overrides", item, seed_keys)
    variants = raw.get("variants")
    _require(
        isinstance(variants, dict) and bool(variants),
        path,
        "'variants' must map at least one name to a list of entries, e.g. "
        "{mu_grpo: [], no_veto: [algo.mu_grpo.veto_scope=none]}",
    )
    return SweepSpec(
        path=path,
        description=str(raw.get("description") or path.stem),
        overrides=overrides,
        extra_overrides=list(extra_overrides),
        seeds=_parse_seeds(path, raw.get("seeds")),
        seed_keys=seed_keys,
        variants=[_parse_variant(path, name, entries, base, seed_keys) for name, entries in variants.items()],
    )


def _read_yaml(path: Path) -> dict[str, Any]:
    _require(path.is_file(), path, "the sweep file does not exist")
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise SweepError(f"sweep file {path}: not valid YAML ({str(exc).splitlines()[0]})") from exc
    _require(isinstance(raw, dict), path, f"expected a mapping with the keys {list(SWEEP_KEYS)}")
    return raw


def _parse_seeds(path: Path, seeds: Any) -> list[int]:
    _require(
        isinstance(seeds, list) and bool(seeds),
        path,
        "'seeds' must be a non-empty list of integers, e.g. seeds: [0, 1, 2]",
    )
    bad = [s for s in seeds if not isinstance(s, int) or isinstance(s, bool) or s < 0]
    _require(not bad, path, f"seeds must be non-negative integers; got {bad}")
    _require(len(set(seeds)) == len(seeds), path, f"seeds {seeds} repeat a value; each seed is one run per variant")
    return list(seeds)


def _parse_variant(path: Path, name: Any, entries: Any, base: Path, seed_keys: list[str]) -> Variant:
    where = f"variant {name!r}"
    _require(
        isinstance(name, str) and VARIANT_NAME.fullmatch(name) is not None,
        path,
        f"{where}: a variant name is a directory name of letters, digits, '_', '.', '-' (not starting with '_' or '.')",
    )
    entries = _string_list(path, [] if entries is None else entries, where)
    config, overrides = base, []
    inherits = [e for e in entries if e.split(maxsplit=1)[0] == INHERIT]
    _require(len(inherits) <= 1, path, f"{where}: more than one '{INHERIT} PATH' entry; a variant starts from one file")
    for entry in entries:
        if entry in inherits:
            parts = entry.split(maxsplit=1)
            _require(len(parts) == 2, path, f"{where}: '{entry}' needs a path, e.g. '{INHERIT} ../configs/x.yaml'")
            config = _config_path(path, parts[1], where)
        else:
            _check_override(path, where, entry, seed_keys)
            overrides.append(entry)
    return Variant(name=name, config=config, overrides=overrides)


def _check_override(path: Path, where: str, item: str, seed_keys: list[str]) -> None:
    key = item.split("=", 1)[0].strip()
    _require(
        "=" in item and bool(key) and " " not in key,
        path,
        f"{where}: entry {item!r} is neither a dotted override 'section.key=value' nor '{INHERIT} PATH'",
    )
    _require(
        key not in seed_keys,
        path,
        f"{where}: {item!r} sets {key!r}, which the sweep's seeds set (seed_keys {seed_keys}); "
        "remove the override, or drop the key from seed_keys",
    )


def _config_path(path: Path, value: Any, where: str) -> Path:
    _require(isinstance(value, str) and bool(value), path, f"{where}: expected a config file path, got {value!r}")
    config = (path.parent / value).resolve()
    _require(config.is_file(), path, f"{where}: config file {value!r} does not exist (paths are relative to {path})")
    return config


def _string_list(path: Path, value: Any, where: str) -> list[str]:
    _require(
        isinstance(value, list) and all(isinstance(v, str) for v in value),
        path,
        f"{where}: expected a list of strings, got {value!r}",
    )
    return [v.strip() for v in value]


def _require(ok: bool, path: Path, message: str) -> None:
    if not ok:
        raise SweepError(f"sweep file {path}: {message}")


# ---------------------------------------------------------------------------------------------------
# The plan: one run per variant × seed
# ---------------------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class PlannedRun:
    """One run of the grid, its resolved config and where it lives."""

    variant: str
    seed: int
    config: Path
    overrides: list[str]
    """Every override of the run (sweep, variant, command line, seed), without the shared base model."""
    cfg: Any
    """The run's resolved config (``config.RunConfig``, loaded by the caller's ``load``)."""
    run_dir: Path
    base_dir: Path | None
    """Shared warm-started base model (None when the config names its own ``model.hf_dir``)."""

    @property
    def name(self) -> str:
        return f"{self.variant}/seed_{self.seed}"

    @property
    def train_overrides(self) -> list[str]:
        return [*self.overrides, f"model.hf_dir={self.base_dir}"] if self.base_dir else list(self.overrides)

    def argv(self, *, resume: bool) -> list[str]:
        """The `mugrpo train` command of this run (a fresh start, or ``--resume``)."""
        if resume:
            return mugrpo_argv("train", "--resume", str(self.run_dir))
        return train_argv(self.config, self.run_dir, self.train_overrides)

    def expected_config(self) -> dict[str, Any]:
        """The run's config.yaml as `mugrpo train` writes it for this plan."""
        resolved = self.cfg.to_dict()
        if self.base_dir:
            resolved["model"]["hf_dir"] = str(self.base_dir)
        return resolved


def plan_sweep(spec: SweepSpec, out: Path, *, load: ConfigLoader) -> list[PlannedRun]:
    """Resolve every run's config (all errors surface here, before anything runs); ``out`` should be absolute."""
    runs = []
    for variant in spec.variants:
        for seed in spec.seeds:
            seeded = [f"{key}={seed}" for key in spec.seed_keys]
            overrides = [*spec.overrides, *variant.overrides, *spec.extra_overrides, *seeded]
            try:
                cfg = load(variant.config, overrides)
            except ConfigError as exc:
                raise SweepError(f"sweep file {spec.path}: variant {variant.name!r}, seed {seed}: {exc}") from exc
            runs.append(
                PlannedRun(
                    variant=variant.name,
                    seed=seed,
                    config=variant.config,
                    overrides=overrides,
                    cfg=cfg,
                    run_dir=out / variant.name / f"seed_{seed}",
                    base_dir=None if cfg.model.hf_dir else out / BASE_DIR / base_model_key(cfg),
                )
            )
    return runs


def base_model_key(cfg: Any) -> str:
    """A short hash of everything the demo's warm-started base model depends on."""
    from megatron_mugrpo.warmstart import warmstart_spec

    text = json.dumps(warmstart_spec(cfg), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:SPEC_HASH_CHARS]


def build_base_models(runs: Sequence[PlannedRun], echo: Callable[[str], None]) -> None:
    """Build (or find cached) each distinct shared base model once, in this process, with all its cores."""
    from megatron_mugrpo.warmstart import prepare_base_model

    built: set[Path] = set()
    for run in runs:
        if run.base_dir is None or run.base_dir in built:
            continue
        echo(f"base model {run.base_dir.name} (seed {run.cfg.seed}, {run.cfg.warmstart.steps} warm-start steps)")
        prepare_base_model(run.cfg, run.base_dir)
        built.add(run.base_dir)


# ---------------------------------------------------------------------------------------------------
# Run directories: status and config checks
# ---------------------------------------------------------------------------------------------------


def read_status(run_dir: Path) -> dict[str, Any]:
    """The sweep's record of a run ({} if the sweep never finished an attempt of it)."""
    path = run_dir / STATUS_FILE
    return json.loads(path.read_text()) if path.is_file() else {}


def run_state(run: PlannedRun) -> str:
    """'finished', 'resume' (the run directory holds a started run) or 'new'."""
    if read_status(run.run_dir).get("status") == FINISHED:
        return FINISHED
    return "resume" if (run.run_dir / CONFIG_FILE).is_file() else "new"


def check_run_config(run: PlannedRun) -> None:
    """Raise SweepError when an existing run directory was started with other settings than planned."""
    path = run.run_dir / CONFIG_FILE
    if not path.is_file():
        return
    differing = differing_keys(yaml.safe_load(path.read_text(encoding="utf-8")), run.expected_config())
    if differing:
        shown = ", ".join(differing[:6]) + (", ..." if len(differing) > 6 else "")
        raise SweepError(
            f"{run.run_dir} was started with other settings than the sweep now asks for ({shown}): delete that "
            "directory to redo the run with these settings, or restore the sweep file"
        )


def differing_keys(saved: Any, expected: Any, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two nested dicts (lists compared whole)."""
    if isinstance(saved, dict) and isinstance(expected, dict):
        keys = sorted(set(saved) | set(expected))
        return [d for k in keys for d in differing_keys(saved.get(k), expected.get(k), f"{prefix}{k}.")]
    return [] if saved == expected else [prefix.rstrip(".")]


def _write_status(run_dir: Path, record: dict[str, Any]) -> None:
    durable.atomic_write_json(run_dir / STATUS_FILE, record, indent=2)


# ---------------------------------------------------------------------------------------------------
# Running: N at a time, cores split between them
# ---------------------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class Job:
    """One `mugrpo train` process to run, with its log inside its run directory."""

    name: str
    argv: list[str]
    run_dir: Path


@dataclass(kw_only=True)
class _Running:
    job: Job
    process: subprocess.Popen
    log: Any
    started: float
    threads: int


def available_cpus() -> int:
    """CPUs this process may run on (its affinity mask, e.g. under taskset or a batch scheduler)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def threads_per_run(parallel: int, cpus: int) -> int:
    return max(1, cpus // parallel)


def run_environment(threads: int, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of every run: this one with each thread-pool size set to ``threads``."""
    env = dict(os.environ if base is None else base)
    env.update({name: str(threads) for name in THREAD_ENV})
    return env


def execute(
    jobs: Sequence[Job],
    *,
    parallel: int,
    env: dict[str, str],
    echo: Callable[[str], None],
    keep_fds: Sequence[int] = (),
) -> dict[str, int]:
    """Run the jobs, ``parallel`` at a time; return each job's exit status (by name).

    A failed job does not stop the others. Each job's output is appended to RUN_DIR/sweep.log and its
    outcome to RUN_DIR/sweep_status.json. ``keep_fds`` are inherited by every job (the sweep's lock,
    so that runs left behind by a killed sweep still hold it). On KeyboardInterrupt (or SIGTERM,
    turned into one by run_sweep) the running jobs are stopped and the interrupt re-raised.
    """
    queue, running, results = deque(jobs), [], {}
    try:
        while queue or running:
            while queue and len(running) < parallel:
                running.append(_start(queue.popleft(), env, keep_fds))
                echo(f"[{len(results) + len(running)}/{len(jobs)}] start {running[-1].job.name}")
            done = [r for r in running if r.process.poll() is not None]
            if not done:
                time.sleep(POLL_S)
            for item in done:
                running.remove(item)
                results[item.job.name] = _finish(item, echo)
    except KeyboardInterrupt:
        _stop(running, echo)
        raise
    return results


def _start(job: Job, env: dict[str, str], keep_fds: Sequence[int]) -> _Running:
    job.run_dir.mkdir(parents=True, exist_ok=True)
    log = (job.run_dir / LOG_FILE).open("a", encoding="utf-8")
    log.write(f"\n==== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(job.argv)}\n")
    log.flush()
    process = subprocess.Popen(job.argv, stdout=log, stderr=subprocess.STDOUT, env=env, pass_fds=tuple(keep_fds))
    threads = int(env.get(THREAD_ENV[0], "0"))
    return _Running(job=job, process=process, log=log, started=time.monotonic(), threads=threads)


def _finish(item: _Running, echo: Callable[[str], None]) -> int:
    code, seconds = item.process.returncode, time.monotonic() - item.started
    item.log.write(f"==== exit status {code} after {seconds:.0f}s\n")
    item.log.close()
    previous = read_status(item.job.run_dir)
    record = {
        "status": FINISHED if code == 0 else FAILED,
        "returncode": code,
        "attempts": int(previous.get("attempts", 0)) + 1,
        "seconds_last_attempt": round(seconds, 1),
        "machine": machine_description(),
        "threads": item.threads,
    }
    _write_status(item.job.run_dir, record)
    if code == 0:
        echo(f"done   {item.job.name} in {seconds:.0f}s")
    else:
        echo(f"FAILED {item.job.name} (exit status {code}); its log: {item.job.run_dir / LOG_FILE}")
        for line in _log_tail(item.job.run_dir / LOG_FILE):
            echo(f"       | {line}")
    return code


def _log_tail(path: Path, lines: int = FAILURE_TAIL_LINES) -> list[str]:
    """The last lines a failed attempt printed (usually its `error:` line or the traceback's end)."""
    text = [line for line in path.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip()]
    return [line for line in text if not line.startswith("==== ")][-lines:]


def _stop(running: list[_Running], echo: Callable[[str], None]) -> None:
    """Stop the jobs this sweep started (SIGTERM, then SIGKILL after STOP_TIMEOUT_S); no status is written,
    so the next sweep resumes them."""
    for item in running:
        if item.process.poll() is None:
            item.process.terminate()
    for item in running:
        try:
            item.process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            item.process.kill()
            item.process.wait()
        item.log.write(f"==== stopped: the sweep was interrupted (exit status {item.process.returncode})\n")
        item.log.close()
        echo(f"stopped {item.job.name}")


@contextmanager
def sweep_lock(out: Path) -> Iterator[int]:
    """Hold DIR/.sweep.lock (flock) for the sweep; yields its descriptor, which the runs inherit.

    A second sweep on the same directory, or one started while runs of a killed sweep still run,
    fails with a clear error instead of resuming a run that is still being written.
    """
    out.mkdir(parents=True, exist_ok=True)
    path = out / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise SweepError(
            f"{out} is in use by another `mugrpo sweep`, or by runs of an earlier sweep that are still running "
            f"(the sweep's pid is in {path}); wait for them to end or stop them first"
        ) from None
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        yield fd
    finally:
        os.close(fd)


def machine_description() -> str:
    """CPU model and count, Python and torch versions: what timings in a summary were measured on."""
    model = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        names = [
            line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines() if line.startswith("model name")
        ]
        model = names[0] if names else model
    import torch

    return f"{model}, {available_cpus()} CPUs, Python {platform.python_version()}, torch {torch.__version__}"


# ---------------------------------------------------------------------------------------------------
# The sweep
# ---------------------------------------------------------------------------------------------------


def run_sweep(
    spec: SweepSpec,
    out: Path,
    *,
    parallel: int = 1,
    report_dir: Path | None = None,
    dry_run: bool = False,
    echo: Callable[[str], None] | None = None,
    load: ConfigLoader,
) -> int:
    """Run (or continue) every run of ``spec`` under ``out`` and write the summary; returns the exit status.

    0: every run finished; 1: some run failed (the others ran; the summary covers the finished ones);
    130: interrupted (running runs were stopped and resume next time).
    """
    if parallel < 1:
        raise SweepError(f"--parallel {parallel}: run at least one at a time")
    echo = echo or _print
    out = out.resolve()
    plan = plan_sweep(spec, out, load=load)
    for run in plan:
        check_run_config(run)
    states = {run.name: run_state(run) for run in plan}
    threads = threads_per_run(parallel, available_cpus())
    _warn_reward_workers(plan, threads, echo)
    if dry_run:
        for run in plan:
            echo(f"{states[run.name]:<9} {run.name}: {' '.join(run.argv(resume=states[run.name] == 'resume'))}")
        return 0
    with sweep_lock(out) as lock_fd:
        durable.atomic_write_json(out / PLAN_FILE, _plan_record(spec, parallel, threads), indent=2)
        pending = [run for run in plan if states[run.name] != FINISHED]
        echo(
            f"{len(plan)} runs: {len(plan) - len(pending)} finished, {len(pending)} to run; "
            f"{parallel} at a time with {threads} thread(s) each"
        )
        results = _run_pending(pending, states, parallel, threads, lock_fd, echo)
    if results is None:
        echo("sweep interrupted: the stopped runs resume when the same command runs again")
        return EXIT_INTERRUPTED
    failed = [name for name, code in results.items() if code != 0]
    summarise(spec, plan, report_dir or out, parallel=parallel, threads=threads, echo=echo)
    if failed:
        echo(f"{len(failed)} run(s) failed: {', '.join(failed)}; their logs: RUN_DIR/{LOG_FILE}")
        return EXIT_RUNS_FAILED
    return 0


def _run_pending(
    pending: list[PlannedRun],
    states: dict[str, str],
    parallel: int,
    threads: int,
    lock_fd: int,
    echo: Callable[[str], None],
) -> dict[str, int] | None:
    """Build the shared base models, then run the pending runs; None when interrupted."""
    jobs = [Job(name=r.name, argv=r.argv(resume=states[r.name] == "resume"), run_dir=r.run_dir) for r in pending]
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        build_base_models(pending, echo)
        return execute(jobs, parallel=parallel, env=run_environment(threads), echo=echo, keep_fds=[lock_fd])
    except KeyboardInterrupt:
        return None
    finally:
        signal.signal(signal.SIGTERM, previous)


def _print(message: str) -> None:
    print(message, flush=True)  # progress shows at once also when the console is a file or a pipe


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _warn_reward_workers(plan: Sequence[PlannedRun], threads: int, echo: Callable[[str], None]) -> None:
    for variant in dict.fromkeys(run.variant for run in plan):
        workers = next(run.cfg.reward.workers for run in plan if run.variant == variant)
        if workers > threads:
            echo(
                f"warning: variant {variant!r} has reward.workers={workers} > {threads} thread(s) per run: "
                f"verification may oversubscribe the cores (add reward.workers={threads} to the overrides)"
            )


def _plan_record(spec: SweepSpec, parallel: int, threads: int) -> dict[str, Any]:
    return {
        "sweep_file": str(spec.path.resolve()),
        "overrides": spec.overrides,
        "command_line_overrides": spec.extra_overrides,
        "seeds": spec.seeds,
        "seed_keys": spec.seed_keys,
        "variants": {v.name: {"config": str(v.config), "overrides": v.overrides} for v in spec.variants},
        "parallel": parallel,
        "threads_per_run": threads,
    }


def summarise(
    spec: SweepSpec,
    plan: Sequence[PlannedRun],
    report_dir: Path,
    *,
    parallel: int,
    threads: int,
    echo: Callable[[str], None],
) -> list[Path]:
    """Write the summary of the finished runs (report.write_sweep_report); unfinished ones are listed in its notes."""
    from megatron_mugrpo.metrics import read_metrics
    from megatron_mugrpo.report import Run, SeedGroup, write_sweep_report

    groups: dict[str, SeedGroup] = {}
    notes = []
    for run in plan:
        group = groups.setdefault(run.variant, SeedGroup(label=run.variant, runs=[]))
        status = read_status(run.run_dir)
        if status.get("status") == FINISHED:
            group.runs.append(Run(label=f"seed_{run.seed}", records=read_metrics(run.run_dir)))
        else:
            state = f"failed (exit status {status['returncode']})" if status else "not finished"
            notes.append(f"{run.name} {state}: left out; its log is {run.run_dir / LOG_FILE}")
    finished = sum(len(group.runs) for group in groups.values())
    header = [
        f"Generated by `mugrpo sweep {spec.path}`; do not edit by hand.",
        "",
        f"- seeds {spec.seeds} set {spec.seed_keys}; runs: {len(plan)}, finished: {finished}",
        f"- machine: {machine_description()}; {parallel} run(s) at a time, {threads} thread(s) each "
        "(timings of runs that shared the machine include that sharing)",
    ]
    written = write_sweep_report(list(groups.values()), report_dir, title=spec.description, header=header, notes=notes)
    echo(f"summary: {report_dir / 'summary.md'}")
    return written
