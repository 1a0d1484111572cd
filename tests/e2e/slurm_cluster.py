"""A real single-host Slurm cluster for the launch tests: munge, slurmctld and one slurmd (one node).

Debian's ``slurm-wlm`` daemons (installed by ``ensure_installed`` when they are missing, as root) run
from a temporary directory: their own munge key and socket, state and spool directories, log files,
free ports and a generated ``slurm.conf`` for this machine's CPUs and memory. Nothing of the host's
Slurm or munge configuration is read or changed, and ``LocalSlurm.stop`` ends every daemon it started.

    ensure_installed()
    with LocalSlurm(tmp_path / "slurm") as cluster:
        job = cluster.sbatch(["launch/slurm.sbatch", ...], env=...)
        cluster.wait(job, timeout_s=600)
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

PACKAGES = ("slurmd", "slurmctld", "slurm-client", "munge")
DAEMONS = ("/usr/sbin/munged", "/usr/sbin/slurmctld", "/usr/sbin/slurmd")
CLIENTS = ("sbatch", "squeue", "scontrol", "sacct", "scancel", "sinfo")
FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


def missing() -> list[str]:
    """Slurm and munge programs this machine lacks."""
    return [p for p in DAEMONS if not os.access(p, os.X_OK)] + [c for c in CLIENTS[:-1] if shutil.which(c) is None]


def ensure_installed() -> str | None:
    """Install Debian's Slurm and munge when missing; returns why it cannot (None: ready)."""
    if not missing():
        return None
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return f"Slurm is not installed ({', '.join(missing())}) and apt-get cannot run here (needs root)"
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for command in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", *PACKAGES]):
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            return f"{' '.join(command)} failed: {done.stderr.strip()[-500:]}"
    return None if not missing() else f"still missing after apt-get: {', '.join(missing())}"


def _free_ports(count: int) -> list[int]:
    socks = [socket.socket() for _ in range(count)]
    try:
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


class LocalSlurm:
    """munged + slurmctld + slurmd under ``root``; ``SLURM_CONF`` in ``env`` points the clients at it."""

    def __init__(self, root: Path, *, cpus: int | None = None) -> None:
        self.root = root
        self.node = socket.gethostname().split(".")[0]  # slurmctld runs only on the host its config names
        self.cpus = cpus or os.cpu_count() or 1
        self.conf = root / "slurm.conf"
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))
        self._pids: list[Path] = []

    def __enter__(self) -> LocalSlurm:
        try:
            self.start()
        except BaseException:
            self.stop()  # the daemons that did start
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        for name in ("state", "spool", "log"):
            (self.root / name).mkdir(parents=True, exist_ok=True)
        self.root.chmod(0o755)  # munged wants its socket's directory searchable by every user
        key = self.root / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self._write_config()
        self._daemon(
            "munged",
            [DAEMONS[0], "--force", f"--key-file={key}", f"--socket={self.root / 'munge.sock'}",
             f"--pid-file={self.root / 'munged.pid'}", f"--log-file={self.root / 'log' / 'munged.log'}",
             f"--seed-file={self.root / 'munge.seed'}"],
        )  # fmt: skip
        self._daemon("slurmctld", [DAEMONS[1], "-f", str(self.conf)])
        self._daemon("slurmd", [DAEMONS[2], "-f", str(self.conf), "-N", self.node])
        deadline = time.monotonic() + 60
        while "idle" not in self.run("sinfo", "-h", "-o", "%T", check=False).stdout:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the local Slurm node never became idle:\n{self.logs()}")
            time.sleep(0.5)

    def _write_config(self) -> None:
        ctld_port, d_port = _free_ports(2)
        memory_mib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // (1 << 20) // 2
        r = self.root
        lines = [
            "ClusterName=mugrpo-test",
            f"SlurmctldHost={self.node}(127.0.0.1)",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={r / 'munge.sock'}",
            f"SlurmctldPort={ctld_port}",
            f"SlurmdPort={d_port}",
            f"StateSaveLocation={r / 'state'}",
            f"SlurmdSpoolDir={r / 'spool'}",
            f"SlurmctldPidFile={r / 'slurmctld.pid'}",
            f"SlurmdPidFile={r / 'slurmd.pid'}",
            f"SlurmctldLogFile={r / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={r / 'log' / 'slurmd.log'}",
            "ProctrackType=proctrack/linuxproc",  # no cgroup delegation needed
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "MpiDefault=none",
            "ReturnToService=2",
            "SchedulerType=sched/builtin",
            "KillWait=10",
            f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={self.cpus} RealMemory={memory_mib} State=UNKNOWN",
            "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
        ]
        self.conf.write_text("\n".join(lines) + "\n")
        # slurmd reads cgroup.conf beside slurm.conf even with proctrack/linuxproc; v1 is what these VMs mount.
        (r / "cgroup.conf").write_text("CgroupPlugin=autodetect\nConstrainCores=no\nConstrainRAMSpace=no\n")

    def _daemon(self, name: str, argv: list[str]) -> None:
        done = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=60)
        pid_file = self.root / f"{name}.pid"
        self._pids.append(pid_file)
        if done.returncode != 0:
            raise RuntimeError(f"{name} did not start ({done.returncode}): {done.stderr[-2000:]}\n{self.logs()}")

    def run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
        """A Slurm client command against this cluster."""
        return subprocess.run(list(argv), env=self.env, capture_output=True, text=True, timeout=60, check=check)

    def sbatch(self, argv: list[str], *, env: dict[str, str], cwd: Path) -> int:
        """Submit a batch script; returns the job id."""
        done = subprocess.run(
            ["sbatch", "--parsable", *argv], env=self.env | env, cwd=cwd, capture_output=True, text=True, timeout=60
        )
        if done.returncode != 0:
            raise RuntimeError(f"sbatch failed: {done.stderr}")
        return int(done.stdout.strip().split(";")[0])

    def state(self, job: int) -> tuple[str, int]:
        """(state, restart count) of ``job`` from slurmctld (no accounting database here)."""
        text = self.run("scontrol", "-o", "show", "job", str(job)).stdout
        fields = dict(item.split("=", 1) for item in text.split() if "=" in item)
        return fields.get("JobState", "UNKNOWN"), int(fields.get("Restarts", "0"))

    def wait(self, job: int, *, timeout_s: float, until: set[str] = FINISHED) -> str:
        """Wait for ``job`` to reach one of ``until``; returns the state."""
        deadline = time.monotonic() + timeout_s
        while (state := self.state(job)[0]) not in until:
            if time.monotonic() > deadline:
                self.run("scancel", str(job), check=False)
                raise TimeoutError(f"job {job} still {state} after {timeout_s:.0f}s\n{self.logs()}")
            time.sleep(1.0)
        return state

    def logs(self) -> str:
        parts = []
        for path in sorted((self.root / "log").glob("*.log")):
            parts.append(f"--- {path.name}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-15:]))
        return "\n".join(parts)

    def stop(self) -> None:
        """SIGTERM every daemon started here (by its pid file), then SIGKILL what is left after 10 s."""
        pids = []
        for pid_file in reversed(self._pids):
            try:
                pids.append(int(pid_file.read_text().strip()))
            except (OSError, ValueError):
                continue
        for pid in pids:
            _signal(pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        for pid in pids:
            _signal(pid, signal.SIGKILL)


def _signal(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signum)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
