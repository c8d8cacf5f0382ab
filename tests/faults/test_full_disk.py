"""A full disk under the daemon's writes: neither its log nor its output spool may stop it serving.

The log test puts the log under a 4 KiB RLIMIT_FSIZE with SIGXFSZ ignored, so every write past the
limit fails with EFBIG, which is what a full file system (ENOSPC) looks like to the daemon. The spool
test puts the state dir on a real 256 KiB tmpfs and has a command write 2 MiB.
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

from krex_async import Client

from ..conftest import PY, py_env, run_daemon


def _small_files() -> None:
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))


async def test_daemon_keeps_serving_when_its_log_cannot_be_written():
    d = tempfile.mkdtemp(prefix="krexd-", dir="/tmp")
    sock = os.path.join(d, "s")
    old = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # inherited through exec: writes get EFBIG
    try:
        with open(os.path.join(d, "log"), "wb") as log:
            proc = subprocess.Popen(
                [
                    PY,
                    "-m",
                    "krex_async",
                    "serve",
                    "--socket",
                    sock,
                    "--log-format",
                    "json",
                    "--isolation",
                    "signal",
                    "--state-dir",
                    os.path.join(d, "st"),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=py_env(),
                preexec_fn=_small_files,
            )
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


BIG = """
import sys
chunk = bytes(range(256)) * 256  # 64 KiB
for _ in range(32):
    sys.stdout.buffer.write(chunk)
    sys.stdout.buffer.flush()
sys.stdout.buffer.write(b"THE-END")
"""


async def test_full_spool_disk_keeps_the_command_and_the_daemon_going(small_tmpfs):
    state = os.path.join(small_tmpfs, "state")
    async with run_daemon("--isolation", "signal", "--state-dir", state, "--output-tail", "65536") as d:
        async with await d.client() as c:
            res = await asyncio.wait_for(c.run([PY, "-c", BIG], env=py_env()), 30)
            rep = res.report
            assert rep.state == "exited" and rep.exit_code == 0, rep
            assert rep.spool_error.startswith("stdout: ENOSPC"), rep.spool_error
            assert rep.stdout_bytes == 32 * 65536 + 7
            written = os.path.getsize(rep.stdout_spool)
            assert 0 < written < 256 * 1024 and rep.stdout_dropped == rep.stdout_bytes - written
            assert res.stdout.endswith(b"THE-END")  # streamed in full
            tail = (await (await c.attach(rep.command)).wait()).stdout  # the daemon's memory tail
            assert len(tail) == 65536 and tail.endswith(bytes(range(256)) + b"THE-END")
            # The next command is served normally (its own spool may find the disk full too).
            nxt = await asyncio.wait_for(c.run(["echo", "next"]), 10)
            assert nxt.stdout == b"next\n" and nxt.report.exit_code == 0
            # Space freed: spooling works again, byte-exact.
            os.unlink(rep.stdout_spool)
            again = await asyncio.wait_for(c.run(["sh", "-c", "head -c 40000 /dev/zero; printf x"]), 10)
            assert again.report.spool_error == "", again.report.spool_error
            with open(again.report.stdout_spool, "rb") as f:
                assert f.read() == bytes(40000) + b"x"
        assert d.proc.poll() is None
        failures = [line for line in d.logs().splitlines() if "spool_failed" in line and rep.command in line]
        assert len(failures) == 1, failures  # logged once, not once per write
