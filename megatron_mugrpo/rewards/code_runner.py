"""Runs inside the sandbox: a program's tests, each in a fresh interpreter that sees only its own input.

The sandbox starts once per program and this runner runs every test of it (one bubblewrap start-up
instead of one per test). It never sees an expected output: it reports each test's raw result and
the trainer compares outside the sandbox, so a program that tampers with the runner (the same uid
inside the jail) can at most spoil its own results. It is made non-dumpable, so the program cannot
open its file descriptors or read its memory through /proc either.

Each test is isolated from the others:

* its input alone reaches it (on its stdin); the runner reads every test's input from its own stdin
  before the first test starts, so no file in the jail holds another test's input;
* it runs in a fresh scratch directory (its working directory and ``TMPDIR``);
* when it ends, every other process of the jail is killed (``kill(-1)`` inside the jail's PID namespace
  until none is left: a daemon started by one test cannot answer the next), the scratch tmpfs is
  emptied and the jail's SysV IPC objects are removed before the next test starts;
* its output is capped on its own (``output_bytes``; a file past it stops the test with SIGXFSZ).

Input, on stdin: ``{"kind": "stdin" | "functional", "func_name": str | null, "tests": [input, ...],
"prelude": str, "cpu_s": float, "wall_s": float, "output_bytes": int, "processes": int,
"stop_at_first_failure": bool, "sweep": "namespace" | "group"}``; stdin tests' inputs are strings,
functional tests' JSON argument lists. ``prelude`` runs in the program's namespace before the program
(LiveCodeBench's import block; empty for plain programs). Output, on stdout, one JSON line per test
run: ``{"status": "ok" | "runtime_error" | "timeout" | "output_limit" | "memory_limit" | "syntax_error" |
"killed", "output": base64 of the bytes}`` (a functional test's output is the JSON of the return value,
written to a file, so its size never blocks a pipe). 'killed': SIGKILL, which the trainer tells apart
(its jail's cgroup counted an OOM kill: memory; else time). Standard library only: it runs with the
sandbox's bare interpreter.
"""

import base64
import contextlib
import ctypes
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

HERE = os.path.dirname(os.path.abspath(__file__))
"""Where the program lies: /code in the sandbox."""
SWEEP_S = 5.0
"""How long the runner tries to empty the jail after a test before it gives up (and stops the run)."""
STDIN_DRIVER = r"""
import sys
prelude, path = sys.argv[1], sys.argv[2]
del sys.argv[1:3]
namespace = {"__name__": "__main__", "__file__": path, "__builtins__": __builtins__}
exec(compile(prelude, "<prelude>", "exec"), namespace)
exec(compile(open(path, "rb").read(), path, "exec"), namespace)
"""
FUNCTIONAL_DRIVER = r"""
import json, os, sys
prelude, path, name, result_fd = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
namespace = {"__name__": "__solution__", "__builtins__": __builtins__}
exec(compile(prelude, "<prelude>", "exec"), namespace)
exec(compile(open(path, "rb").read(), path, "exec"), namespace)
args = json.loads(sys.stdin.read())
if "Solution" in namespace and hasattr(namespace["Solution"], name):
    target = getattr(namespace["Solution"](), name)
else:
    target = namespace[name]
result = json.dumps(target(*args)).encode()
with os.fdopen(result_fd, "wb") as handle:
    handle.write(result)
"""


