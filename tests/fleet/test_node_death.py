"""A whole Ray node dies mid-run (its raylet and workers killed): its commands are reported lost by
name, the other nodes' commands finish, and the fleet places nothing more there."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from krex_async import KrexError

from .conftest import NEEDS_RAY, PY, env

pytestmark = pytest.mark.slow
pytest.importorskip("ray", reason=NEEDS_RAY)
from krex_async.fleet.local import LocalFleet  # noqa: E402


def survivors(marker: str) -> list[int]:
    """Pids whose command line holds `marker`."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read().split(b"\0"):
                    out.append(int(pid))
        except OSError:
            pass
    return out


async def test_node_removed_mid_run(local_fleet: LocalFleet) -> None:
    async with await local_fleet.connect() as fc:
        assert "extra" not in fc.nodes
        local_fleet.add_node("extra")
        try:
            # A node that joins later is found (the refresher does this every 10 refreshes).
            assert await fc.discover() == ["extra"]
            await fc.refresh()
            assert fc.nodes["extra"].up, fc.nodes
            sleep = [PY, "-c", "import time; time.sleep(2.0); print('done')"]
            marked = [PY, "-c", "import time; time.sleep(2.0); print('done')", "doomed-marker"]
            doomed = [await fc.submit(marked, env=env(), node="extra") for _ in range(2)]
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
            # The node's daemon got the agent's death signal and ended its commands.
            deadline = time.monotonic() + 10
            while survivors("doomed-marker"):
                assert time.monotonic() < deadline, survivors("doomed-marker")
                await asyncio.sleep(0.2)
            with pytest.raises(KrexError, match="extra"):
                await fc.submit(sleep, env=env(), node="extra")
            assert (await fc.run([PY, "-c", "print(1)"], env=env())).stdout == b"1\n"
        finally:
            if "extra" in local_fleet.ray_nodes:
                local_fleet.remove_node("extra")
