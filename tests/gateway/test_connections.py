"""Idle connections without a token (issue 36 item 6d): 1100 of them from loopback, against a
gateway started with a soft open-files limit of 1024, neither shut a token holder out nor stay
open: the gateway raises its soft limit to the hard one, caps connections per address (closing the
oldest one without a token) and closes a connection that made no authenticated request in time."""

from __future__ import annotations

import asyncio
import errno
import os
import resource
import socket
import time
from pathlib import Path

import pytest

from tests.conftest import until

from .conftest import stack

ATTACK = 1100


def soft_nofile(pid: int) -> tuple[str, str]:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            soft, hard = line.split()[3:5]
            return soft, hard
    raise AssertionError("no open-files line")


def sockets(pid: int) -> int:
    """How many sockets the process holds open (its listener and daemon connection among them).
    Counted on the gateway's side: a client whose handshake the kernel finished with a SYN
    cookie, when the accept queue was full, looks connected but is held by nobody."""
    n = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            n += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
        except OSError:
            pass  # closed meanwhile
    return n


async def test_idle_connections_without_a_token_are_capped_and_closed(tmp_path: Path) -> None:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < ATTACK + 200:
        pytest.skip(f"the hard open-files limit {hard} is below the {ATTACK} connections the test opens")

    def low_soft_limit() -> None:  # as a node's default: soft 1024 under a higher hard limit
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))

    args = ("--unauthenticated-timeout", "2", "--max-connections-per-address", "64")
    async with stack(tmp_path, *args, preexec_fn=low_soft_limit) as (_, gw, c):
        soft, hard_seen = soft_nofile(gw.proc.pid)
        assert soft == hard_seen, (soft, hard_seen)  # raised at start
        host, port = gw.url.rsplit("/", 1)[-1].rsplit(":", 1)
        assert await c.jobs() == []
        before = sockets(gw.proc.pid)  # listener, daemon, the token holder's connection
        idle: list[socket.socket] = []
        try:
            for _ in range(ATTACK):
                s = socket.socket()
                s.setblocking(False)
                err = s.connect_ex((host, int(port)))
                assert err in (0, errno.EINPROGRESS), os.strerror(err)
                idle.append(s)
            await asyncio.sleep(0)
            t0 = time.monotonic()
            assert await asyncio.wait_for(c.jobs(), 20) == []  # the token holder is served
            job = await asyncio.wait_for(c.dev("echo served"), 20)
            assert (await c.wait(job["job_id"], 60))["result"]["stdout"] == "served\n"
            assert time.monotonic() - t0 < 30
            # Every idle one is closed: the cap closes all but the newest 64 at once, the
            # unauthenticated timeout (2 s) the rest.
            await until(
                lambda: sockets(gw.proc.pid) <= before + 1,
                lambda: f"the gateway still holds {sockets(gw.proc.pid)} sockets, {before} before",
                30,
            )
            assert await c.jobs() != []  # the token holder is still served
        finally:
            for s in idle:
                s.close()
        assert "Traceback" not in gw.logs(), gw.logs()
