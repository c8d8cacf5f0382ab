"""The bcc backend's poll thread failing at runtime: reported once, nothing leaked.

No outside process can break a loaded BPF program's perf-event attachment, so the failure is made
in-process, for real: the ring buffer's mapping the poll thread reads is unmapped under it (its
next read raises, as a reader bug or a broken mapping would). The daemon-side handling of the same
report is tests/faults/test_probe_failure.py.
"""

from __future__ import annotations

import asyncio
import os

from krex_async.probes.bpf_ioctl import IoctlProbe

from ..conftest import thread_names
from .conftest import Collector, need_bcc, run_child


async def test_poll_thread_failure_is_reported_once_and_stop_releases_everything(devdir):
    need_bcc()
    fds_before = sorted(os.listdir("/proc/self/fd"))
    probe = IoctlProbe([devdir + "/"], rescan_s=0)
    reasons: list[str] = []
    probe.on_failure = reasons.append
    col = Collector(probe)
    col.start()
    try:
        dev = f"{devdir}/null0"
        info = await asyncio.to_thread(run_child, dev, 5, 0)
        assert await col.wait_for(lambda: len(col.of(info["pid"])) >= 6)  # open + 5 ioctls
        assert probe.poller is not None and probe.poller.alive()
        assert await col.wait_for(lambda: "krex-probe-bcc-" in thread_names()), thread_names()
        assert probe.failure is None and reasons == []

        ring = probe.poller._mm
        assert ring is not None, "the mmap reader is the default on x86-64"
        ring.close()  # unmapped under the poll thread: its next read fails
        await asyncio.to_thread(run_child, dev, 3, 0)
        assert await col.wait_for(lambda: bool(reasons)), "the failure was never reported"
        await asyncio.sleep(0.1)
        assert len(reasons) == 1, reasons
        assert "poll thread failed" in reasons[0] and probe.failure == reasons[0]
        assert not probe.poller.alive()
        assert probe.counts().get(info["pid"]) == 6  # the kernel-side counts still answer
    finally:
        probe.stop()
        probe.stop()  # a second stop (daemon shutdown after the failure) is harmless
    assert "krex-probe-bcc-" not in thread_names()
    assert sorted(os.listdir("/proc/self/fd")) == fds_before, "fds leaked (maps, perf events)"
