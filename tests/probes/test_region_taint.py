"""Lost events taint the region they happened in, through a real daemon (--probes ioctl).

The owner floods its own device fd with ioctls inside a region: far more than the 65536-record ring
holds, faster than the reader drains (about 1 us per ioctl against several us per event to decode
and attribute), so reservations fail in the BPF program and are counted. Its own ioctls are never
strays; the region must still come back `tainted`, and probes stay `running` (loss is not failure).
"""

from __future__ import annotations

import os

from ..conftest import PY, py_env, run_daemon
from .conftest import need_bcc

FLOOD = """
import fcntl, os, sys
from krex_async import region
fd = os.open(sys.argv[1], os.O_RDWR)
def burst(n):
    for _ in range(n):
        try:
            fcntl.ioctl(fd, 0x5401, b"")
        except OSError:
            pass
with region("calm"):
    burst(100)
with region("flood"):
    burst(int(sys.argv[2]))
"""


async def test_a_region_during_which_events_were_lost_is_tainted(devdir, script):
    need_bcc()
    owner = script("flood.py", FLOOD)
    async with run_daemon("--probes", "ioctl", "--probe-prefixes", devdir + "/") as d:
        async with await d.client() as c:
            res = await c.run([PY, owner, f"{devdir}/null0", "400000"], env=py_env())
            probes = (await c.status())["probes"]
    assert res.returncode == 0, res.stderr
    calm, flood = res.report.regions
    assert not calm.tainted and calm.strays == 0, calm
    assert flood.tainted, flood
    assert flood.strays == 0, flood  # the owner's own ioctls, lost or not, are not strays
    assert probes["state"] == "running", probes
    assert os.path.exists(f"{devdir}/null0")
