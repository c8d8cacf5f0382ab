"""A command that starts while a region is held lands frozen; when the region ends it must run.

With the signal backend the new command's launch shell stops itself (`kill -STOP $$`). If the region
ends between the spawn and that self-stop, the thaw's SIGCONT arrives first and the later stop is
never undone: the command hangs forever (seen in bench/soak.py: 5 of 53 commands). With either
backend, a region may also end while the daemon is still spawning a command it admitted frozen
(creating its group awaits): that command must be thawed, not left frozen with no region to thaw it
(bench/soak.py at 16 agents left one or two of ~70 commands frozen in 3 of 3 runs; the soak's short
form in tests/faults/test_soak.py is the regression test for that window, which this test's `true`
commands are too quick to hit reliably). Here one command enters and leaves
short regions back to back while others start, so starts race region ends.
"""

from __future__ import annotations

import asyncio
import os

import pytest

from ..conftest import PY, py_env, run_daemon, v2_mount

CHURN = """
from krex_async import region
for _ in range(800):
    with region("churn"):
        pass
"""


@pytest.mark.parametrize("backend", ["signal", "cgroup"])
async def test_commands_started_during_short_regions_all_run(script, backend):
    if backend == "cgroup" and (os.geteuid() != 0 or v2_mount() is None):
        pytest.skip("the cgroup backend needs root and a writable cgroup v2 hierarchy")
    churn = script("churn.py", CHURN)
    async with run_daemon("--isolation", backend) as d:
        async with await d.client() as c:
            owner = await c.submit([PY, churn], env=py_env(), timeout=60)
            results = []
            for _ in range(6):
                batch = [await c.submit(["/bin/true"], timeout=5) for _ in range(10)]
                results += await asyncio.gather(*(h.wait() for h in batch))
            await owner.cancel()
            await owner.wait()
    states = [r.report.state for r in results]
    assert states == ["exited"] * len(states), states
