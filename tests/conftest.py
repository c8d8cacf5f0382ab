"""Fixtures: a real daemon in a subprocess on a short socket path, and helpers to script commands."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import pytest

from krex_async import Client
from krex_async.linux.procfs import stat_fields

from . import testcgroups

PY = sys.executable
ROOT = Path(__file__).resolve().parent.parent


class Daemon:
    def __init__(self, socket: str, proc: subprocess.Popen[bytes], log: Path) -> None:
        self.socket = socket
        self.proc = proc
        self.log = log

    async def client(self) -> Client:
        return await Client.connect(self.socket)

    def logs(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout)


def v2_mount() -> str | None:
    """Where cgroup v2 is mounted (pure v2 at /sys/fs/cgroup, hybrid at /sys/fs/cgroup/unified)."""
    for path in ("/sys/fs/cgroup/unified", "/sys/fs/cgroup"):
        if os.path.exists(os.path.join(path, "cgroup.procs")) and os.path.exists(
            os.path.join(path, "cgroup.subtree_control")
        ):
            return path
    return None


def private_cgroup_root() -> str | None:
    """As root, a fresh v2 cgroup for one daemon, so daemons of concurrent tests (and sessions) never
    reconcile each other's command cgroups; named after this process (testcgroups.py). None where
    the cgroup backend cannot run."""
    mount = v2_mount()
    if os.geteuid() != 0 or mount is None:
        return None
    path = tempfile.mkdtemp(prefix=testcgroups.prefix(), dir=mount)
    return path


def pytest_sessionstart(session: pytest.Session) -> None:
    """Remove the test cgroups that killed runs left (their pytest process is gone, nothing is in
    them); a run still going elsewhere keeps its own.

    A run started in the background of a script (`scripts/test.sh > log &`) has SIGINT ignored, as
    POSIX has a non-interactive shell do: every process the tests start would inherit that, and the
    tests of what Ctrl-C does (a verb, `krex serve`, the demo, --watch) would test nothing. The
    tests run as from a terminal: Python's own SIGINT handler, which the processes they start get
    back as the default."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if os.geteuid() == 0:
        session.config.stash[_SWEPT] = testcgroups.sweep_leftovers(min_age_s=testcgroups.SESSION_MIN_AGE_S)


def pytest_report_header(config: pytest.Config) -> str | None:
    swept = config.stash.get(_SWEPT, [])
    return f"krex: removed {len(swept)} test cgroup(s) left by runs that died" if swept else None


_SWEPT = pytest.StashKey[list[str]]()


def remove_cgroup_tree(path: str) -> None:
    """rmdir a cgroup tree leaf first (cgroup directories hold only kernel files)."""
    for top in [path] + [path.replace("/unified/", "/cpuset/", 1)] if "/unified/" in path else [path]:
        if not os.path.isdir(top):
            continue
        for dirpath, _dirnames, _ in sorted(os.walk(top), key=lambda t: -t[0].count("/")):
            with contextlib.suppress(OSError):
                os.rmdir(dirpath)


