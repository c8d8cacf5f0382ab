"""procfs's process readers (stat and the one start time, the process list, cmdline, environ,
status, threads, fds, exe, maps, file locks, memory), each checked on real processes against what
the kernel and psutil say, and for a process that is gone; and no module outside linux/procfs.py
reads /proc itself (runtime/ aside: it is loaded into every command's interpreter and keeps its
imports to os)."""

from __future__ import annotations

import ast
import fcntl
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest

from krex_async.linux import procfs

from ..conftest import until

ROOT = Path(__file__).resolve().parents[2]


@contextmanager
def child(code: str, **env: str) -> Iterator[subprocess.Popen[bytes]]:
    """A python child running `code` after it printed "up" (so its /proc entry is its own)."""
    p = subprocess.Popen(
        [sys.executable, "-c", f"import sys; print('up', flush=True); {code}", "arg with space"],
        stdout=subprocess.PIPE,
        env={**os.environ, **env},
    )
    try:
        assert p.stdout is not None and p.stdout.readline() == b"up\n"
        yield p
    finally:
        p.kill()
        p.wait()


def gone() -> int:
    """A pid that was a process a moment ago and is reaped."""
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_stat_and_the_one_start_time_of_a_child_a_zombie_and_a_gone_one() -> None:
    """The start time, in clock ticks since boot, is psutil's create time; every module that
    compares start times reads this one function."""
    from krex_async.daemon.persist.records import start_ticks
    from krex_async.isolation.cudalock import start_time as lock_start
    from krex_async.probes.attribution import start_time as probe_start

    assert lock_start is probe_start is start_ticks is procfs.start_time
    with child("import time; time.sleep(60)") as p:
        st = procfs.stat(p.pid)
        assert st is not None and st.ppid == os.getpid() and st.state in ("S", "R"), st
        ticks = procfs.start_time(p.pid)
        assert ticks == st.start
        made = psutil.boot_time() + st.start / os.sysconf("SC_CLK_TCK")
        assert abs(made - psutil.Process(p.pid).create_time()) < 0.05
        assert (procfs.start_time(os.getpid()) or ticks + 1) <= ticks
        assert st.session == os.getsid(p.pid)
        p.kill()
        os.waitid(os.P_PID, p.pid, os.WEXITED | os.WNOWAIT)
        zombie = procfs.stat(p.pid)
        assert zombie is not None and zombie.state == "Z" and zombie.start == ticks
    dead = gone()
    assert procfs.stat(dead) is None and procfs.start_time(dead) is None
    assert not procfs.exists(dead) and procfs.exists(os.getpid())


def test_the_process_list_has_the_living_only() -> None:
    dead = gone()
    with child("import time; time.sleep(60)") as p:
        listed = procfs.pids()
        assert os.getpid() in listed and p.pid in listed and dead not in listed
        assert set(listed) >= set(psutil.pids()) - {q for q in psutil.pids() if not procfs.exists(q)}
    assert procfs.pids(proc="/nonexistent") == []


def test_cmdline_environ_status_exe_and_maps_of_a_child() -> None:
    with child("import time; time.sleep(60)", KREX_TEST_MARK="on") as p:
        cmd = procfs.cmdline(p.pid)
        assert cmd is not None and cmd.split(b"\0")[-2:] == [b"arg with space", b""]
        assert procfs.cmdline(p.pid, limit=5) == cmd[:5]
        env = procfs.environ(p.pid)
        assert env is not None and b"\0KREX_TEST_MARK=on\0" in b"\0" + env
        status = procfs.status(p.pid)
        assert status is not None and status["Tgid"] == str(p.pid) and status["PPid"] == str(os.getpid())
        assert status["Uid"].split()[0] == str(os.getuid())
        assert procfs.exe(p.pid) == os.path.realpath(sys.executable)
        maps = procfs.maps(p.pid)
        assert maps is not None and os.path.realpath(sys.executable) in maps
        assert procfs.security_label(p.pid) == procfs.security_label("self")  # the same LSM label
        assert os.path.samefile(procfs.in_root(p.pid, sys.executable), sys.executable)
    dead = gone()
    for read in (procfs.cmdline, procfs.environ, procfs.status, procfs.exe, procfs.maps):
        assert read(dead) is None, read
    assert procfs.cmdline(os.getpid()) is not None


