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
    out = subprocess.run(
        [sys.executable, "-c", PRELUDE + textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout
    return [int(x) for x in out.split()]


class Paced:
    """A process of `code` on `dev` that prints its first line, then waits for a line on stdin
    before its next step (it prints "done" after it): the test acts between the two."""

    def __init__(self, code: str, dev: str) -> None:
        self.p = subprocess.Popen(
            [sys.executable, "-c", code, dev], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert self.p.stdin is not None and self.p.stdout is not None
        self.first = [int(x) for x in self.p.stdout.readline().split()]

    def step(self) -> None:
        """Let it go on, and wait until it has done its step."""
        assert self.p.stdin is not None and self.p.stdout is not None
        self.p.stdin.write("go\n")
        self.p.stdin.flush()
        assert self.p.stdout.readline().strip() == "done"

    def end(self) -> None:
        self.p.kill()
        self.p.wait()


async def settle(col: Collector, pid: int, n: int) -> None:
    await col.wait_for(lambda: len(col.of(pid)) >= n, timeout=3)
    await asyncio.sleep(0.2)  # anything more that would (wrongly) come


async def test_dup2_onto_a_tracked_fd_untracks_it_at_once(devdir: str) -> None:
    need_bcc()
    probe = IoctlProbe([devdir + "/"], rescan_s=0)  # no rescan: the BPF side alone must be right
    col = Collector(probe)
    col.start()
    try:
        pid, fd, fd3 = run(
            """
            fd = os.open(dev, os.O_RDWR); io(fd)
            os.dup2(os.open("/dev/null", os.O_RDWR), fd); io(fd, 5)    # now /dev/null
            fd3 = os.open(dev, os.O_RDWR)
            os.dup2(os.open("/dev/null", os.O_RDWR), fd3, inheritable=False); io(fd3, 5)  # dup3
            print(os.getpid(), fd, fd3)
        """,
            f"{devdir}/null0",
        )
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
        pid, a, b, c, d = run(
            """
            a = os.open(dev, os.O_RDWR)
            b = os.dup(a); c = fcntl.fcntl(a, fcntl.F_DUPFD, 40)
            d = fcntl.fcntl(a, fcntl.F_DUPFD_CLOEXEC, 50)
            os.close(a); io(b, 2); io(c, 3); io(d, 4)
            print(os.getpid(), a, b, c, d)
        """,
            f"{devdir}/null0",
        )
        await settle(col, pid, 10)
    finally:
        probe.stop()
    evs = col.of(pid)
    assert [(e.kind, e.fd) for e in evs] == [("open", a)] + [("ioctl", b)] * 2 + [("ioctl", c)] * 3 + [
        ("ioctl", d)
    ] * 4
    assert all(e.name == "TCGETS" for e in evs[1:])
    assert probe.counts()[pid] == 10


STALE = {
    # close_range(2) closes without a close syscall per fd.
    "close_range": """
        import ctypes
        fd = os.open(dev, os.O_RDWR)
        assert ctypes.CDLL(None, use_errno=True).close_range(fd, fd, 0) == 0
        assert os.open("/dev/null", os.O_RDWR) == fd
        io(fd)
    """,
    # execve closes O_CLOEXEC fds (how libcuda opens /dev/nvidia*) without close syscalls.
    "execve": """
        # A high number, so that the new image's start-up (which opens and closes low numbers,
        # and a close untracks) does not touch it before the program reuses it.
        if len(sys.argv) < 3:
            fd = os.open(dev, os.O_RDWR | os.O_CLOEXEC)
            fd = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 100)
            os.execv(sys.executable, [sys.executable, "-c", sys.argv[-1], dev, str(fd), sys.argv[-1]])
        while os.open("/dev/null", os.O_RDWR) < int(sys.argv[2]):
            pass
    """,
}


async def _stale_after_rescan(devdir: str, how: str) -> None:
    need_bcc()
    code = (
        PRELUDE
        + textwrap.dedent(STALE[how])
        + textwrap.dedent("""
        fd = int(sys.argv[2]) if len(sys.argv) > 2 else fd
        print(os.getpid(), fd, flush=True)
        sys.stdin.readline(); io(fd, 5); print("done", flush=True)
    """)
    )
    if how == "execve":
        code = code.replace("sys.argv[-1]", "CODE")
        code = f"CODE = {code!r}\n" + code
    probe = IoctlProbe([devdir + "/"], rescan_s=0.2)
    col = Collector(probe)
    col.start()
    child = Paced(code, f"{devdir}/null0")
    try:
        pid, fd = child.first
        await asyncio.sleep(0.8)  # several rescans: the stale entry must be gone by now
        before = probe.counts().get(pid, 0)
        child.step()
        await asyncio.sleep(0.2)
        after = probe.counts().get(pid, 0)
    finally:
        child.end()
        probe.stop()
    assert after == before, f"{after - before} ioctls on /dev/null (fd {fd}) counted as GPU"
    assert (pid, fd) not in probe.fd_paths


async def test_stale_entry_after_close_range_is_dropped_by_the_rescan(devdir: str) -> None:
    await _stale_after_rescan(devdir, "close_range")


async def test_stale_entry_after_execve_cloexec_is_dropped_by_the_rescan(devdir: str) -> None:
    await _stale_after_rescan(devdir, "execve")


async def test_execve_untracks_cloexec_fds_at_once_and_keeps_the_others(devdir: str) -> None:
    need_bcc()
    # Before execve: a (O_CLOEXEC at open), b (F_DUPFD_CLOEXEC), c (plain, then F_SETFD
    # FD_CLOEXEC), d (O_CLOEXEC, then F_SETFD 0: survives), e (plain: survives). After it, the
    # closed numbers are reused for /dev/null; d and e still name the device.
    code = PRELUDE + textwrap.dedent("""
        if len(sys.argv) < 3:
            a = fcntl.fcntl(os.open(dev, os.O_RDWR | os.O_CLOEXEC), fcntl.F_DUPFD_CLOEXEC, 100)
            b = fcntl.fcntl(a, fcntl.F_DUPFD_CLOEXEC, 110)
            c = fcntl.fcntl(os.open(dev, os.O_RDWR), fcntl.F_DUPFD, 120)
            fcntl.fcntl(c, fcntl.F_SETFD, fcntl.FD_CLOEXEC)
            d = fcntl.fcntl(a, fcntl.F_DUPFD_CLOEXEC, 130)
            fcntl.fcntl(d, fcntl.F_SETFD, 0)
            e = fcntl.fcntl(a, fcntl.F_DUPFD, 140)
            fds = " ".join(map(str, (a, b, c, d, e)))
            os.execv(sys.executable, [sys.executable, "-c", CODE, dev, fds])
        a, b, c, d, e = map(int, sys.argv[2].split())
        for fd in (a, b, c):
            while os.open("/dev/null", os.O_RDWR) < fd:
                pass
        io(a, 2); io(b, 2); io(c, 2); io(d, 3); io(e, 4)
        print(os.getpid(), a, b, c, d, e, flush=True)
    """)
    code = f"CODE = {code!r}\n" + code
    probe = IoctlProbe([devdir + "/"], rescan_s=0)  # no rescan: the BPF side alone
    col = Collector(probe)
    col.start()
    try:
        out = subprocess.run(
            [sys.executable, "-c", code, f"{devdir}/null0"],
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        ).stdout
        pid, a, b, c, d, e = map(int, out.split())
        await settle(col, pid, 9)
    finally:
        probe.stop()
    ioctls = [e_.fd for e_ in col.of(pid) if e_.kind == "ioctl"]
    assert ioctls == [d] * 3 + [e] * 4, ioctls


async def test_fds_inherited_through_fork_are_tracked_in_the_child(devdir: str) -> None:
    need_bcc()
    probe = IoctlProbe([devdir + "/"], rescan_s=0)  # no rescan: the BPF side alone
    col = Collector(probe)
    col.start()
    try:
        out = run(
            """
            a = os.open(dev, os.O_RDWR); b = os.open(dev, os.O_RDWR)
            kid = os.fork()
            if kid == 0:
                io(a, 3)  # inherited: the child's device activity
                for _ in range(50):  # closes of fds that were never the device's: no tombstones
                    os.close(os.open("/dev/null", os.O_RDONLY))
                os.close(b)  # closed in the child, then the number reused for /dev/null
                assert os.open("/dev/null", os.O_RDWR) == b
                io(b, 4)
                grandkid = os.fork()
                if grandkid == 0:
                    io(a, 2)  # inherited twice
                    os._exit(0)
                os.waitpid(grandkid, 0)
                print(os.getpid(), grandkid, flush=True)
                os._exit(0)
            os.waitpid(kid, 0)
            io(b, 1)  # the parent's b is still the device
            print(os.getpid(), a, b, flush=True)
        """,
            f"{devdir}/null0",
        )
        kid, grandkid, parent, a, b = out
        await settle(col, parent, 3)
        await settle(col, grandkid, 2)
        tombstones = [k.fd for k, v in probe._bpf[b"tracked"].items() if not v.s and k.tgid == kid]
    finally:
        probe.stop()
    assert [e.fd for e in col.of(kid)] == [a] * 3
    assert tombstones == [b]  # only the inherited fd it closed
    assert [e.fd for e in col.of(grandkid)] == [a] * 2
    assert [(e.kind, e.fd) for e in col.of(parent)] == [("open", a), ("open", b), ("ioctl", b)]


async def test_the_rescan_ends_fork_inheritance_and_seeds_the_child(devdir: str) -> None:
    """After a rescan, a child's fds come from /proc: one it closed with close_range (no close
    syscall, so no tombstone) must not be inherited again from its parent's entry."""
    need_bcc()
    code = PRELUDE + textwrap.dedent("""
        import ctypes
        a = os.open(dev, os.O_RDWR)
        kid = os.fork()
        if kid == 0:
            assert ctypes.CDLL(None, use_errno=True).close_range(a, a, 0) == 0
            assert os.open("/dev/null", os.O_RDWR) == a
            print(os.getpid(), a, flush=True)
            sys.stdin.readline(); io(a, 5); print("done", flush=True)
            sys.stdin.readline(); os._exit(0)
        os.waitpid(kid, 0)
    """)
    probe = IoctlProbe([devdir + "/"], rescan_s=0.2)
    col = Collector(probe)
    col.start()
    p = Paced(code, f"{devdir}/null0")
    try:
        kid, a = p.first
        await asyncio.sleep(0.6)  # several rescans
        p.step()
        await asyncio.sleep(0.2)
    finally:
        p.end()
        probe.stop()
    assert probe.counts().get(kid, 0) == 0, "ioctls on /dev/null counted as inherited GPU ones"


async def test_a_seed_keeps_an_entry_made_after_its_scan_began(devdir: str, monkeypatch) -> None:
    """A rescan stamps what it seeds with its start. A process that execs after the scan began and
    then opens a close-on-exec device fd has an entry the BPF side made at the open; the scan, on
    reaching it, must not restamp it with its (earlier) start: older than the execve, the entry of
    a close-on-exec fd is dropped at its first ioctl, and the process's device work went uncounted
    until the next rescan."""
    import time as time_mod

    import krex_async.probes.bpf_ioctl as bpf_ioctl

    need_bcc()
    probe = IoctlProbe([devdir + "/"], rescan_s=0)
    col = Collector(probe)
    col.start()
    began = time_mod.monotonic_ns()  # the scan "begins" here, before the process's execve
    code = PRELUDE + textwrap.dedent("""
        fd = os.open(dev, os.O_RDWR | os.O_CLOEXEC)
        print(os.getpid(), fd, flush=True)
        sys.stdin.readline(); io(fd, 3); print("done", flush=True)
    """)
    p = Paced(code, f"{devdir}/null0")
    try:
        pid, fd = p.first
        await col.wait_for(lambda: len(col.of(pid)) >= 1, timeout=3)  # its open: the BPF entry
        monkeypatch.setattr(bpf_ioctl.time, "monotonic_ns", lambda: began)
        assert probe.seed() >= 1
        monkeypatch.undo()
        p.step()
        await settle(col, pid, 4)
    finally:
        p.end()
        probe.stop()
    assert [(e.kind, e.fd) for e in col.of(pid)] == [("open", fd)] + [("ioctl", fd)] * 3
