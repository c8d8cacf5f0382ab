"""--queue-timeout: a job not started that long after it was submitted ends failed, reason
queue_timeout, saying why it waited (every slot taken, or no daemon); its long polls answer then;
it never runs afterwards; without the flag a job waits as long as it takes."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from krex_async.gateway import queue_timeout

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
    assert queue_timeout(None, {}) is None
    assert queue_timeout("2.5", {"KREX_GATEWAY_QUEUE_TIMEOUT": "9"}) == 2.5
    assert queue_timeout(None, {"KREX_GATEWAY_QUEUE_TIMEOUT": "9"}) == 9
    assert queue_timeout(None, {"KREX_GATEWAY_QUEUE_TIMEOUT": ""}) is None  # empty: unset
    for flag, env, named in (
        ("0", {}, "--queue-timeout"),
        ("-1", {}, "--queue-timeout"),
        ("inf", {}, "--queue-timeout"),
        (None, {"KREX_GATEWAY_QUEUE_TIMEOUT": "soon"}, "KREX_GATEWAY_QUEUE_TIMEOUT"),
    ):
        with pytest.raises(ValueError, match=named):
            queue_timeout(flag, env)
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
