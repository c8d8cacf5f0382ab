"""--queue-timeout: a job not started that long after it was submitted ends failed, reason
queue_timeout, saying why it waited (every slot taken, or no daemon); its long polls answer then;
it never runs afterwards; without the flag a job waits as long as it takes."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from krex_async import protocol as P
from krex_async.client.submit import Client, KrexError
from krex_async.gateway import queue_timeout_s
from tests.conftest import py_env, run_daemon

from .conftest import stack, start_gateway, stopped_daemon_socket


async def test_a_job_queued_past_the_timeout_fails_and_never_runs(tmp_path: Path) -> None:
    async with stack(tmp_path, "--max-running", "1", "--queue-timeout", "1.5") as (_, gw, c):
        long = await c.dev(f"touch {gw.scratch}/long; sleep 4")
        while not (gw.scratch / "long").exists():
            await asyncio.sleep(0.05)
        stuck = await c.dev(f"touch {gw.scratch}/stuck")
        t = time.monotonic()
        view = await c.get(stuck["job_id"], wait=True, timeout=20)  # answered as it fails
        waited = time.monotonic() - t
        assert view["status"] == "failed" and view["error"]["reason"] == "queue_timeout", view
        assert "1.5 s" in view["error"]["message"] and "max-running" in view["error"]["message"]
        assert 0.5 < waited < 3.0, waited
        assert (await c.get(long["job_id"]))["status"] == "running"  # started in time: not touched
        assert (await c.wait(long["job_id"], 30))["status"] == "succeeded"
        await asyncio.sleep(0.5)
        assert not (gw.scratch / "stuck").exists()  # its slot came free, but it had ended
        assert not (gw.state / "jobs" / stuck["job_id"]).exists()
        fresh = await c.wait((await c.dev("echo on time"))["job_id"], 30)
        assert fresh["status"] == "succeeded", fresh


async def test_a_job_queued_in_the_daemon_past_the_timeout_is_withdrawn_there(tmp_path: Path) -> None:
    """Handed to a daemon that runs one command at a time (--policy command), the second job
    waits in the daemon's queue: at its deadline it is cancelled there and ends as a job the
    gateway kept queued does, its slot free, its directory kept, and it never runs."""
    async with stack(
        tmp_path, "--max-running", "3", "--queue-timeout", "2", daemon_args=("--policy", "command")
    ) as (daemon, gw, c):
        long = await c.dev(f"touch {gw.scratch}/long; sleep 5")
        while not (gw.scratch / "long").exists():
            await asyncio.sleep(0.05)
        t = time.monotonic()
        stuck = await c.dev(f"touch {gw.scratch}/stuck")
        await asyncio.sleep(0.5)
        view = await c.get(stuck["job_id"])
        assert view["status"] == "running", view  # the daemon has it, queued, and the view says so:
        assert (
            view["waiting"].startswith("queued in the krex daemon for device ")
            and "command" in view["waiting"]
        )
        assert "waiting" not in await c.get(long["job_id"])  # started: nothing to wait for
        view = await c.get(stuck["job_id"], wait=True, timeout=20)  # answered as it fails
        waited = time.monotonic() - t
        assert view["status"] == "failed" and view["error"]["reason"] == "queue_timeout", view
        assert view["result"] is None, view
        assert "2 s" in view["error"]["message"] and "daemon" in view["error"]["message"], view
        assert 1.5 < waited < 4.0, waited
        assert (gw.state / "jobs" / stuck["job_id"]).is_dir()  # its record and files are kept
        assert (await c.get(long["job_id"]))["status"] == "running"  # started in time: not touched
        assert (await c.wait(long["job_id"], 30))["status"] == "succeeded"
        await asyncio.sleep(0.5)
        assert not (gw.scratch / "stuck").exists()  # the device came free, but it had ended
        async with await Client.connect(daemon.socket) as k:  # the daemon ended it unstarted
            cmds = {x["label"]: x for x in (await k.status())["commands"]}
        assert cmds[f"gateway {stuck['job_id']}"]["state"] == "ended", cmds
        fresh = await c.wait((await c.dev("echo on time"))["job_id"], 30)
        assert fresh["status"] == "succeeded", fresh


async def test_a_job_the_daemon_starts_before_its_deadline_is_not_touched(tmp_path: Path) -> None:
    async with stack(
        tmp_path, "--max-running", "3", "--queue-timeout", "2", daemon_args=("--policy", "command")
    ) as (_, gw, c):
        first = await c.dev(f"touch {gw.scratch}/first; sleep 1")
        while not (gw.scratch / "first").exists():
            await asyncio.sleep(0.05)
        second = await c.dev("sleep 2.5; echo done")  # queued ~1 s in the daemon, then runs past 2 s
        view = await c.wait(second["job_id"], 30)
        assert view["status"] == "succeeded" and "done" in view["result"]["stdout"], view
        assert (await c.wait(first["job_id"], 30))["status"] == "succeeded"


async def test_a_cancel_only_if_queued_ends_a_queued_command_and_spares_a_running_one() -> None:
    """The daemon's side (Cancel.queued_only): it decides in one step, so the gateway's queue
    timeout cannot kill a command that started as its cancel came."""
    async with run_daemon("--policy", "command") as daemon, await Client.connect(daemon.socket) as k:
        running = await k.submit(["sleep", "1.5"], env=py_env())
        queued = await k.submit(["sleep", "1.5"], env=py_env())
        assert not running.queued and queued.queued
        with pytest.raises(KrexError) as refused:
            await k.cancel(running.command, 9, queued_only=True)
        assert refused.value.code == "not_queued", refused.value
        await k.cancel(queued.command, 9, queued_only=True)
        withdrawn = (await queued.wait()).report
        assert withdrawn.state == "cancelled" and not withdrawn.started_at, withdrawn
        ran = (await running.wait()).report
        assert ran.state == "exited" and ran.exit_code == 0, ran


async def test_a_cancel_only_if_queued_is_never_sent_to_a_daemon_that_would_not_honour_it() -> None:
    """A daemon from before Cancel.queued_only drops the field (msgspec ignores fields it does not
    know) and would signal a command that started as the queue timeout came. The client sends
    such a cancel only to a daemon whose Welcome names the feature; to an older one it sends
    nothing (KrexError unsupported: the queue timeout leaves the command to run)."""
    d = tempfile.mkdtemp(prefix="krexq-", dir="/tmp")
    path = os.path.join(d, "s")
    got: list[P.Msg] = []

    async def older_daemon(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while (body := await P.read_frame(reader)) is not None:
            req = P.decode_request(body)
            got.append(req)
            if isinstance(req, P.Hello):  # its Welcome, as an older krex sends it: no features
                writer.write(P.encode(P.Welcome(id=req.id, version=1, server="krex", policy="command")))
            else:  # a Cancel, queued_only dropped: done, whatever the command's state
                writer.write(P.encode(P.Ok(id=req.id)))
        writer.close()

    server = await asyncio.start_unix_server(older_daemon, path)
    try:
        async with await Client.connect(path) as k:
            with pytest.raises(KrexError) as refused:
                await asyncio.wait_for(k.cancel("c-1", 9, queued_only=True), 5)
            assert refused.value.code == "unsupported", refused.value
            await asyncio.wait_for(k.cancel("c-1", 15), 5)  # a plain cancel still goes
        assert [type(m) for m in got] == [P.Hello, P.Cancel] and got[1].signal == 15, got
    finally:
        server.close()
        os.unlink(path)
        os.rmdir(d)
    async with run_daemon() as daemon, await Client.connect(daemon.socket) as k:
        assert k.welcome is not None and P.CANCEL_QUEUED_ONLY in k.welcome.features, k.welcome


async def test_a_job_waiting_for_no_daemon_fails_saying_so(gwhome: Path) -> None:
    sock = await stopped_daemon_socket()
    gw = start_gateway(sock, gwhome / "gw", "--queue-timeout", "1")
    c = gw.client()
    try:
        job = await c.dev("echo never")
        view = await c.wait(job["job_id"], 10)
        assert view["error"]["reason"] == "queue_timeout", view
        assert "waiting for the krex daemon" in view["error"]["message"], view
    finally:
        await c.close()
        gw.stop()


async def test_without_the_flag_a_job_waits(gwhome: Path) -> None:
    sock = await stopped_daemon_socket()
    gw = start_gateway(sock, gwhome / "gw")
    c = gw.client()
    try:
        job = await c.dev("echo late")
        await asyncio.sleep(2.0)
        assert (await c.get(job["job_id"]))["status"] == "queued"
    finally:
        await c.close()
        gw.stop()


def test_the_queue_timeout_flag_and_variable() -> None:
    assert queue_timeout_s(None, {}) is None
    assert queue_timeout_s("2.5", {"KREX_GATEWAY_QUEUE_TIMEOUT": "9"}) == 2.5
    assert queue_timeout_s(None, {"KREX_GATEWAY_QUEUE_TIMEOUT": "9"}) == 9
    assert queue_timeout_s(None, {"KREX_GATEWAY_QUEUE_TIMEOUT": ""}) is None  # empty: unset
    for flag, env, named in (
        ("0", {}, "--queue-timeout"),
        ("-1", {}, "--queue-timeout"),
        ("inf", {}, "--queue-timeout"),
        (None, {"KREX_GATEWAY_QUEUE_TIMEOUT": "soon"}, "KREX_GATEWAY_QUEUE_TIMEOUT"),
    ):
        with pytest.raises(ValueError, match=named):
            queue_timeout_s(flag, env)
    for args, env in ((["--queue-timeout", "soon"], {}), ([], {"KREX_GATEWAY_QUEUE_TIMEOUT": "-3"})):
        r = subprocess.run(
            [sys.executable, "-m", "krex_async.gateway", "--state-dir", "/nonexistent", *args],
            capture_output=True,
            text=True,
            timeout=30,
            env={**os.environ, **env},
        )
        named = "--queue-timeout" if args else "KREX_GATEWAY_QUEUE_TIMEOUT"
        assert r.returncode == 2 and named in r.stderr, r.stderr
