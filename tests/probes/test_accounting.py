"""counted == delivered + lost, also across stop() while events are still being made (root, bcc).

A child floods the device with ioctls; the probe is stopped in the middle of it. After stop() (and
the batches it handed to the loop have run), every event the kernel side counted must have been
delivered or counted as lost: the final counts and lost must describe the same instant as the last
records drained. Before the fix: counted 25563, delivered 67597 (the counts were read before the
final drain, while the programs were still attached).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys

from krex_async.probes.bpf_ioctl import IoctlProbe

from .conftest import Collector, need_bcc

FLOOD = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR)
print(os.getpid(), flush=True)
while True:
    try:
        fcntl.ioctl(fd, 0x5401, b"")
    except OSError:
        pass
"""


async def test_counts_equal_delivered_plus_lost_after_stop_during_a_flood(devdir: str) -> None:
    need_bcc()
    for _ in range(2):  # each stop must balance
        probe = IoctlProbe([devdir + "/"])
        col = Collector(probe)
        col.start()
        child = subprocess.Popen(
            [sys.executable, "-c", FLOOD, f"{devdir}/null0"], stdout=subprocess.PIPE, text=True
        )
        try:
            assert child.stdout is not None
            pid = int(child.stdout.readline())
            assert await col.wait_for(lambda: len(col.of(pid)) > 2000)  # noqa: B023 - awaited here
            probe.stop()
            await asyncio.sleep(0.05)  # the last batches run on the loop
        finally:
            child.kill()
            child.wait()
            probe.stop()
        counted = probe.counts()[pid]
        delivered = len(col.of(pid))
        assert counted == delivered + probe.lost(), (counted, delivered, probe.lost())
