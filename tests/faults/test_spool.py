"""Output spooling on its normal path: the spool file holds exactly what the command wrote (binary, no
trailing newline, past the in-memory tail), --spool-limit is honoured and counted, the file belongs
to the submitter with mode 0600, and it is removed with the command's record when retention ends."""

from __future__ import annotations

import asyncio
import hashlib
import os
import stat
import time

from krex_async import Client

from ..conftest import PY, py_env, run_daemon

# ~3 MiB of every byte value in a pseudo-random order on stdout, a short binary stderr, no newline.
WRITER = """
import hashlib, sys
out = b"".join(hashlib.sha256(str(i).encode()).digest() for i in range(100_000))
for i in range(0, len(out), 70_001):
    sys.stdout.buffer.write(out[i:i + 70_001])
    sys.stdout.buffer.flush()
sys.stderr.buffer.write(b"\\x00\\xff\\r\\nerr\\x00")
"""
EXPECTED = b"".join(hashlib.sha256(str(i).encode()).digest() for i in range(100_000))


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


async def test_spool_file_holds_the_whole_output_byte_exact():
    async with run_daemon("--isolation", "signal", "--output-tail", "4096") as d:
        async with await d.client() as c:
            res = await c.run([PY, "-c", WRITER], env=py_env())
            rep = res.report
            assert rep.state == "exited" and rep.exit_code == 0, rep
            assert rep.spool_error == "" and rep.stdout_dropped == 0 and rep.stderr_dropped == 0
            assert rep.stdout_spool.endswith(f"/spool/{rep.command}.stdout")
            got = _read(rep.stdout_spool)
            assert len(got) == len(EXPECTED) == rep.stdout_bytes
            assert got == EXPECTED  # byte-exact, though the in-memory tail kept only 4 KiB
            assert _read(rep.stderr_spool) == b"\x00\xff\r\nerr\x00"
            st = os.stat(rep.stdout_spool)
            assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.geteuid()
            assert stat.S_IMODE(os.stat(os.path.dirname(rep.stdout_spool)).st_mode) == 0o711


async def test_spool_limit_is_honoured_and_the_rest_counted_as_dropped():
    async with run_daemon("--isolation", "signal", "--spool-limit", "1000") as d:
        async with await d.client() as c:
            res = await c.run(["sh", "-c", "head -c 5000 /dev/zero | tr '\\0' a; printf END"])
            rep = res.report
            assert rep.exit_code == 0 and rep.stdout_bytes == 5003
            assert _read(rep.stdout_spool) == b"a" * 1000
            assert rep.stdout_dropped == 4003 and rep.spool_error == ""
            assert res.stdout.endswith(b"aEND")  # the tail has the end the spool dropped


async def test_spool_limit_zero_turns_spooling_off():
    async with run_daemon("--isolation", "signal", "--spool-limit", "0") as d:
        async with await d.client() as c:
            res = await c.run(["echo", "hi"])
            assert res.stdout == b"hi\n"
            assert res.report.stdout_spool == "" and res.report.stderr_spool == ""


async def test_spool_file_and_record_are_removed_when_retention_ends():
    async with run_daemon("--isolation", "signal", "--retention", "1") as d:
        async with await d.client() as c:
            res = await c.run(["echo", "kept"])
        spool = res.report.stdout_spool
        state = os.path.dirname(os.path.dirname(spool))
        record = os.path.join(state, "commands", f"{res.report.command}.json")
        assert _read(spool) == b"kept\n" and os.path.exists(record)
        deadline = time.monotonic() + 5
        while os.path.exists(spool) or os.path.exists(res.report.stderr_spool) or os.path.exists(record):
            assert time.monotonic() < deadline, os.listdir(os.path.dirname(spool))
            await asyncio.sleep(0.05)
        async with await Client.connect(d.socket) as c:  # the daemon serves on
            assert (await c.run(["true"])).report.exit_code == 0
