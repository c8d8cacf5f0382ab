"""The bcc ioctl probe on real syscalls of real processes (root, bcc)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from krex_async.probes.bpf_ioctl import IoctlProbe, bpf_text, check_prefixes, main

from .conftest import FIONREAD, TCGETS, Collector, WaitingChild, need_bcc, run_child


@pytest.mark.parametrize("mmap_reader", [True, False], ids=["mmap-reader", "bcc-reader"])
async def test_ioctls_seen_with_identity(devdir: str, mmap_reader: bool) -> None:
    need_bcc()
    # Two prefixes: the device matches only the second, so the generated compare must OR them.
    probe = IoctlProbe(["/nonexistent/krex", devdir + "/"], mmap_reader=mmap_reader)
    col = Collector(probe)
    t0 = time.monotonic_ns()
    col.start()
    try:
        assert probe.poller is not None
        assert probe.poller.reader == ("mmap" if mmap_reader and os.uname().machine == "x86_64" else "bcc")
        child = run_child(f"{devdir}/null0", 5, 3)
        pid = child["pid"]
        assert await col.wait_for(lambda: len(col.of(pid)) >= 9)
    finally:
        probe.stop()
    evs = col.of(pid)
    opens = [e for e in evs if e.kind == "open"]
    ioctls = [e for e in evs if e.kind == "ioctl"]
    assert [(e.fd, e.name) for e in opens] == [(child["fd"], f"{devdir}/null0")]
    assert len(ioctls) == 8
    assert all(e.fd == child["fd"] and e.tgid == pid for e in ioctls)
    main_t = [e for e in ioctls if e.tid == child["tid"]]
    thread_t = [e for e in ioctls if e.tid == child["thread_tid"]]
    assert [(e.request, e.name) for e in main_t] == [(TCGETS, "TCGETS")] * 5
    assert [(e.request, e.name) for e in thread_t] == [(FIONREAD, "FIONREAD")] * 3
    assert all(e.comm.startswith("python") for e in evs)
    ts = [e.ts_ns for e in evs]
    assert ts == sorted(ts) and t0 < ts[0] < time.monotonic_ns()  # CLOCK_MONOTONIC
    assert probe.counts()[pid] == 9  # 1 open + 8 ioctls, kernel-side
    assert probe.lost() == 0
    assert probe.fd_paths[(pid, child["fd"])] == f"{devdir}/null0"


async def test_fd_opened_before_start_is_seeded_from_proc(devdir: str) -> None:
    need_bcc()
    child = WaitingChild(f"{devdir}/null0", 4, 2)
    probe = IoctlProbe([devdir + "/"])
    col = Collector(probe)
    try:
        col.start()
        res = child.go()
        pid = res["pid"]
        assert await col.wait_for(lambda: len(col.of(pid)) >= 6)
    finally:
        probe.stop()
        child.kill()
    evs = col.of(pid)
    assert [e.kind for e in evs] == ["ioctl"] * 6  # no open: it happened before the probe
    assert {e.fd for e in evs} == {child.fd}
    assert probe.counts()[pid] == 6


async def test_close_untracks_and_other_paths_are_ignored(devdir: str) -> None:
    need_bcc()
    code = (
        "import fcntl, os, sys\n"
        "def io(fd):\n"
        "    try: fcntl.ioctl(fd, 0x5401, bytes(64))\n"
        "    except OSError: pass\n"
        f"fd = os.open('{devdir}/null0', os.O_RDWR); io(fd); io(fd); os.close(fd)\n"
        "fd2 = os.open('/dev/null', os.O_RDWR); io(fd2); io(fd2); io(fd2)\n"
        "print(os.getpid(), fd, fd2)\n"
    )
    probe = IoctlProbe([devdir + "/"])
    col = Collector(probe)
    col.start()
    try:
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        ).stdout.split()
        pid, fd, fd2 = map(int, out)
        assert fd == fd2  # the same number, reused by a file outside the prefix
        await col.wait_for(lambda: len(col.of(pid)) >= 3)
        await __import__("asyncio").sleep(0.2)
    finally:
        probe.stop()
    assert [e.kind for e in col.of(pid)] == ["open", "ioctl", "ioctl"]
    assert probe.counts()[pid] == 3


async def test_ring_buffer_overflow_is_counted_as_lost(devdir: str) -> None:
    need_bcc()
    probe = IoctlProbe([devdir + "/"], ring_pages=1)  # 4 KiB: about 64 ioctl records of 64 bytes
    col = Collector(probe)
    col.start()
    try:
        assert probe.poller is not None
        probe.poller.paused.set()  # nothing consumes: the ring fills and reservations fail
        child = run_child(f"{devdir}/null0", 2000, 0)
        pid = child["pid"]
        lost = probe.lost()
        probe.poller.paused.clear()
        await col.wait_for(lambda: len(col.of(pid)) + lost >= 2001, timeout=3)
    finally:
        probe.stop()
    got = len(col.of(pid))
    assert probe.counts()[pid] == 2001  # counts lose nothing
    assert lost > 1500 and got + lost == 2001
    assert probe.lost() == lost


def test_prefix_checks_and_printed_text(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError):
        check_prefixes([])
    with pytest.raises(ValueError):
        check_prefixes(["relative/path"])
    with pytest.raises(ValueError):
        check_prefixes(["/" + "x" * 70])
    text = bpf_text(["/dev/kfd"], ring_pages=8)
    assert "BPF_RINGBUF_OUTPUT(events, RING_PAGES)" in text and "#define RING_PAGES 8" in text
    # "/dev/kfd" is exactly one 8-byte word, little-endian.
    assert f"0x{int.from_bytes(b'/dev/kfd', 'little'):016x}ULL" in text
    with pytest.raises(ValueError):
        bpf_text(ring_pages=3)
    if os.path.isdir("/sys/kernel/tracing/events/syscalls"):
        main(["--print", "--prefix", "/dev/nvidia"])
        assert "TRACEPOINT_PROBE(syscalls, sys_enter_ioctl)" in capsys.readouterr().out


def test_fast_event_constructor_equals_the_dataclass() -> None:
    import dataclasses

    from krex_async.probes.bpf_ioctl import BccEvent, bcc_event

    args = (123, 4, 5, "ioctl", 3, 0x5401, "TCGETS", "python3", 77)
    fast, slow = bcc_event(*args), BccEvent(*args)
    assert fast == slow and hash(fast) == hash(slow) and repr(fast) == repr(slow)
    assert dataclasses.astuple(fast) == args
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.tgid = 9  # type: ignore[misc]


def test_the_program_leaves_out_the_syscalls_a_machine_does_not_have(monkeypatch: pytest.MonkeyPatch) -> None:
    """arm64 (Grace, GH200) has neither open nor dup2 as a syscall: the program must not name
    their tracepoints there (it failed to load, and the daemon ran without probes)."""
    from krex_async.probes import bpf_ioctl

    arm64 = {"open", "dup2"}
    monkeypatch.setattr(bpf_ioctl, "tracepoint_exists", lambda cat, ev: ev.split("_", 2)[-1] not in arm64)
    text = bpf_text(["/dev/nvidia"])
    for name in ("sys_enter_dup2", "sys_exit_dup2", "sys_enter_open)", "sys_exit_open)"):
        assert name not in text, name
    assert "sys_enter_dup3" in text and "sys_enter_openat)" in text
    monkeypatch.setattr(bpf_ioctl, "tracepoint_exists", lambda cat, ev: True)
    assert "sys_enter_dup2" in bpf_text(["/dev/nvidia"])
