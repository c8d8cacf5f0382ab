"""A long poll (GET /v1/jobs/<id>?wait=true) ends when its client disconnects, instead of holding its
waiter for the rest of its timeout; a client that stays is still answered when the job changes.
The gateway's app is served in this process on a real socket, so its waiters can be watched."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from krex_async.gateway import catalog
from krex_async.gateway.app import Gateway, make_app
from krex_async.gateway.auth import Auth, Identity, RunAs
from krex_async.gateway.env import Environment
from krex_async.gateway.jobs import JobRunner
from krex_async.gateway.limits import Limits
from krex_async.gateway.store import Store
from tests.conftest import until


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[tuple[Gateway, str]]:
    """The app over a store whose jobs stay queued (the runner is never started)."""
    store = Store(tmp_path / "jobs.db")
    lim = Limits()
    kinds, missing = catalog.build(lim, frozenset(["local"]), None, sys.executable)
    runner = JobRunner(store, tmp_path / "jobs", lim, str(tmp_path / "none.sock"), kinds, lambda _j: None)
    who = Identity("default", RunAs(None, None, "default", None))
    gw = Gateway(store, runner, Environment(frozenset(["local"])), lim, kinds, missing, Auth({}, who))
    app_runner = web.AppRunner(make_app(gw), access_log=None)
    await app_runner.setup()
    site = web.TCPSite(app_runner, "127.0.0.1", 0)
    await site.start()
    port = app_runner.addresses[0][1]
    try:
        yield gw, f"http://127.0.0.1:{port}"
    finally:
        gw.close()
        await app_runner.cleanup()
        store.close()


async def test_a_long_poll_ends_when_its_client_disconnects(
    served: tuple[Gateway, str], caplog: pytest.LogCaptureFixture
) -> None:
    gw, url = served
    job, _ = gw.store.create("dev", {"command": "true"}, "t", None, None)
    job_id = job["job_id"]
    poll = f"{url}/v1/jobs/{job_id}?wait=true&timeout=60"
    caplog.set_level(logging.DEBUG, logger="aiohttp")
    async with aiohttp.ClientSession() as stays, aiohttp.ClientSession() as leaves:
        staying = asyncio.ensure_future(stays.get(poll))
        await until(lambda: len(gw.waiters.get(job_id, ())) == 1, "the first poll waits", 5)
        # The client gives up after 0.5 s (as urllib's timeout does) and closes its connection.
        with pytest.raises(asyncio.TimeoutError):
            async with leaves.get(poll, timeout=aiohttp.ClientTimeout(total=0.5)) as r:
                await r.read()
        assert len(gw.waiters[job_id]) == 2
        took = await until(lambda: len(gw.waiters[job_id]) == 1, "the abandoned poll ended", 3)
        assert took < 1.5, f"the server-side wait outlived its client by {took:.2f} s"
        assert gw.polls_left == 1 and not staying.done()  # the other still waits
        await asyncio.sleep(1.2)  # a few checks later: still connected, still waiting
        assert not staying.done() and gw.polls_left == 1
        gw.store.cancel(job_id)
        gw.changed(job_id)
        resp = await asyncio.wait_for(staying, 5)
        assert resp.status == 200 and (await resp.json())["status"] == "cancelled"
        resp.release()
        assert job_id not in gw.waiters
    errors = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert not errors, [r.getMessage() for r in errors]  # leaving is not an error
