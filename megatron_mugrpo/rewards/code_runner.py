"""Runs inside the sandbox: a program's tests, each in a fresh interpreter, with only the tests' inputs.

The sandbox starts once per program and this runner runs every test of it (one bubblewrap start-up
instead of one per test). It never sees an expected output: it reports each test's raw result and
the trainer compares outside the sandbox, so a program that tampers with the runner (the same uid
inside the jail) can at most spoil its own results. It is made non-dumpable, so the program cannot
open its file descriptors through /proc either.

Input (``tests.json`` beside it): ``{"kind": "stdin" | "functional", "func_name": str | null,
"tests": [input, ...], "cpu_s": float, "wall_s": float, "output_bytes": int, "stop_at_first_failure": bool}``;
stdin tests' inputs are strings, functional tests' are JSON argument lists. Output, on stdout, one
JSON line per test run: ``{"status": "ok" | "runtime_error" | "timeout" | "output_limit" |
"memory_limit" | "syntax_error", "output": str}`` (a functional test's output is the JSON of the
return value). Standard library only: it runs with the sandbox's bare interpreter.
"""

import ctypes
import json
import os
import resource
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
"""Where the program and the tests lie: /code in the sandbox."""
FUNCTIONAL_DRIVER = r"""
import json, os, sys
source = open(os.path.join(sys.argv[3], "main.py")).read()
namespace = {"__name__": "__solution__"}
exec(compile(source, "main.py", "exec"), namespace)
name, result_fd = sys.argv[1], int(sys.argv[2])
args = json.loads(sys.stdin.read())
if "Solution" in namespace and hasattr(namespace["Solution"], name):
    target = getattr(namespace["Solution"](), name)
else:
    target = namespace[name]
result = target(*args)
os.write(result_fd, json.dumps(result).encode())
"""


def main() -> None:
    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0: the program cannot read our /proc/<pid>/fd
    with open(os.path.join(HERE, "tests.json")) as handle:
        spec = json.load(handle)
    for test in spec["tests"]:
        result = run_one(spec, test)
        sys.stdout.write(json.dumps(result) + "\n")
        sys.stdout.flush()
        if result["status"] != "ok" and spec["stop_at_first_failure"]:
            break


def run_one(spec: dict, test: object) -> dict:
    cpu = max(1, int(spec["cpu_s"] + 0.999))
    output_bytes = spec["output_bytes"]

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
        # Output goes to files in the scratch directory, none larger than this: a program that prints
        # without end is stopped by SIGXFSZ instead of filling this runner's memory.
        resource.setrlimit(resource.RLIMIT_FSIZE, (output_bytes + 1, output_bytes + 1))

    functional = spec["kind"] == "functional"
    if functional:
        read_end, write_end = os.pipe()
        command = [sys.executable, "-I", "-c", FUNCTIONAL_DRIVER, spec["func_name"], str(write_end), HERE]
        stdin, pass_fds = json.dumps(test).encode(), (write_end,)
    else:
        command, stdin, pass_fds = [sys.executable, "-I", os.path.join(HERE, "main.py")], test.encode(), ()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        try:
            done = subprocess.run(
                command,
                input=stdin,
                stdout=out,
                stderr=err,
                timeout=spec["wall_s"],
                preexec_fn=limit,
                pass_fds=pass_fds,
            )
        except subprocess.TimeoutExpired:
            return {"status": "timeout", "output": ""}
        finally:
            if functional:
                os.close(write_end)
        out.seek(0)
        printed = out.read(output_bytes + 1)
        size = err.seek(0, os.SEEK_END)
        err.seek(max(0, size - 4096))
        stderr_tail = err.read()
    if functional:
        output = os.read(read_end, output_bytes + 1)
        os.close(read_end)
    else:
        output = printed
    status = classify(done.returncode, len(output), stderr_tail, output_bytes)
    return {"status": status, "output": output[:output_bytes].decode(errors="replace")}


def classify(returncode: int, output_len: int, stderr_tail: bytes, output_bytes: int) -> str:
    if output_len > output_bytes or returncode == -25:  # SIGXFSZ: a file (stdout) passed the limit
        return "output_limit"
    if returncode == 0:
        return "ok"
    if returncode in (-24, -9):  # SIGXCPU at the CPU limit, SIGKILL past it
        return "timeout"
    if b"MemoryError" in stderr_tail:
        return "memory_limit"
    if b"SyntaxError" in stderr_tail or b"IndentationError" in stderr_tail:
        return "syntax_error"
    if b"No space left on device" in stderr_tail or b"File too large" in stderr_tail:  # Python ignores SIGXFSZ
        return "output_limit"
    return "runtime_error"


if __name__ == "__main__":
    main()
