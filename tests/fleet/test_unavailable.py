"""ActorUnavailableError is a blip, not a death: the connections between this process and a node's
agent are aborted by the kernel (`ss -K`, as a network failure ends them), and the client asks
again instead of marking the node down; a command whose stream broke is killed through the agent
that still runs it and ends `lost`, not left running unseen."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from krex_async import KrexError

from .conftest import NEEDS_RAY, PY, env
from .test_node_death import survivors

pytestmark = pytest.mark.slow
pytest.importorskip("ray", reason=NEEDS_RAY)
from krex_async.fleet.client import FleetClient  # noqa: E402
from krex_async.fleet.local import LocalFleet  # noqa: E402


def abort_links(pid: int) -> int:
    """Abort every TCP connection between this process and process `pid` (Ray's gRPC channels to
    and from the agent); returns how many."""
    ours = {(c.laddr, c.raddr) for c in psutil.Process().net_connections("tcp") if c.raddr}
    theirs = {(c.laddr, c.raddr) for c in psutil.Process(pid).net_connections("tcp") if c.raddr}
    links = [(lo, re) for lo, re in ours if (re, lo) in theirs]
    for lo, re in links:
        subprocess.run(
            ["ss", "-K", "-t", "src", f"{lo.ip}:{lo.port}", "dst", f"{re.ip}:{re.port}"],
            check=True,
            capture_output=True,
        )
    return len(links)


async def agent_pid(fc: FleetClient, node: str) -> int:
    return int((await fc.agents[node].hello.remote())["pid"])


async def test_an_unavailable_agent_is_asked_again_not_taken_for_dead(local_fleet: LocalFleet) -> None:
    """The links break while capacity() is in flight (its daemon held by SIGSTOP, so the call
    waits): Ray fails the call with ActorUnavailableError; the refresh asks again and the node
    stays up. The same for status()."""
    async with await local_fleet.connect(refresh_s=3600) as fc:  # refreshed here only
        pid = await agent_pid(fc, "node1")
        daemon = (await fc.capacity())["node1"]["daemon_pid"]
        for ask in (fc.refresh, fc.status):
            os.kill(daemon, signal.SIGSTOP)
            try:
                task = asyncio.ensure_future(ask())
                await asyncio.sleep(0.5)  # the call is with the agent, which waits on its daemon
                assert abort_links(pid) > 0
            finally:
                os.kill(daemon, signal.SIGCONT)
            answer = await task
            assert fc.nodes["node1"].up, fc.nodes["node1"]
            if answer is not None:
                assert [n["up"] for n in answer["nodes"] if n["node"] == "node1"] == [True], answer["nodes"]
        assert (await fc.run([PY, "-c", "print(1)"], env=env(), node="node1")).stdout == b"1\n"


async def test_a_stream_broken_by_a_blip_kills_its_command(local_fleet: LocalFleet) -> None:
    async with await local_fleet.connect(refresh_s=3600) as fc:
        code = "import time\nwhile True: print('tick', flush=True); time.sleep(0.05)"
        h = await fc.submit([PY, "-c", code, "blip-mark"], env=env(), node="node2", label="blip")
        pid = await agent_pid(fc, "node2")
        async for _stream, _data in h.output():
            break
        t0 = time.monotonic()
        assert abort_links(pid) > 0
        r = await asyncio.wait_for(h.wait(), 60)
        assert r.report.state == "lost", r.report
        assert "node node2: its agent became unavailable" in r.report.error, r.report
        assert "killed, not run again" in r.report.error, r.report
        # Killed on its node at once, not left to run with nobody reading it; the node stays in use.
        while survivors("blip-mark"):
            assert time.monotonic() - t0 < 15, survivors("blip-mark")
            await asyncio.sleep(0.1)
        assert fc.nodes["node2"].up, fc.nodes["node2"]
        assert (await fc.run([PY, "-c", "print(2)"], env=env(), node="node2")).stdout == b"2\n"


async def test_a_submit_broken_by_a_blip_never_runs_twice(local_fleet: LocalFleet, shared_tmp: Path) -> None:
    """The links break while run() waits on the daemon (held by SIGSTOP) to accept: the call may or
    may not have reached the agent (it did). Ray may surface that before the first item (submit()
    asks the agent to withdraw it: killed, KrexError) or after it (the handle's stream: killed,
    `lost`); either way it runs once at most, is placed nowhere else, and nothing of it runs on."""
    ran = shared_tmp / "ran"
    code = f"open({str(ran)!r}, 'a').write('x\\n'); import time; time.sleep(20)"
    async with await local_fleet.connect(refresh_s=3600) as fc:
        pid = await agent_pid(fc, "node0")
        daemon = (await fc.capacity())["node0"]["daemon_pid"]
        os.kill(daemon, signal.SIGSTOP)
        try:
            submit = asyncio.ensure_future(
                fc.submit([PY, "-c", code, "twice-mark"], env=env(), node="node0", label="once")
            )
            await asyncio.sleep(0.5)
            assert not submit.done()
            assert abort_links(pid) > 0
            await asyncio.sleep(0.5)
        finally:
            os.kill(daemon, signal.SIGCONT)
        try:
            h = await asyncio.wait_for(submit, 60)
        except KrexError as e:
            assert "node node0: its agent became unavailable" in e.message, e.message
            assert "is not submitted again" in e.message, e.message
        else:
            r = await asyncio.wait_for(h.wait(), 60)
            assert h.node == "node0" and r.report.state == "lost", r.report
            assert "became unavailable" in r.report.error and "not run again" in r.report.error, r.report
        t0 = time.monotonic()
        while survivors("twice-mark"):
            assert time.monotonic() - t0 < 15, survivors("twice-mark")
            await asyncio.sleep(0.1)
        assert not ran.exists() or ran.read_text() == "x\n"
        while live := [  # the daemon reaps the killed process and then says so: on a loaded host, later
            c for c in (await fc.status())["commands"] if c.get("label") == "once" and c["state"] != "ended"
        ]:
            assert time.monotonic() - t0 < 15, live
            await asyncio.sleep(0.1)
        assert fc.nodes["node0"].up, fc.nodes["node0"]


async def test_a_cancel_the_agent_never_answers_is_a_krex_error(
    local_fleet: LocalFleet, tmp_path: Path
) -> None:
    """A node's agent that hangs (stopped) never answers a cancel: the caller (the gateway's job
    timeout, its queue timeout, `krex cancel`) gets KrexError 'unreachable' after CANCEL_S, the
    error every cancel's caller handles, not Ray's or asyncio's own exception."""
    async with await local_fleet.connect(refresh_s=3600) as fc:
        h = await fc.submit([PY, "-c", "import time; time.sleep(30)"], env=env(), node="node0")
        pid = await agent_pid(fc, "node0")
        fc.CANCEL_S = 2.0
        os.kill(pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            with pytest.raises(KrexError) as e:
                await fc.cancel(h.command, signal.SIGKILL)
            assert e.value.code == "unreachable" and "no answer to the cancel within 2 s" in e.value.message
            assert time.monotonic() - t0 < 10
        finally:
            os.kill(pid, signal.SIGCONT)
        await fc.cancel(h.command, signal.SIGKILL)  # answered again once it runs
        assert (await asyncio.wait_for(h.wait(), 30)).report.state in ("cancelled", "failed")
