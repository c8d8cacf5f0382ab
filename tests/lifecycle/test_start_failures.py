"""A command whose start fails or is interrupted still ends, and its agent hears of it exactly once."""

from __future__ import annotations

import asyncio
import os

import pytest

from krex_async import KrexError

from ..conftest import PY, private_cgroup_root, remove_cgroup_tree, run_daemon

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
