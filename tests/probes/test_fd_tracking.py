"""The ioctl probe's (tgid, fd) tracking against what real processes do to their fds (root, bcc):
dup2/dup3 onto a tracked number, dup and F_DUPFD of a tracked fd, execve closing O_CLOEXEC fds.

A stale entry (a number that no longer names a device file) turns the process's ordinary ioctls
(terminal, socket) into GPU events: false strays. A missing one (a copy the BPF side did not follow)
hides real device activity: missed strays.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap

from krex_async.probes.bpf_ioctl import IoctlProbe

from .conftest import Collector, need_bcc

PRELUDE = textwrap.dedent("""
    import fcntl, os, sys
    def io(fd, n=1):
        for _ in range(n):
            try: fcntl.ioctl(fd, 0x5401, bytes(64))
            except OSError: pass
    dev = sys.argv[1]
""")


def run(code: str, *args: str) -> list[int]:
    out = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(code), *args],
                         capture_output=True, text=True, check=True, timeout=30).stdout
    return [int(x) for x in out.split()]


async def settle(col: Collector, pid: int, n: int) -> None:
    await col.wait_for(lambda: len(col.of(pid)) >= n, timeout=3)
    await asyncio.sleep(0.2)  # anything more that would (wrongly) come


async def test_dup2_onto_a_tracked_fd_untracks_it_at_once(devdir: str) -> None:
    need_bcc()
    probe = IoctlProbe([devdir + "/"], rescan_s=0)  # no rescan: the BPF side alone must be right
    col = Collector(probe)
    col.start()
    try:
        pid, fd, fd3 = run("""
            fd = os.open(dev, os.O_RDWR); io(fd)
            os.dup2(os.open("/dev/null", os.O_RDWR), fd); io(fd, 5)    # now /dev/null
            fd3 = os.open(dev, os.O_RDWR)
            os.dup2(os.open("/dev/null", os.O_RDWR), fd3, inheritable=False); io(fd3, 5)  # dup3
            print(os.getpid(), fd, fd3)
        """, f"{devdir}/null0")
        await settle(col, pid, 3)
    finally:
        probe.stop()
    assert [(e.kind, e.fd) for e in col.of(pid)] == [("open", fd), ("ioctl", fd), ("open", fd3)]
    assert probe.counts()[pid] == 3


async def test_dup_and_fdupfd_of_a_tracked_fd_are_tracked(devdir: str) -> None:
    need_bcc()
    probe = IoctlProbe([devdir + "/"], rescan_s=0)
    col = Collector(probe)
    col.start()
    try:
        pid, a, b, c, d = run("""
            a = os.open(dev, os.O_RDWR)
            b = os.dup(a); c = fcntl.fcntl(a, fcntl.F_DUPFD, 40)
            d = fcntl.fcntl(a, fcntl.F_DUPFD_CLOEXEC, 50)
            os.close(a); io(b, 2); io(c, 3); io(d, 4)
            print(os.getpid(), a, b, c, d)
        """, f"{devdir}/null0")
        await settle(col, pid, 10)
    finally:
        probe.stop()
    evs = col.of(pid)
    assert [(e.kind, e.fd) for e in evs] == [("open", a)] + [("ioctl", b)] * 2 + \
        [("ioctl", c)] * 3 + [("ioctl", d)] * 4
    assert all(e.name == "TCGETS" for e in evs[1:])
    assert probe.counts()[pid] == 10
