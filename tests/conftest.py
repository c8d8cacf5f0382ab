"""Fixtures: a real daemon in a subprocess on a short socket path, and helpers to script commands."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from krex_async import Client

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


@contextlib.asynccontextmanager
async def run_daemon(*args: str, env: dict[str, str] | None = None) -> AsyncIterator[Daemon]:
    """Start `python -m krex_async serve` on a fresh short socket path; stop it (SIGTERM) after.

    AF_UNIX paths stop near 108 bytes, so the socket lives in a short temporary directory.
    """
    d = tempfile.mkdtemp(prefix="krex-", dir="/tmp")
    sock = os.path.join(d, "s")
    log = Path(d) / "daemon.log"
    e = dict(os.environ, **(env or {}))
    e.pop("KREX_SOCKET", None)
    e["PYTHONPATH"] = str(ROOT) + os.pathsep + e.get("PYTHONPATH", "")
    with open(log, "wb") as f:
        proc = subprocess.Popen([PY, "-m", "krex_async", "serve", "--socket", sock,
                                 "--log-format", "json", "--state-dir", os.path.join(d, "state"),
                                 *args], stdout=f, stderr=subprocess.STDOUT, env=e)
    daemon = Daemon(sock, proc, log)
    try:
        deadline = time.monotonic() + 20
        while not os.path.exists(sock):
            if proc.poll() is not None:
                raise RuntimeError(f"daemon exited {proc.returncode}: {daemon.logs()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"daemon did not start: {daemon.logs()}")
            time.sleep(0.02)
        yield daemon
    finally:
        try:
            daemon.stop()
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def script(tmp_path: Path) -> Iterator[object]:
    """script(name, source) writes a dedented Python file and returns its path."""

    def make(name: str, source: str) -> str:
        p = tmp_path / name
        p.write_text(textwrap.dedent(source))
        return str(p)

    yield make


def py_env(**extra: str) -> dict[str, str]:
    """The environment for commands: this interpreter's, with the package importable."""
    e = dict(os.environ)
    e.pop("KREX_SOCKET", None)
    e["PYTHONPATH"] = str(ROOT) + os.pathsep + e.get("PYTHONPATH", "")
    e.update(extra)
    return e


def proc_state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    return data[data.rindex(b")") + 2:].split()[0].decode()


def is_root() -> bool:
    return os.geteuid() == 0
