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

from ..conftest import run_daemon
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
        async with await d.client() as c:
            await c.status()
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
            assert fd_count(d.proc.pid) >= base + 2000  # the daemon did accept them all
        finally:
            for s in idle:
                s.close()
        assert await wait_for_fds(d.proc.pid, base) <= base


def _cmdline(pid: str) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""