def main() -> None:
    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0: the program cannot read our /proc/<pid>/*
    spec = json.loads(sys.stdin.buffer.read())
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    if spec["sweep"] == "namespace":
        # Counted per user namespace (Linux 5.14+): the jail's processes, not the trainer's threads.
        processes = int(spec["processes"])
        resource.setrlimit(resource.RLIMIT_NPROC, (processes, processes))
    for index, test in enumerate(spec["tests"]):
        result = run_one(spec, index, test)
        clean = sweep(spec["sweep"])
        sys.stdout.write(json.dumps(result) + "\n")
        sys.stdout.flush()
        if not clean:
            sys.stderr.write("runner: a test's processes could not be killed; the remaining tests do not run\n")
            sys.exit(3)
        if result["status"] != "ok" and spec["stop_at_first_failure"]:
            break


def limits_for_test(cpu: int, output_bytes: int) -> Callable[[], None]:
    """What the test's process sets on itself before it runs the program (``preexec_fn``)."""

    def limit() -> None:
        os.setsid()  # the "group" sweep kills the test's session
        # The jail's OOM killer picks by resident size, and memory held in memfd files is in no one's:
        # make the test its first choice, so this runner survives to report the test as killed.
        with contextlib.suppress(OSError), open("/proc/self/oom_score_adj", "w") as handle:
            handle.write("1000")
        # SIGXCPU at the limit, SIGKILL a second later: a SIGKILL is then the OOM killer's or a wall kill.
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        # Output goes to files, none larger than this: a program that prints without end is stopped
        # by SIGXFSZ instead of filling this runner's memory.
        resource.setrlimit(resource.RLIMIT_FSIZE, (output_bytes + 1, output_bytes + 1))

    return limit


def command_for_test(spec: dict, program: str, result_fd: int) -> list[str]:
    """The interpreter command of one test: the functional driver (the answer through ``result_fd``),
    the stdin driver with a prelude, or the program alone."""
    if spec["kind"] == "functional":
        return [
            sys.executable,
            "-I",
            "-c",
            FUNCTIONAL_DRIVER,
            spec["prelude"],
            program,
            spec["func_name"],
            str(result_fd),
        ]
    if spec["prelude"]:
        return [sys.executable, "-I", "-c", STDIN_DRIVER, spec["prelude"], program]
    return [sys.executable, "-I", program]


def run_one(spec: dict, index: int, test: object) -> dict:
    cpu = max(1, int(spec["cpu_s"] + 0.999))
    output_bytes = spec["output_bytes"]
    functional = spec["kind"] == "functional"
    program = os.path.join(HERE, "main.py")
    scratch = tempfile.mkdtemp(prefix=f"test{index}-")
    with (
        tempfile.TemporaryFile() as given,
        tempfile.TemporaryFile() as out,
        tempfile.TemporaryFile() as err,
        tempfile.TemporaryFile() as result,
    ):
        given.write(json.dumps(test).encode() if functional else str(test).encode())
        given.seek(0)
        test_process = subprocess.Popen(
            command_for_test(spec, program, result.fileno()),
            stdin=given,
            stdout=out,
            stderr=err,
            cwd=scratch,
            env=dict(os.environ, TMPDIR=scratch),
            preexec_fn=limits_for_test(cpu, output_bytes),
            pass_fds=(result.fileno(),) if functional else (),
        )
        try:
            returncode = test_process.wait(timeout=spec["wall_s"])
        except subprocess.TimeoutExpired:
            test_process.kill()
            test_process.wait()
            return {"status": "timeout", "output": ""}
        finally:
            if spec["sweep"] == "group":
                with contextlib.suppress(OSError):
                    os.killpg(test_process.pid, signal.SIGKILL)
                shutil.rmtree(scratch, ignore_errors=True)
        source = result if functional else out
        source.seek(0)
        output = source.read(output_bytes + 1)
        size = err.seek(0, os.SEEK_END)
        err.seek(max(0, size - 4096))
        stderr_tail = err.read()
    status = classify(returncode, len(output), stderr_tail, output_bytes)
    return {"status": status, "output": base64.b64encode(output[:output_bytes]).decode()}


def classify(returncode: int, output_len: int, stderr_tail: bytes, output_bytes: int) -> str:
    if output_len > output_bytes or returncode == -signal.SIGXFSZ:  # a file (stdout, result) passed the limit
        return "output_limit"
    if returncode == 0:
        return "ok"
    if returncode == -signal.SIGXCPU:
        return "timeout"
    if returncode == -signal.SIGKILL:
        return "killed"
    if b"MemoryError" in stderr_tail:
        return "memory_limit"
    if b"SyntaxError" in stderr_tail or b"IndentationError" in stderr_tail:
        return "syntax_error"
    if b"No space left on device" in stderr_tail or b"File too large" in stderr_tail:  # Python ignores SIGXFSZ
        return "output_limit"
    return "runtime_error"


def sweep(mode: str) -> bool:
    """Kill everything the test left and empty what it could write; True when the jail is clean.

    'namespace' (inside bubblewrap): ``kill(-1, SIGKILL)`` signals every process of the jail's PID
    namespace but its init and this runner, until none is left; then the scratch tmpfs is emptied and
    the SysV IPC objects removed. 'group' (the unsandboxed runner, for trusted programs only): the
    test's session, which the test may have left."""
    if mode != "namespace":
        return True
    deadline = time.monotonic() + SWEEP_S
    while True:
        with contextlib.suppress(ProcessLookupError):
            os.kill(-1, signal.SIGKILL)
        _reap()
        if not _others_alive():
            break
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    for entry in os.scandir(tempfile.gettempdir()):
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.unlink(entry.path)
    _remove_ipc()
    return True


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _others_alive() -> bool:
    """A process of the namespace besides its init and this runner that is not a zombie."""
    me = os.getpid()
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) not in (1, me):
            try:
                with open(f"/proc/{name}/stat") as handle:
                    state = handle.read().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue
            if state not in ("Z", "X"):
                return True
    return False


def _remove_ipc() -> None:
    """Remove the jail's SysV shared memory, message queues and semaphores (IPC_RMID = 0)."""
    libc = ctypes.CDLL(None, use_errno=True)
    removers = {
        "shm": lambda i: libc.shmctl(i, 0, None),
        "msg": lambda i: libc.msgctl(i, 0, None),
        "sem": lambda i: libc.semctl(i, 0, 0),
    }
    for kind, remove in removers.items():
        try:
            with open(f"/proc/sysvipc/{kind}") as handle:
                rows = handle.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if len(fields) > 1 and fields[1].isdigit():
                remove(int(fields[1]))


if __name__ == "__main__":
    main()