@contextlib.contextmanager
def serving(daemon: Daemon, timeout: float = 20) -> Iterator[Daemon]:
    """Wait until the daemon's socket appears (its process failing first is an error with its
    log), yield it, then stop it: SIGTERM, SIGKILL if it does not end in time."""
    try:
        deadline = time.monotonic() + timeout
        while not os.path.exists(daemon.socket):
            if daemon.proc.poll() is not None:
                raise RuntimeError(f"daemon exited {daemon.proc.returncode}: {daemon.logs()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"daemon did not start: {daemon.logs()}")
            time.sleep(0.02)
        yield daemon
    finally:
        try:
            daemon.stop()
        except subprocess.TimeoutExpired:
            daemon.proc.kill()
            daemon.proc.wait()


def stop_all(procs: list[subprocess.Popen[bytes]], grace: float = 15) -> None:
    """Stop each process still running: SIGTERM, then SIGKILL if it has not ended in `grace` s."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
            try:
                p.wait(grace)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


async def until(
    check: Callable[[], object], what: str | Callable[[], str], timeout: float = 60.0, step: float = 0.01
) -> float:
    """Seconds until `check()` held, polled every `step`; AssertionError after `timeout`, naming
    `what` (a text, or a function that makes it then: a costly or changing description)."""
    t0 = time.monotonic()
    while not check():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"not within {timeout:g} s: {what if isinstance(what, str) else what()}")
        await asyncio.sleep(step)
    return time.monotonic() - t0


async def until_async(check: Callable[[], Awaitable[bool]], what: str, timeout: float = 60.0) -> None:
    """until for an async check: poll until it holds, AssertionError after `timeout`."""
    t0 = asyncio.get_running_loop().time()
    while not await check():
        assert asyncio.get_running_loop().time() - t0 < timeout, f"not within {timeout:g} s: {what}"
        await asyncio.sleep(0.05)


def cmdline(pid: int | str) -> bytes:
    """A process's /proc cmdline (NUL-separated argv); b"" for one gone, or a /proc entry that is
    not a pid ("self", "sys", ...)."""
    if not str(pid).isdigit():
        return b""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


@contextlib.asynccontextmanager
async def run_daemon(
    *args: str, env: dict[str, str] | None = None, python: str = PY
) -> AsyncIterator[Daemon]:
    """Start `python -m krex_async serve` on a fresh short socket path; stop it (SIGTERM) after.

    AF_UNIX paths stop near 108 bytes, so the socket lives in a short temporary directory. As root,
    each daemon gets its own cgroup root (`--cgroup-root`), unless the test passes one or picks the
    signal backend.
    """
    cg = None
    if "--cgroup-root" not in args and "signal" not in args:
        cg = private_cgroup_root()
        if cg is not None:
            args = (*args, "--cgroup-root", cg)
    if "--probes" not in args:
        args = (*args, "--probes", "off")  # each test that wants probes asks for them
    d = tempfile.mkdtemp(prefix="krex-", dir="/tmp")
    sock = os.path.join(d, "s")
    log = Path(d) / "daemon.log"
    e = dict(env) if env is not None else py_env()
    e.pop("KREX_SOCKET", None)
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            [
                python,
                "-m",
                "krex_async",
                "serve",
                "--socket",
                sock,
                "--log-format",
                "json",
                "--state-dir",
                os.path.join(d, "state"),
                *args,
            ],
            stdout=f,
            stderr=subprocess.STDOUT,
            env=e,
        )
    try:
        with serving(Daemon(sock, proc, log)) as daemon:
            yield daemon
    finally:
        shutil.rmtree(d, ignore_errors=True)
        if cg is not None:
            remove_cgroup_tree(cg)


@pytest.fixture
def script(tmp_path: Path) -> Iterator[object]:
    """script(name, source) writes a dedented Python file and returns its path."""

    def make(name: str, source: str) -> str:
        p = tmp_path / name
        p.write_text(textwrap.dedent(source))
        return str(p)

    yield make


@contextlib.contextmanager
def open_tmpdir(prefix: str, mode: int) -> Iterator[Path]:
    """A fresh directory under /tmp with `mode`, for other users (pytest's tmp_path is under a 0700
    directory of root's), short enough for socket paths; removed with what is in it."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    path.chmod(mode)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def py_env(**extra: str) -> dict[str, str]:
    """The environment for commands: this interpreter's, with the package importable."""
    e = dict(os.environ)
    e.pop("KREX_SOCKET", None)
    e["PYTHONPATH"] = str(ROOT) + os.pathsep + e.get("PYTHONPATH", "")
    e.update(extra)
    return e


async def krex_status(socket: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """`krex status` (plain text) against the daemon at `socket`, run as a user would run it."""
    return await asyncio.to_thread(
        subprocess.run,
        [PY, "-m", "krex_async", "status", "--socket", socket],
        capture_output=True,
        text=True,
        env=env,
        timeout=30,
    )


def is_frozen(pid: int) -> bool:
    """Stopped by a signal (state T) or by the cgroup v2 freezer (its cgroup reads `frozen 1`)."""
    if proc_state(pid) in ("T", "t"):
        return True
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            rel = next(line.split(":", 2)[2].strip() for line in f if line.startswith("0::"))
    except (OSError, StopIteration):
        return False
    mount = v2_mount()
    try:
        with open(f"{mount}{rel}/cgroup.events") as f:
            return "frozen 1" in f.read()
    except OSError:
        return False


def proc_state(pid: int) -> str | None:
    fields = stat_fields(pid)
    return None if fields is None else fields[0].decode()


def thread_names(pid: int | str = "self") -> list[str]:
    """The comm of every thread of `pid` (named threads show there, as in `top -H`)."""
    names = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            pass
    return names


def is_root() -> bool:
    return os.geteuid() == 0
