"""Starts one sandboxed run and reaps everything it leaves: the parent of a jail, never the trainer.

The sandbox (``rewards/sandbox.py``) starts this script once per run, with the system interpreter
(``python -I -S``: standard library only, nothing of the project imported). It

1. becomes a child subreaper (``PR_SET_CHILD_SUBREAPER``), so processes orphaned inside the run (bubblewrap's
   namespace init once bubblewrap is killed) become its children and are reaped here. The trainer
   stays an ordinary process: zombies of its other process trees are not its concern;
2. dies with the thread that started it (``PR_SET_PDEATHSIG``), and bubblewrap's ``--die-with-parent``
   then takes the whole jail down;
3. forks the jail's first process, which joins the jail's cgroups (``cgroup.procs`` files named on the
   command line) before it drops to the slot's uid and executes the command: nothing of the jail runs
   outside its cgroup, not even for an instant;
4. on SIGTERM (the trainer ends the run) kills that process and its process group;
5. waits for every child, then exits with the jail's status (its exit code, or 128 + the signal).

    python3 -I -S jail_helper.py <uid|-> <gid|-> <cgroup.procs[:cgroup.procs...]|-> -- command...
"""

import contextlib
import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
JOIN_FAILED = 125
"""Exit status when the jail's first process cannot join its cgroup or drop its privileges (fails closed)."""


def main(argv: list[str]) -> int:
    uid, gid, procs, separator, *command = argv
    if separator != "--" or not command:
        sys.stderr.write("jail_helper: usage: <uid|-> <gid|-> <cgroup.procs:...|-> -- command...\n")
        return 2
    libc = ctypes.CDLL(None, use_errno=True)
    parent = os.getppid()
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0 or libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
        sys.stderr.write(f"jail_helper: prctl failed: errno {ctypes.get_errno()}\n")
        return JOIN_FAILED
    if os.getppid() != parent:  # the trainer died before PR_SET_PDEATHSIG took effect
        return JOIN_FAILED
    child = os.fork()
    if child == 0:
        _become_jail(uid, gid, [p for p in procs.split(":") if p and p != "-"], command)
    signal.signal(signal.SIGTERM, lambda *_: _kill(child))
    status = None
    while True:
        try:
            pid, raw = os.waitpid(-1, 0)
        except ChildProcessError:
            break
        if pid == child:
            status = raw
    if status is None:
        return JOIN_FAILED
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


def _become_jail(uid: str, gid: str, procs: list[str], command: list[str]) -> None:
    """In the forked child: own process group, join the cgroups, drop to the slot's uid, exec. Never returns."""
    try:
        os.setpgid(0, 0)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        for path in procs:
            with open(path, "w") as handle:
                handle.write(str(os.getpid()))
        if gid != "-":
            os.setgroups([])
            os.setgid(int(gid))
        if uid != "-":
            os.setuid(int(uid))
        os.execv(command[0], command)
    except OSError as exc:
        sys.stderr.write(f"jail_helper: cannot start the jail ({exc})\n")
    os._exit(JOIN_FAILED)


def _kill(child: int) -> None:
    for kill in (os.killpg, os.kill):
        with contextlib.suppress(OSError):
            kill(child, signal.SIGKILL)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
