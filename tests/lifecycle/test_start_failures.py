"""A command whose start fails or is interrupted still ends, and its agent hears of it exactly once."""

from __future__ import annotations

import asyncio
import os

import pytest

from krex_async import KrexError

from ..conftest import PY, private_cgroup_root, py_env, remove_cgroup_tree, run_daemon

SLEEP = [PY, "-c", "import time; time.sleep(0.8)"]


@pytest.fixture
def cgroup_root():
    root = private_cgroup_root()
    if root is None:
        pytest.skip("needs root and cgroup v2 (the cgroup backend)")
    try:
        yield root
    finally:
        remove_cgroup_tree(root)


async def test_a_group_that_cannot_be_created_fails_the_command_instead_of_hanging_it(cgroup_root):
    """cgroup.max.descendants stops the mkdir of the command's cgroup (EAGAIN), as a node-wide limit
    would: the queued command promoted onto the freed device, and one submitted directly, both end
    `failed` with the reason, and the device serves the next command."""
    krex_dir = os.path.join(cgroup_root, "krex")
    async with run_daemon("--policy", "command", "--cgroup-root", cgroup_root) as d:
        async with await d.client() as c:
            first = await c.submit(SLEEP)
            queued = await c.submit(SLEEP)
            with open(os.path.join(krex_dir, "cgroup.max.descendants"), "w") as f:
                f.write("0")  # the first command's cgroup exists; no new one can be made
            assert (await asyncio.wait_for(first.wait(), 10)).report.state == "exited"
            res = await asyncio.wait_for(queued.wait(), 10)
            assert res.report.state == "failed", res.report
            assert "cgroup" in res.report.error or "Resource" in res.report.error, res.report.error
            try:
                direct = await c.submit(SLEEP)
            except KrexError as e:  # refused before acceptance is honest too
                assert e.code in ("spawn_failed", "bad_spec"), e
            else:
                res = await asyncio.wait_for(direct.wait(), 10)
                assert res.report.state == "failed", res.report
            with open(os.path.join(krex_dir, "cgroup.max.descendants"), "w") as f:
                f.write("max")
            res = await asyncio.wait_for(c.run(SLEEP), 10)
            assert res.report.state == "exited", res.report


HOLDER = """
import time
from krex_async import region
with region("hold"):
    print("in", flush=True)
    time.sleep(30)
"""
LONG = [PY, "-c", "import time; time.sleep(30)"]
SHORT = [PY, "-c", "pass"]


async def _held_region(c, script):  # noqa: ANN001, ANN202
    """A command holding a region on the device: commands started now wait on the fence (cores)."""
    h = await c.submit([PY, script("holder.py", HOLDER)], env=py_env())
    async for _, data in h.output():
        if b"in" in data:
            return h
    raise AssertionError((await h.wait()).report)


async def test_a_cancel_while_the_command_is_starting_is_not_lost(cgroup_root, script):
    """Cancel sent the moment Accepted arrives, while the daemon still sets up the command's cgroup
    (a region is held, so the start fences cores and records that on a worker thread): the command
    ends `cancelled` at once instead of running to its end."""
    async with run_daemon("--cgroup-root", cgroup_root, "--region-timeout", "60") as d:
        async with await d.client() as c:
            holder = await _held_region(c, script)
            for i in range(8):
                h = await c.submit(LONG)
                await h.cancel(9)
                res = await asyncio.wait_for(h.wait(), 10)
                assert res.report.state == "cancelled", (i, res.report)
            await holder.cancel(9)
            await holder.wait()


async def test_an_agent_that_leaves_while_its_command_starts_does_not_strand_it(cgroup_root, script):
    """An agent submits with on_disconnect=keep and closes its connection the moment Accepted comes,
    while the daemon still sets up the command (a region is held): the command still runs and is
    reported to an agent that attaches, instead of staying 'starting' with its cgroup forever."""
    async with run_daemon("--cgroup-root", cgroup_root, "--region-timeout", "60") as d:
        async with await d.client() as c:
            holder = await _held_region(c, script)
            ids = []
            for _ in range(6):
                async with await d.client() as gone:
                    ids.append((await gone.submit(SHORT, on_disconnect="keep")).command)
            await holder.cancel(9)
            await holder.wait()
            for cid in ids:
                res = await asyncio.wait_for((await c.attach(cid)).wait(), 10)
                assert res.report.state == "exited", res.report
