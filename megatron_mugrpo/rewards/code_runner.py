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

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))

    functional = spec["kind"] == "functional"
    if functional:
        read_end, write_end = os.pipe()
        command = [sys.executable, "-I", "-c", FUNCTIONAL_DRIVER, spec["func_name"], str(write_end), HERE]
        stdin, pass_fds = json.dumps(test).encode(), (write_end,)
    else:
        command, stdin, pass_fds = [sys.executable, "-I", os.path.join(HERE, "main.py")], test.encode(), ()
    try:
        done = subprocess.run(
            command,
            input=stdin,
            capture_output=True,
            timeout=spec["wall_s"],
            preexec_fn=limit,
            pass_fds=pass_fds,
        )
    except subprocess.TimeoutExpired:
        return {"status": "timeout", "output": ""}
    finally:
        if functional:
            os.close(write_end)
    if functional:
        returned = os.read(read_end, spec["output_bytes"] + 1)
        os.close(read_end)
        output = returned
    else:
        output = done.stdout
    return {"status": classify(done, output, spec["output_bytes"]), "output": output.decode(errors="replace")}


def classify(done: subprocess.CompletedProcess, output: bytes, output_bytes: int) -> str:
    if len(output) > output_bytes or len(done.stdout) > 16 * output_bytes:
        return "output_limit"
    if done.returncode == 0:
        return "ok"
    tail = done.stderr[-4096:]
    if done.returncode in (-24, -9):  # SIGXCPU at the CPU limit, SIGKILL past it
        return "timeout"
    if b"MemoryError" in tail:
        return "memory_limit"
    if b"SyntaxError" in tail or b"IndentationError" in tail:
        return "syntax_error"
    if done.returncode == -25 or b"No space left on device" in tail:  # SIGXFSZ
        return "output_limit"
    return "runtime_error"


if __name__ == "__main__":
    main()
