"""Fixtures for the probe tests: a private device node under a unique prefix, child processes that
make known ioctls on it, and skips (with the reason) where root, bcc or tracefs are missing."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterator

import pytest

from krex_async.probes.base import ProbeBackend, ProbeEvent

TCGETS, FIONREAD = 0x5401, 0x541B

CHILD = textwrap.dedent("""
    import fcntl, json, os, sys, threading
    path, n_main, n_thread, wait = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    fd = os.open(path, os.O_RDWR)
    if wait != "0":
        print(json.dumps({"ready": fd}), flush=True)
        sys.stdin.readline()
    def burst(n, req):
        for _ in range(n):
            try:
                fcntl.ioctl(fd, req, bytes(64))
            except OSError:
                pass
    burst(n_main, 0x5401)
    box = {}
    def worker():
        box["tid"] = threading.get_native_id()
        burst(n_thread, 0x541B)
    t = threading.Thread(target=worker); t.start(); t.join()
    print(json.dumps({"pid": os.getpid(), "tid": threading.get_native_id(),
                      "thread_tid": box["tid"], "fd": fd}), flush=True)
    if wait == "2":  # stay alive until told (for attribution through /proc)
        sys.stdin.readline()
""")


def need_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root (eBPF, tracefs, mknod)")


def need_bcc() -> None:
    need_root()
    from krex_async.probes import bcc_works

    ok, why = bcc_works()
    if not ok:
        pytest.skip(f"bcc unavailable: {why} (run .ci/install-bcc.sh)")


@pytest.fixture
def devdir() -> Iterator[str]:
    """A fresh directory holding `null0`, a character device like /dev/null (1,3): ioctls on it fail
    with ENOTTY but are real syscalls. The prefix is unique, so no other process matches."""
    need_root()
    d = tempfile.mkdtemp(prefix="krexdev-", dir="/tmp")
    try:
        os.mknod(f"{d}/null0", 0o20666, os.makedev(1, 3))
    except OSError as e:
        shutil.rmtree(d, ignore_errors=True)
        pytest.skip(f"cannot mknod a device node in /tmp: {e}")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def run_child(path: str, n_main: int, n_thread: int) -> dict[str, int]:
    """Run CHILD to completion; returns its pid, tids and fd."""
    out = subprocess.run(
        [sys.executable, "-c", CHILD, path, str(n_main), str(n_thread), "0"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


class WaitingChild:
    """CHILD that opens the device, says ready, and makes its ioctls only when go() is called."""

    def __init__(self, path: str, n_main: int, n_thread: int, linger: bool = False) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, path, str(n_main), str(n_thread), "2" if linger else "1"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        self.fd = json.loads(self.proc.stdout.readline())["ready"]

    def go(self) -> dict[str, int]:
        """Let it make its ioctls; returns its report (it then exits, or lingers until kill())."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.communicate()


class Collector:
    """Starts a backend on the running loop and gathers its batches."""

    def __init__(self, backend: ProbeBackend) -> None:
        self.backend = backend
        self.events: list[ProbeEvent] = []
        self.batches = 0

    def _on(self, batch: list[ProbeEvent]) -> None:
        self.batches += 1
        self.events.extend(batch)

    def start(self) -> None:
        self.backend.start(asyncio.get_running_loop(), self._on)

    def of(self, tgid: int) -> list[ProbeEvent]:
        return [e for e in self.events if e.tgid == tgid]

    async def wait_for(self, pred: Callable[[], bool], timeout: float = 5.0) -> bool:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if pred():
                return True
            await asyncio.sleep(0.02)
        return pred()