def test_threads_and_where_they_sleep() -> None:
    code = "import threading, time; [threading.Thread(target=time.sleep, args=(60,)).start() for _ in 'ab']"
    with child(code) as p:
        assert until_sync(lambda: len(procfs.tids(p.pid) or ()) == 3), procfs.tids(p.pid)
        tids = procfs.tids(p.pid)
        assert tids is not None and p.pid in tids

        def sleeping() -> bool:  # a thread just started may still run (R) on a loaded machine
            return all((s := procfs.thread_state(t)) is not None and s[0] == "S" for t in tids)

        assert until_sync(sleeping), {procfs.thread_state(t) for t in tids}
        assert {s[1] for t in tids if (s := procfs.thread_state(t))} & {"hrtimer_nanosleep", "do_nanosleep"}
        os.kill(p.pid, signal.SIGSTOP)
        assert until_sync(lambda: (procfs.thread_state(p.pid) or ("",))[0] == "T")
    dead = gone()
    assert procfs.tids(dead) is None and procfs.thread_state(dead) is None


def until_sync(check: Callable[[], bool], timeout: float = 30.0) -> bool:
    """Whether `check()` came to hold within `timeout` s (for a sync test's waits)."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_fds_their_targets_and_flags(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_text("x")
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        assert fd in (procfs.fds(os.getpid()) or [])
        assert procfs.fd_target(os.getpid(), fd) == str(path)
        flags = procfs.fd_flags(os.getpid(), fd)
        assert flags is not None and flags & os.O_CLOEXEC
        os.set_inheritable(fd, True)
        assert not (procfs.fd_flags(os.getpid(), fd) or 0) & os.O_CLOEXEC
    finally:
        os.close(fd)
    assert procfs.fd_target(os.getpid(), fd) is None and procfs.fd_flags(os.getpid(), fd) is None
    assert procfs.fds(gone()) is None


async def test_flock_holders_name_the_holder_while_it_holds(tmp_path: Path) -> None:
    lock = tmp_path / "lock"
    lock.write_text("")
    ino = lock.stat().st_ino
    code = f"import fcntl, time; f = open({str(lock)!r}); fcntl.flock(f, fcntl.LOCK_EX)"
    code += "; print('held', flush=True); time.sleep(60)"
    with child(code) as p:
        assert p.stdout is not None and p.stdout.readline() == b"held\n"
        assert p.pid in procfs.flock_holders(ino)
        with open(lock) as f, pytest.raises(BlockingIOError):
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the kernel agrees it is held
    await until(lambda: p.pid not in procfs.flock_holders(ino), "the lock to go with its holder")


def test_meminfo_and_ptrace_scope_are_the_kernels() -> None:
    mem = procfs.meminfo()
    assert mem["MemTotal"] == psutil.virtual_memory().total
    assert 0 < mem["MemAvailable"] <= mem["MemTotal"]
    scope = Path("/proc/sys/kernel/yama/ptrace_scope")
    assert procfs.ptrace_scope() == (scope.read_text().strip() if scope.exists() else None)
    assert procfs.meminfo(proc="/nonexistent") == {} and procfs.ptrace_scope(proc="/nonexistent") is None


def direct_proc_reads(root: Path) -> list[str]:
    """String literals in code (docstrings and raised messages aside) that begin with /proc, in
    every module but linux/procfs.py and runtime/."""
    out = []
    for path in sorted((root / "krex_async").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel == "krex_async/linux/procfs.py" or rel.startswith("krex_async/runtime/"):
            continue
        tree = ast.parse(path.read_text())
        skip: set[int] = set()
        for node in ast.walk(tree):
            body = getattr(node, "body", None)
            if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
                skip.add(id(body[0].value))  # a docstring
            if isinstance(node, ast.Raise) or isinstance(node, ast.JoinedStr):
                skip.update(id(n) for n in ast.walk(node) if n is not node)  # a message, an f-string's parts
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            first = node.values[0] if isinstance(node, ast.JoinedStr) and node.values else node
            if (
                isinstance(first, ast.Constant)
                and isinstance(first.value, str)
                and first.value.startswith("/proc")
            ):
                out.append(f"{rel}:{node.lineno}")
    return out


def test_no_module_reads_proc_but_procfs() -> None:
    """There were 40 such literals in 19 modules (three readings of a start time among them)."""
    assert direct_proc_reads(ROOT) == []
