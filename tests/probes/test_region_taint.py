"""Lost events taint the region they happened in, through a real daemon (--probes ioctl).

Deterministic loss: while the owner holds its region, the test stops the daemon (SIGSTOP: its ring
reader is starved, as CPU contention would starve it, only completely), and the owner makes more
ioctls than the 262144-record ring holds. The BPF program runs in the owner's syscalls regardless,
so at least 300000 - 262144 reservations fail and are counted. After SIGCONT the region's release
must come back `tainted`, though none of the events was a stray; a region before it comes back
clean, and the probes stay `running` (loss is not failure).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

from ..conftest import PY, py_env, run_daemon
from .conftest import need_bcc

FLOOD = """
import fcntl, os, sys, time
from krex_async import region
dev, n, inside, go, flooded = sys.argv[1], int(sys.argv[2]), *sys.argv[3:6]
fd = os.open(dev, os.O_RDWR)
def burst(n):
    for _ in range(n):
        try:
            fcntl.ioctl(fd, 0x5401, b"")
        except OSError:
            pass
with region("calm"):
    burst(100)
with region("flood"):
    open(inside, "w").close()
    while not os.path.exists(go):
        time.sleep(0.01)
    burst(n)
    open(flooded, "w").close()
"""


async def wait_file(path: str, timeout: float = 30) -> None:
    end = time.monotonic() + timeout
    while not os.path.exists(path):
        assert time.monotonic() < end, f"{path} never appeared"
        await asyncio.sleep(0.01)


async def test_a_region_during_which_events_were_lost_is_tainted(devdir, script, tmp_path):
    need_bcc()
    owner = script("flood.py", FLOOD)
    inside, go, flooded = (str(tmp_path / n) for n in ("inside", "go", "flooded"))
    async with run_daemon("--probes", "ioctl", "--probe-prefixes", devdir + "/") as d:
        async with await d.client() as c:
            h = await c.submit([PY, owner, f"{devdir}/null0", "300000", inside, go, flooded], env=py_env())
            await wait_file(inside)
            os.kill(d.proc.pid, signal.SIGSTOP)
            try:
                open(go, "w").close()
                await wait_file(flooded, 60)
            finally:
                os.kill(d.proc.pid, signal.SIGCONT)
            res = await h.wait()
            probes = (await c.status())["probes"]
    assert res.returncode == 0, res.stderr
    calm, flood = res.report.regions
    assert not calm.tainted and calm.strays == 0, calm
    assert flood.tainted, flood
    assert flood.strays == 0, flood  # the owner's own ioctls, lost or not, are not strays
    assert probes["state"] == "running", probes
