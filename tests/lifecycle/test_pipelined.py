"""Requests pipelined in one write (no waiting for replies) are answered as if sent one by one."""

from __future__ import annotations

import asyncio

import pytest

from krex_async import protocol as P

from ..conftest import PY, run_daemon


async def _replies(reader: asyncio.StreamReader, quiet: float) -> list[P.Reply]:
    out: list[P.Reply] = []
    while True:
        try:
            head = await asyncio.wait_for(reader.readexactly(4), quiet)
        except (TimeoutError, asyncio.IncompleteReadError):
            return out
        (n,) = P.HEADER.unpack(head)
        out.append(P.decode_reply(await reader.readexactly(n)))


@pytest.mark.parametrize("policy", ["region", "command"])
async def test_a_cancel_pipelined_behind_its_submit_ends_the_command_once(policy):
    """Submit and a Cancel of the id it will get (ids are sequential), in one write: one Exited,
    state cancelled; under --policy command the device then serves the last command, which was
    not cancelled."""
    async with run_daemon("--isolation", "signal", "--policy", policy) as d:
        async with await d.client() as c:
            first = (await c.run([PY, "-c", "pass"])).report.command
        boot, n = first.rsplit("-", 1)
        reader, writer = await asyncio.open_unix_connection(d.socket)
        ids = [f"{boot}-{int(n) + 1 + i}" for i in range(5)]
        # Submits first (under --policy command the later ones queue behind the first), then the
        # cancels: each cancelled command holds the device when its cancel comes.
        frames: list[P.Msg] = [P.Hello(id=1)]
        frames += [
            P.Submit(id=10 + i, argv=[PY, "-c", "import time; time.sleep(2)"]) for i in range(len(ids))
        ]
        frames.append(P.Submit(id=50, argv=[PY, "-c", "pass"]))
        frames += [P.Cancel(id=100 + i, command=cid, signal=9) for i, cid in enumerate(ids)]
        writer.write(b"".join(P.encode(f) for f in frames))
        await writer.drain()
        replies = await _replies(reader, 4.0)
        writer.close()
        for i, cid in enumerate(ids):
            exited = [r for r in replies if isinstance(r, P.Exited) and r.id == 10 + i]
            assert len(exited) == 1, (cid, exited)
            assert exited[0].report.state == "cancelled", exited[0].report
        last = [r for r in replies if isinstance(r, P.Exited) and r.id == 50]
        assert [r.report.state for r in last] == ["exited"], replies[-3:]


async def test_a_shutdown_reports_every_command_exactly_once():
    """SIGTERM with one command running, some queued behind it (--policy command) and some just
    submitted in the same write: each gets one Exited (state shutdown) before the socket closes."""
    async with run_daemon("--isolation", "signal", "--policy", "command") as d:
        reader, writer = await asyncio.open_unix_connection(d.socket)
        frames: list[P.Msg] = [P.Hello(id=1)]
        frames += [P.Submit(id=10 + i, argv=[PY, "-c", "import time; time.sleep(30)"]) for i in range(6)]
        writer.write(b"".join(P.encode(f) for f in frames))
        await writer.drain()
        accepted = 0
        replies: list[P.Reply] = []
        while accepted < 6:
            head = await asyncio.wait_for(reader.readexactly(4), 10)
            r = P.decode_reply(await reader.readexactly(P.HEADER.unpack(head)[0]))
            replies.append(r)
            accepted += isinstance(r, P.Accepted)
        d.proc.send_signal(15)
        replies += await _replies(reader, 15.0)
        writer.close()
        assert d.proc.wait(20) == 0
    for i in range(6):
        exited = [r for r in replies if isinstance(r, P.Exited) and r.id == 10 + i]
        assert [r.report.state for r in exited] == ["shutdown"], (i, exited)
