"""A full disk under the daemon's log: logging must never stop the daemon from serving.

The daemon keeps command output in memory (bounded tails, no spooling), so its only writes are its
log lines. Here the log is a file under a 4 KiB RLIMIT_FSIZE with SIGXFSZ ignored, so every write past
the limit fails with EFBIG, which is what a full file system (ENOSPC) looks like to the daemon.
"""

from __future__ import annotations

import asyncio
import os
import resource
import shutil
import signal
import subprocess
import tempfile
import time

import pytest

import krex_async.logs as logs
from krex_async import Client

from ..conftest import PY, py_env


def _small_files() -> None:
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))


@pytest.mark.xfail(not hasattr(logs, "dropped_lines"), strict=True,
                   reason="logs.py lets a failed log write raise into the handlers (fix in report)")
async def test_daemon_keeps_serving_when_its_log_cannot_be_written():
    d = tempfile.mkdtemp(prefix="krexd-", dir="/tmp")
    sock = os.path.join(d, "s")
    old = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # inherited through exec: writes get EFBIG
    try:
        with open(os.path.join(d, "log"), "wb") as log:
            proc = subprocess.Popen([PY, "-m", "krex_async", "serve", "--socket", sock,
                                     "--log-format", "json", "--isolation", "signal",
                                     "--state-dir", os.path.join(d, "st")],
                                    stdout=log, stderr=subprocess.STDOUT, env=py_env(),
                                    preexec_fn=_small_files)
    finally:
        signal.signal(signal.SIGXFSZ, old)
    try:
        deadline = time.monotonic() + 20
        while not os.path.exists(sock):
            assert proc.poll() is None and time.monotonic() < deadline
            await asyncio.sleep(0.02)
        async with await Client.connect(sock) as c:
            for i in range(40):  # ~1 KiB of log per command: the limit is passed by the 5th
                res = await asyncio.wait_for(c.run(["echo", str(i)]), 5)
                assert res.stdout == f"{i}\n".encode()
        assert os.path.getsize(os.path.join(d, "log")) <= 4096
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(d, ignore_errors=True)
