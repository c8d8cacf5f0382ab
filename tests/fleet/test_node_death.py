"""A whole Ray node dies mid-run (its raylet and workers killed): its commands are reported lost by
name, the other nodes' commands finish, and the fleet places nothing more there."""

from __future__ import annotations

import asyncio
import sys
import time

import pytest

from krex_async import KrexError

from .conftest import NEEDS_RAY, env

pytestmark = pytest.mark.slow
pytest.importorskip("ray", reason=NEEDS_RAY)
from krex_async.fleet.local import LocalFleet  # noqa: E402
PY = sys.executable


async def test_node_removed_mid_run(local_fleet: LocalFleet) -> None:
    local_fleet.add_node("extra")
    try:
        async with await local_fleet.connect() as fc:
            assert fc.nodes["extra"].up, fc.nodes
            sleep = [PY, "-c", "import time; time.sleep(2.0); print('done')"]
            doomed = [await fc.submit(sleep, env=env(), node="extra") for _ in range(2)]
            others = [await fc.submit(sleep, env=env(), node=n) for n in ("node0", "node1")]
            await asyncio.sleep(0.5)
            t0 = time.monotonic()
            local_fleet.remove_node("extra")
            results = await asyncio.gather(*(h.wait() for h in doomed + others))
            elapsed = time.monotonic() - t0
            for r, h in zip(results[:2], doomed):
                assert r.report.state == "lost" and r.report.command == h.command, r.report
                assert "node extra" in r.report.error, r.report
            assert [r.stdout for r in results[2:]] == [b"done\n", b"done\n"]
            assert sorted(fc.lost) == sorted(h.command for h in doomed)
            assert elapsed < 30, elapsed
            assert not fc.nodes["extra"].up
            with pytest.raises(KrexError, match="extra"):
                await fc.submit(sleep, env=env(), node="extra")
            assert (await fc.run([PY, "-c", "print(1)"], env=env())).stdout == b"1\n"
    finally:
        if "extra" in local_fleet.ray_nodes:
            local_fleet.remove_node("extra")
