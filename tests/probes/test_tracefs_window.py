"""The tracefs backend's counts are what its reader has parsed, not kernel-side: a region must not be
closed on them while the reader lags (real daemon, --probes tracefs, root).

A process outside krex holds the device (opened before the daemon, so the first scan finds it).
While a command holds its region, the outsider makes a burst of ioctls, and the region is released
right after it: the lines are then still in the instance's buffer, or being parsed. Every one of
them is a stray, and the report must count them all (or be tainted), never come back short and
clean. Before the release settled the reader, it came back clean with 288-720 of 3000.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

from ..conftest import PY, py_env, run_daemon
from .conftest import need_root
from .test_tracefs import need_tracefs

N = 3000

OUTSIDER = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR)
print(os.getpid(), flush=True)
sys.stdin.readline()
for _ in range(int(sys.argv[2])):
    try:
        fcntl.ioctl(fd, 0x5401, b"")
    except OSError:
        pass
print("done", flush=True)
sys.stdin.readline()
"""

OWNER = """
import os, sys, time
from krex_async import region
inside, done = sys.argv[1:3]
with region("calm"):
    time.sleep(0.05)
with region("timing"):
    open(inside, "w").close()
    while not os.path.exists(done):
        time.sleep(0.0005)
"""


async def wait_file(path: str, timeout: float = 30) -> None:
    end = time.monotonic() + timeout
    while not os.path.exists(path):
        assert time.monotonic() < end, f"{path} never appeared"
        await asyncio.sleep(0.005)


async def test_strays_just_before_the_release_are_all_counted(devdir, script, tmp_path):
    need_root()
    need_tracefs()
    owner = script("owner.py", OWNER)
    inside, done = str(tmp_path / "inside"), str(tmp_path / "done")
    out = subprocess.Popen(
        [sys.executable, "-c", OUTSIDER, f"{devdir}/null0", str(N)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert out.stdin is not None and out.stdout is not None
    try:
        pid = int(out.stdout.readline())
        async with run_daemon("--probes", "tracefs", "--probe-prefixes", devdir + "/") as d:
            async with await d.client() as c:
                h = await c.submit([PY, owner, inside, done], env=py_env())
                await wait_file(inside)
                out.stdin.write("go\n")
                out.stdin.flush()
                assert await asyncio.to_thread(out.stdout.readline) == "done\n"
                open(done, "w").close()  # the owner releases at once
                res = await h.wait()
    finally:
        out.kill()
        out.wait()
    assert res.returncode == 0, res.stderr
    calm, rep = res.report.regions
    assert not calm.tainted and calm.strays == 0, calm  # settling is not tainting
    # Tainted only if the reader could not catch up within attribution.SETTLE_S (CPU starved).
    assert rep.tainted or (rep.strays == N and rep.stray_pids == [pid]), rep
