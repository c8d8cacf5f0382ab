"""Adoption's daemon side (ctxpool/adoption.py) without a daemon: what serve() counts and kills
when the adopter goes away while its worker is taking the program over."""

from __future__ import annotations

import asyncio
import collections
import os
import socket
import sys
import time
from typing import Any, cast

import pytest

from krex_async import protocol as P
from krex_async.ctxpool import Pool, adoption
from krex_async.linux.spawn import Launched


async def adopter_killed_mid_hand_over(
    monkeypatch: pytest.MonkeyPatch, answer: Launched | str
) -> tuple[adoption.Tally, Pool, list[int], list[P.Msg]]:
    """serve() an allowed adoption, cancel it (the adopter's connection closed) while the worker's
    answer is pending, then let the worker answer `answer`; returns what was counted, killed, sent."""
    monkeypatch.setattr(adoption, "refusal", lambda *a: None)
    killed: list[int] = []
    monkeypatch.setattr(adoption, "_kill", killed.append)
    fut: asyncio.Future[Launched | str] = asyncio.get_running_loop().create_future()
    handed = asyncio.Event()

    def hand(*a: Any) -> asyncio.Future[Launched | str]:
        handed.set()
        return fut

    pool = cast(Pool, type("FakePool", (), {"adopted": 0, "declined": collections.Counter()})())
    tally, sent = adoption.Tally(), cast(list[P.Msg], [])
    req = P.Adopt(id=2, command="c", token="t", argv=["python", "x.py"], cwd="/", env={})
    task = asyncio.create_task(
        adoption.serve(pool, req, os.getpid(), lambda m: sent.append(m) or True, hand, tally)
    )
    await handed.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    answered = asyncio.Event()
    fut.add_done_callback(lambda _f: answered.set())  # called after serve's own callback
    fut.set_result(answer)
    await answered.wait()
    return tally, pool, killed, sent


async def test_an_adopter_killed_before_its_worker_said_started_still_counts_as_adopted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The worker runs the program before the daemon reads its "started": the program can print,
    and its parent kill the adopter for it (test_adopt's SIGKILL case), before that answer. The
    program ran in a worker: it counts as adopted, and the worker dies with its adopter."""
    launched = Launched(pid=424242, _done=asyncio.get_running_loop().create_future(), via="pool")
    tally, pool, killed, sent = await adopter_killed_mid_hand_over(monkeypatch, launched)
    assert (tally.adopted, pool.adopted, dict(tally.declined)) == (1, 1, {})
    assert killed == [424242] and sent == []


async def test_an_adopter_killed_before_its_worker_declined_counts_no_adoption(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tally, pool, killed, sent = await adopter_killed_mid_hand_over(monkeypatch, "module colorsys")
    assert (tally.adopted, pool.adopted, killed, sent) == (0, 0, [], [])


@pytest.mark.parametrize("last", ["started", "declined"])
async def test_a_workers_last_message_is_read_before_its_death_is_answered(last: str) -> None:
    """A worker that says "started" (or "declined") and dies at once: its exit and its message wake
    the loop together. Whichever is handled first, the adopter is answered with what the worker
    said, not "died before it started" (which would make it run its program a second time)."""
    from krex_async.ctxpool import PoolConfig, channel
    from krex_async.ctxpool.handle import Worker
    from krex_async.devices.base import Device
    from krex_async.linux.spawn import ExitStatus

    loop = asyncio.get_running_loop()
    pool = Pool(Device(index=0, key="cpu0", vendor="cpu", name="cpu"), PoolConfig(size=1))
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    mine.setblocking(False)
    exited: asyncio.Future[ExitStatus] = loop.create_future()
    w = Worker(pid=424242, sock=mine, exited=exited)
    w.launched = launched = Launched(pid=424242, _done=exited, via="pool")
    w.accepted = accepted = loop.create_future()
    channel.send(theirs, {"t": last, "ts": time.time(), "reason": "cannot take fds"})
    theirs.close()
    exited.set_result(ExitStatus(0))
    pool._on_exit(w)  # before any reader ran: the message is still in the socket
    assert accepted.result() is launched if last == "started" else accepted.result() == "cannot take fds"


def test_a_worker_reaped_meanwhile_is_passed_over_for_the_privilege_check() -> None:
    """refusal() compares the adopter's privileges with a worker's: when the first worker listed has
    just been reaped, a live one answers instead of "no warm worker"."""
    gone = next(p for p in range(os.getpid() - 1, 1, -1) if not os.path.exists(f"/proc/{p}"))
    pool = cast(
        Pool,
        type(
            "FakePool",
            (),
            {
                "config": type("C", (), {"size": 1})(),
                "interpreter": {"hexversion": sys.hexversion, "flags": {}},
                "identity": (os.getuid(), os.getgid(), sorted(os.getgroups())),
                "python": sys.executable,
                "pids": lambda self: [os.getpid(), gone],
            },
        )(),
    )
    req = P.Adopt(
        id=1, command="c", token="t", argv=["python", "x.py"], cwd="/", env={}, hexversion=sys.hexversion
    )
    assert adoption.refusal(pool, req, os.getpid()) is None


@pytest.mark.parametrize("ends", [True, False])
async def test_serve_says_whether_a_worker_ran_the_program_to_its_end(
    monkeypatch: pytest.MonkeyPatch, ends: bool
) -> None:
    """True once the worker's program ended and the adopter was told its status (WarmPools.adopt
    then counts the command as leaving: Command.leaving); False for a declined adoption, whose
    adopter runs the program itself."""
    monkeypatch.setattr(adoption, "refusal", lambda *a: None)
    monkeypatch.setattr(adoption, "_kill", lambda pid: None)  # pid 424242 is no worker of ours
    from krex_async.linux.spawn import ExitStatus

    loop = asyncio.get_running_loop()
    done: asyncio.Future[ExitStatus] = loop.create_future()
    done.set_result(ExitStatus(3))
    answer: Launched | str = Launched(pid=424242, _done=done, via="pool") if ends else "module colorsys"
    fut: asyncio.Future[Launched | str] = loop.create_future()
    fut.set_result(answer)
    pool = cast(Pool, type("FakePool", (), {"adopted": 0, "declined": collections.Counter()})())
    sent: list[P.Msg] = []
    req = P.Adopt(id=2, command="c", token="t", argv=["python", "x.py"], cwd="/", env={})
    got = await adoption.serve(
        pool, req, os.getpid(), lambda m: sent.append(m) or True, lambda *a: fut, adoption.Tally()
    )
    assert got is ends
    assert [type(m).__name__ for m in sent] == (["Adopted", "AdoptExited"] if ends else ["Adopted"])
