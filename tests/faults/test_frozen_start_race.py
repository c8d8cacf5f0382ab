"""A command that starts while a region is held lands frozen; when the region ends it must run.

With the signal backend the new command's launch shell stops itself (`kill -STOP $$`). If the region
ends between the spawn and that self-stop, the thaw's SIGCONT arrives first and the later stop is
never undone: the command hangs forever (seen in bench/soak.py: 5 of 53 commands). Here one command
enters and leaves short regions back to back while others start, so starts race region ends.
"""

from __future__ import annotations

import asyncio

from ..conftest import PY, py_env, run_daemon

CHURN = """
from krex_async import region
for _ in range(800):
    with region("churn"):
        pass
"""


async def test_commands_started_during_short_regions_all_run(script):
    churn = script("churn.py", CHURN)
    async with run_daemon("--isolation", "signal") as d:
        async with await d.client() as c:
            owner = await c.submit([PY, churn], env=py_env(), timeout=60)
            results = []
            for _ in range(6):
                batch = [await c.submit(["/bin/true"], timeout=5) for _ in range(10)]
                results += await asyncio.gather(*(h.wait() for h in batch))
            await owner.wait()
    states = [r.report.state for r in results]
    assert states == ["exited"] * len(states), states
