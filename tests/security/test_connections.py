"""Thousands of idle connections and connect/disconnect storms: everyone else is still served and
nothing (fds, commands, processes) is left behind."""

from __future__ import annotations

import asyncio
import os
import resource
import socket
import struct
import time

import pytest

from krex_async import protocol as P

from ..conftest import cmdline, run_daemon
from .helpers import fd_count


@pytest.fixture
def many_fds():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 6000
    if hard != resource.RLIM_INFINITY and hard < want:
        pytest.skip(f"the hard open-file limit ({hard}) is below {want}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


async def wait_for_fds(pid: int, at_most: int, timeout: float = 10) -> int:
    deadline = time.monotonic() + timeout
    while (n := fd_count(pid)) > at_most and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return n


async def test_two_thousand_idle_connections_do_not_stop_service(many_fds):
    async with run_daemon() as d:
        async with await d.client() as c:  # warm up: what the first command opens for good
            await c.run(["true"])
        await asyncio.sleep(0.3)
        base = await wait_for_fds(d.proc.pid, 10**6, 0)
        idle: list[socket.socket] = []
        try:
            for i in range(2000):
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.connect(d.socket)
                if i % 2:
                    s.sendall(P.encode(P.Hello(id=1)))  # half of them greeted, then silent
                idle.append(s)
            t0 = time.monotonic()
            async with await d.client() as c:
                res = await c.run(["echo", "still here"])
            assert res.stdout == b"still here\n"
            assert time.monotonic() - t0 < 10
            assert fd_count(d.proc.pid) >= 2000  # the daemon did accept them all
        finally:
            for s in idle:
                s.close()
        assert await wait_for_fds(d.proc.pid, base) <= base


@pytest.mark.parametrize("isolation", ["signal", "auto"])
async def test_connect_disconnect_storm_leaves_nothing_behind(many_fds, isolation):
    # This run's own sleeps only (a unique duration): a process some other test left must not be
    # taken for one of the storm's, nor hide that one of these survived.
    dur = f"300.{time.time_ns() % 10**6:06d}"
    async with run_daemon("--isolation", isolation) as d:
        async with await d.client() as c:  # warm up: what the first command opens for good
            await c.run(["true"])
        await asyncio.sleep(0.3)
        base = await wait_for_fds(d.proc.pid, 10**6, 0)

        def storm() -> None:
            for i in range(3000):
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.connect(d.socket)
                kind = i % 4
                if kind == 1:
                    s.sendall(struct.pack(">I", 1000) + b"half")  # a frame cut short
                elif kind == 2:
                    s.sendall(P.encode(P.Hello(id=1)) + P.encode(P.Status(id=2)))
                elif kind == 3 and i % 40 == 3:  # a command whose only agent vanishes
                    s.sendall(P.encode(P.Hello(id=1)) + P.encode(P.Submit(id=2, argv=["sleep", dur])))
                    s.recv(4096)  # welcome (and maybe accepted)
                if i % 7 == 0:
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                s.close()  # some with a reset instead of a clean close

        await asyncio.gather(*(asyncio.to_thread(storm) for _ in range(2)))
        async with await d.client() as c:
            res = await c.run(["echo", "ok"])
            assert res.stdout == b"ok\n"
            deadline = time.monotonic() + 15
            while True:
                st = await c.status()
                live = [x for x in st["commands"] if x["state"] != "ended"]
                if not live or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.1)
            assert live == [], live  # on_disconnect=kill: the storm's sleeps are gone
        assert await wait_for_fds(d.proc.pid, base) <= base
        mine = b"sleep\x00" + dur.encode() + b"\x00"
        sleeps = [p for p in os.listdir("/proc") if p.isdigit() and cmdline(p) == mine]
        assert sleeps == [], [_describe(p) for p in sleeps]
        assert d.proc.poll() is None


def _describe(pid: str) -> str:
    """Enough of a leftover process to tell where it came from."""
    try:
        with open(f"/proc/{pid}/status") as f:
            status = {k: v.strip() for k, _, v in (ln.partition(":") for ln in f)}
        with open(f"/proc/{pid}/cgroup") as f:
            cgroup = f.read().strip().replace("\n", " ")
    except OSError:
        return f"{pid} (gone)"
    return f"{pid} state {status.get('State')} ppid {status.get('PPid')} cgroup {cgroup}"
