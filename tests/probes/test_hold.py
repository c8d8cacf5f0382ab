"""The probes' threads hold off while a region enters, and the count maps are read in one batch.

- Hold: a probe thread's wait() returns at once when no hold is on, blocks while one is, and goes
  on after max_s when a hold is never ended.
- A real IoctlProbe (root, bcc): ioctls made while the hold is on are not delivered until it ends,
  then all are (nothing lost); its counts, read in one batch, equal bcc's own per-entry reading.
- CountMap on a map of thousands of entries, u32 and u64 keys: the same as items().
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from krex_async.probes.bpf_ioctl import IoctlProbe
from krex_async.probes.hold import HOLD, Hold

from .conftest import Collector, WaitingChild, need_bcc


def _waiter(h: Hold) -> tuple[threading.Thread, list[float]]:
    done: list[float] = []
    t = threading.Thread(target=lambda: (h.wait(), done.append(time.monotonic())))
    t.start()
    return t, done


def test_wait_returns_at_once_without_a_hold() -> None:
    h = Hold()
    t0 = time.monotonic()
    h.wait()
    assert time.monotonic() - t0 < 0.01
    assert h.waited == 0


def test_wait_blocks_while_held_and_returns_when_it_ends() -> None:
    h = Hold(max_s=5.0)
    h.begin()
    h.begin()  # two devices entering at once: both must end
    t, done = _waiter(h)
    time.sleep(0.1)
    assert not done, "a probe thread ran during a hold"
    h.end()
    time.sleep(0.05)
    assert not done, "one of two holds ended and the thread ran"
    t_end = time.monotonic()
    h.end()
    t.join(2)
    assert done and done[0] - t_end < 0.5
    assert h.waited == 1


def test_a_hold_never_ended_lets_the_threads_go_after_max_s() -> None:
    h = Hold(max_s=0.2)
    t0 = time.monotonic()
    h.begin()
    t, done = _waiter(h)
    t.join(3)
    assert done and 0.1 < done[0] - t0 < 1.5
    assert not h.active()


def test_held_ends_on_error() -> None:
    h = Hold()
    with pytest.raises(RuntimeError):
        with h.held():
            assert h.active()
            raise RuntimeError("boom")
    assert not h.active()


async def test_ioctl_probe_delivers_nothing_while_held_then_everything(devdir: str) -> None:
    need_bcc()
    probe = IoctlProbe([devdir + "/"])
    col = Collector(probe)
    col.start()
    child = WaitingChild(f"{devdir}/null0", 300, 0, linger=True)
    try:
        await asyncio.sleep(0.1)  # the open is delivered
        with HOLD.held():
            pid = child.go()["pid"]
            await asyncio.sleep(0.04)  # four of the poll thread's 10 ms periods, hold still on
            held = len([e for e in col.of(pid) if e.kind == "ioctl"])
        assert held == 0, f"{held} events delivered during the hold"
        assert await col.wait_for(lambda: len([e for e in col.of(pid) if e.kind == "ioctl"]) >= 300)
        counts = probe.counts()
        assert counts[pid] == 301  # the open and 300 ioctls, counted kernel-side
        assert probe.lost() == 0
        table = probe._bpf[b"counts"]
        assert counts == {**probe._gone_counts, **{k.value: v.value for k, v in table.items()}}
    finally:
        child.kill()
        probe.stop()


def test_count_map_reads_what_items_reads() -> None:
    need_bcc()
    import ctypes as ct

    from krex_async.probes import _bcc

    bpf = _bcc.compile_bpf(
        "BPF_HASH(a, u32, u64, 8192); BPF_HASH(b, u64, u64, 64);"
        "TRACEPOINT_PROBE(syscalls, sys_enter_getppid) { return 0; }",
        "test",
    )
    try:
        a, b = bpf[b"a"], bpf[b"b"]
        ra, rb = _bcc.CountMap(a), _bcc.CountMap(b, ct.c_uint64)
        assert ra.read() == {} and rb.read() == {}
        for i in range(5000):
            a[a.Key(i * 7 + 1)] = a.Leaf(i * 3)
        for i in range(64):  # a full map
            b[b.Key((1 << 40) + i)] = b.Leaf(1 << 35)
        want_a = {k.value: v.value for k, v in a.items()}
        assert len(want_a) == 5000 and ra.read() == want_a
        assert rb.read() == {(1 << 40) + i: 1 << 35 for i in range(64)}
        assert ra.batched and rb.batched, "the kernel refused the batch read: fell back"
    finally:
        bpf.cleanup()
