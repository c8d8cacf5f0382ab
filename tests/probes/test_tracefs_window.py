"""The tracefs backend's counts are what its reader has parsed, not kernel-side: a region must not be
closed on them while the reader lags (real daemon, --probes tracefs, root).

A process outside krex holds the device (opened before the daemon, so the first scan finds it).
While a command holds its region, the outsider makes a burst of ioctls, and the region is released
right after it: the lines are then still in the instance's buffer, or being parsed. Every one of
them is a stray, and the report must count them all (or be tainted), never come back short and
clean. Before the release settled the reader, it came back clean with 288-720 of 3000; before the
release kept its window watched while it settled, 2998 of 3000 under load (the snapshot of the
counts at the start came after the first two strays, and the last batches went to no region).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

from krex_async.daemon.observe.attribution import Attributor
from krex_async.daemon.observe.metrics import Metrics
from krex_async.probes.base import ProbeEvent
from krex_async.probes.tracefs import TracefsProbe
from krex_async.protocol import RegionReport

from ..conftest import PY, py_env, run_daemon, until
from .conftest import need_root
from .test_tracefs import need_tracefs

N = 3000

OUTSIDER = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR)
print(os.getpid(), flush=True)
for line in sys.stdin:  # each line: how many ioctls to make [and after each how many a 0.5 ms nap]
    n, pace = (list(map(int, line.split())) + [0])[:2]
    for i in range(n):
        try:
            fcntl.ioctl(fd, 0x5401, b"")
        except OSError:
            pass
        if pace and i % pace == 0:
            time.sleep(0.0005)
    print("done", flush=True)
"""


class Outsider:
    """A process outside krex that holds the device and makes bursts of ioctls when told."""

    def __init__(self, devdir: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", OUTSIDER, f"{devdir}/null0"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.stdin, self.stdout = self.proc.stdin, self.proc.stdout
        self.pid = int(self.stdout.readline())

    def start(self, n: int, pace: int = 0) -> None:
        """Make `n` ioctls, napping 0.5 ms after every `pace` of them (0: none)."""
        self.stdin.write(f"{n} {pace}\n")
        self.stdin.flush()

    def burst(self, n: int) -> None:
        """Make `n` ioctls; returns when they are made (in the kernel's buffer)."""
        self.start(n)
        assert self.stdout.readline() == "done\n"

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


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
    out = Outsider(devdir)
    try:
        async with run_daemon("--probes", "tracefs", "--probe-prefixes", devdir + "/") as d:
            async with await d.client() as c:
                h = await c.submit([PY, owner, inside, done], env=py_env())
                await wait_file(inside)
                out.start(N)
                assert await asyncio.to_thread(out.stdout.readline) == "done\n"
                open(done, "w").close()  # the owner releases at once
                res = await h.wait()
    finally:
        out.kill()
    assert res.returncode == 0, res.stderr
    calm, rep = res.report.regions
    assert not calm.tainted and calm.strays == 0, calm  # settling is not tainting
    # Tainted only if the reader could not catch up within attribution.SETTLE_S (CPU starved).
    assert rep.tainted or (rep.strays == N and rep.stray_pids == [out.pid]), rep


async def test_a_late_snapshot_and_the_last_batches_still_count_every_stray(devdir):
    """The daemon's race, made deterministic on the real reader and attributor: the counts'
    snapshot at the start is taken after K strays were parsed (the loop was slow to get to it),
    and the release finds the last N parsed but not yet handed to the loop. The stream then has
    them all, the counts' difference only N: the release must hand the last batches to the
    region it is closing, and report K + N."""
    need_tracefs()
    k, n = 7, 500
    probe = TracefsProbe([devdir + "/"], rescan_s=0.2)
    report = RegionReport(region="r1", name="timing", device="cpu", pid=os.getpid(), policy="region")
    region = SimpleNamespace(id="r1", device="cpu", command=None, report=report)
    core = SimpleNamespace(commands={}, pools={})  # the outsider is in no command and no pool
    regions = SimpleNamespace(get={region.id: region}.get, choosing=list)
    att = Attributor(core, regions, probe, Metrics())  # type: ignore[arg-type]
    out = Outsider(devdir)
    try:
        probe.start(asyncio.get_running_loop(), att.on_events)
        await until(lambda: out.pid in {t for t, _ in probe.fd_paths}, "a scan found the outsider")
        att.region_granted(region)  # type: ignore[arg-type]
        out.burst(k)
        await until(lambda: probe.counts().get(out.pid) == k, "the reader parsed the first strays")
        att.counts_snapshot(region)  # type: ignore[arg-type]  # late: the first K are in it
        out.burst(n)
        # The reader parses them off the loop; the loop runs nothing until the release, so their
        # batches wait for it (a settle on another thread hands nothing over).
        settler = threading.Thread(target=probe.settle, args=(10.0,))
        settler.start()
        settler.join()
        assert probe.counts()[out.pid] == k + n, probe.counts()
        att.region_released(region)  # type: ignore[arg-type]
    finally:
        probe.stop()
        out.kill()
    assert not report.tainted, report
    assert (report.strays, report.stray_pids) == (k + n, [out.pid]), report


async def test_an_outsiders_ioctls_after_the_window_closed_are_not_its_strays(devdir):
    """The outsider goes on making ioctls while the region is released: those stamped after its
    window closed are not its strays. The region counts exactly the ones its stream saw in the
    window; compared with the reader's counts too (which take in every line parsed by the
    release's settle, later ones as well), it came back with more."""
    need_tracefs()
    probe = TracefsProbe([devdir + "/"], rescan_s=0.2)
    report = RegionReport(region="r1", name="timing", device="cpu", pid=os.getpid(), policy="region")
    region = SimpleNamespace(id="r1", device="cpu", command=None, report=report)
    core = SimpleNamespace(commands={}, pools={})
    regions = SimpleNamespace(get={region.id: region}.get, choosing=list)
    att = Attributor(core, regions, probe, Metrics())  # type: ignore[arg-type]
    seen: list[ProbeEvent] = []
    out = Outsider(devdir)
    latest = [0]  # the newest stamp of the outsider's ioctls parsed so far

    def on_events(batch: list[ProbeEvent]) -> None:
        seen.extend(batch)
        latest[0] = max([latest[0]] + [e.ts_ns for e in batch if e.tgid == out.pid])
        att.on_events(batch)

    try:
        probe.start(asyncio.get_running_loop(), on_events)
        await until(lambda: out.pid in {t for t, _ in probe.fd_paths}, "a scan found the outsider")
        att.region_granted(region)  # type: ignore[arg-type]
        att.counts_snapshot(region)  # type: ignore[arg-type]
        watch = att.watches[region.id]
        out.start(10**9, pace=10)  # until killed, at a rate the reader keeps up with
        await until(lambda: probe.counts().get(out.pid, 0) >= 200, "the reader parsed the first strays")
        att.region_released(region)  # type: ignore[arg-type]  # while the outsider goes on
        assert watch.until_ns is not None
        until_ns = watch.until_ns
        await until(lambda: latest[0] >= until_ns, "the reader parsed an ioctl made after the release")
        out.kill()
        later = probe.settle(10.0)
    finally:
        probe.stop()
        out.kill()
    assert later and not report.tainted, report
    inside = [e for e in seen if e.tgid == out.pid and watch.since_ns <= e.ts_ns < watch.until_ns]
    after = [e for e in seen if e.tgid == out.pid and e.ts_ns >= watch.until_ns]
    assert after, "the outsider's ioctls all came before the release: nothing to tell apart"
    assert report.strays == len(inside), (report.strays, len(inside), len(after))
