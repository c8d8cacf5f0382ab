"""The fleet on a real local Ray cluster of 3 nodes, each with a real daemon: placement, regions
kept per node, a daemon killed mid-run, and one result per command."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time

import pytest

from krex_async.client.submit import KrexError

from .conftest import NEEDS_RAY, PY, by_node, env

pytestmark = pytest.mark.slow
pytest.importorskip("ray", reason=NEEDS_RAY)
from krex_async.fleet.local import LocalFleet  # noqa: E402


async def test_commands_spread_over_the_nodes_and_their_devices(local_fleet: LocalFleet) -> None:
    async with await local_fleet.connect() as fc:
        assert sorted(fc.nodes) == ["node0", "node1", "node2"]
        assert all(v.up for v in fc.nodes.values()), fc.nodes
        hs = [
            await fc.submit([PY, "-c", "import time; time.sleep(1.0); print('ok')"], env=env())
            for _ in range(6)
        ]
        # One per device: 3 nodes x cpu:2, each placed on the least loaded device fleet-wide.
        assert by_node(hs) == {"node0": 2, "node1": 2, "node2": 2}
        assert len({h.device for h in hs}) == 6
        cap = await fc.capacity()
        assert sum(c["running"] + c["queued"] for c in cap.values()) == 6, cap
        status = await fc.status()
        names = {c["command"] for c in status["commands"]}
        assert {h.command for h in hs} <= names
        results = await asyncio.gather(*(h.wait() for h in hs))
        assert [r.stdout for r in results] == [b"ok\n"] * 6
        assert [r.report.command for r in results] == [h.command for h in hs]
        assert all(r.report.device.startswith(h.node + "/") for r, h in zip(results, hs))


HOLDER = """
import sys, time
from krex_async import region
time.sleep(0.3)
with region("timing") as r:
    t0 = time.time(); time.sleep(1.5); t1 = time.time()
print(t0, t1, " ".join(r.report.frozen))
"""

TICKER = """
import sys, time
end = time.time() + 3.0
while time.time() < end:
    print(time.time(), flush=True)
    time.sleep(0.02)
"""


def gaps(stdout: bytes, t0: float, t1: float) -> tuple[int, float]:
    """(ticks inside [t0, t1], the longest gap between ticks)."""
    ts = [float(x) for x in stdout.split()]
    inside = sum(t0 <= t <= t1 for t in ts)
    return inside, max(b - a for a, b in zip(ts, ts[1:]))


async def test_a_region_on_one_node_freezes_nothing_on_another(local_fleet: LocalFleet) -> None:
    async with await local_fleet.connect() as fc:
        holder = await fc.submit([PY, "-c", HOLDER], env=env(), node="node0", device="cpu0")
        near = await fc.submit([PY, "-c", TICKER], env=env(), node="node0", device="cpu0")
        far = await fc.submit([PY, "-c", TICKER], env=env(), node="node1", device="cpu0")
        h, n, f = await asyncio.gather(holder.wait(), near.wait(), far.wait())
    assert h.report.state == "exited", h
    t0, t1, *frozen = h.stdout.split()
    start, end = float(t0), float(t1)
    # The same device's sibling is frozen for the region, by its daemon id; the other node's
    # command on a device of the same key is not, and ticks on through the region.
    assert frozen == [near.daemon_command.encode()]
    assert h.report.regions[0].frozen == [near.daemon_command]
    inside, longest = gaps(n.stdout, start + 0.05, end - 0.05)
    assert inside == 0 and longest >= 1.3, (inside, longest)
    inside, longest = gaps(f.stdout, start, end)
    assert inside >= 30 and longest < 0.5, (inside, longest)


async def test_daemon_killed_mid_run_its_commands_lost_others_finish(local_fleet: LocalFleet) -> None:
    async with await local_fleet.connect() as fc:
        hs = [
            await fc.submit(
                [PY, "-c", "import time; time.sleep(2.5); print('done')"], env=env(), label=f"job {i}"
            )
            for i in range(6)
        ]
        victims = [h for h in hs if h.node == "node1"]
        assert len(victims) == 2
        cap = (await fc.capacity())["node1"]
        await asyncio.sleep(0.5)
        os.kill(cap["daemon_pid"], signal.SIGKILL)
        t0 = time.monotonic()
        results = await asyncio.gather(*(h.wait() for h in hs))
        for h, r in zip(hs, results):
            if h.node == "node1":
                assert r.report.state == "lost", r.report
                assert r.report.command == h.command and "node node1" in r.report.error
                assert r.report.label == h._spec["label"]
            else:
                assert r.report.state == "exited" and r.stdout == b"done\n", r.report
        assert sorted(fc.lost) == sorted(h.command for h in victims)
        assert time.monotonic() - t0 < 10
        # The agent starts its daemon again on the same state dir (whose sweep ends what the dead
        # one left); the node takes commands again once its report says it is up.
        deadline = time.monotonic() + 20
        while not fc.nodes["node1"].up:
            assert time.monotonic() < deadline, fc.nodes["node1"]
            await asyncio.sleep(0.2)
        again = await fc.run([PY, "-c", "print('back')"], env=env(), node="node1")
        assert again.stdout == b"back\n" and again.report.command.startswith("node1/")
        # The old daemon's commands did not outlive it: the new daemon's sweep ended them.
        st = await fc.status()
        assert not [c for c in st["commands"] if c["node"] == "node1" and c["state"] != "ended"], st[
            "commands"
        ]


async def test_200_commands_exactly_200_results(local_fleet: LocalFleet) -> None:
    async with await local_fleet.connect() as fc:
        hs = await asyncio.gather(*(fc.submit([PY, "-c", f"print({i})"], env=env()) for i in range(200)))
        results = await asyncio.gather(*(h.wait() for h in hs))
    assert len(results) == 200
    assert len({r.report.command for r in results}) == 200
    assert sorted(int(r.stdout) for r in results) == list(range(200))
    assert all(r.report.state == "exited" and r.returncode == 0 for r in results)
    spread = by_node(hs)
    assert set(spread) == {"node0", "node1", "node2"} and min(spread.values()) >= 40, spread
    assert fc.lost == []


async def test_bad_input_is_a_clear_error(local_fleet: LocalFleet) -> None:
    from krex_async import KrexError

    async with await local_fleet.connect() as fc:
        with pytest.raises(KrexError, match="no node 'nodeX'"):
            await fc.submit(["true"], node="nodeX")
        with pytest.raises(KrexError, match="nvidia0"):
            await fc.submit(["true"], device="nvidia0")
        with pytest.raises(KrexError, match="memory"):
            await fc.submit(["true"], mem=1 << 60)
        if os.geteuid() == 0:  # run as its user: the daemon finds that out as it starts it
            r = await fc.run(["/nonexistent/prog"], env=env())
            assert r.report.state == "failed" and "not found" in r.report.error, r.report
        else:
            with pytest.raises(KrexError, match=r"node node\d: .*not found"):
                await fc.submit(["/nonexistent/prog"], env=env())
        with pytest.raises(KrexError, match="NODE/ID"):
            await fc.cancel("nonsense")


async def test_cancel_reaches_the_command_on_its_node(local_fleet: LocalFleet) -> None:
    async with await local_fleet.connect() as fc:
        h = await fc.submit(
            [PY, "-c", "import time; print('up', flush=True); time.sleep(30)"], env=env(), node="node2"
        )
        seen = b""
        async for _stream, data in h.output():
            seen += data
            if seen == b"up\n":
                break
        await h.cancel()
        r = await h.wait()
    assert r.report.state in ("cancelled", "signaled"), r.report
    assert r.stdout == b"up\n"


async def test_a_fleet_command_says_it_started_and_a_queued_only_cancel_leaves_it(
    local_fleet: LocalFleet,
) -> None:
    """As on a node's own socket: the handle hears its command start (a queued job's timeout runs
    from then), and a cancel only-if-queued (the gateway's queue timeout) of a command that started
    is refused on its node, which runs it to its end."""
    async with await local_fleet.connect() as fc:
        h = await fc.submit([PY, "-c", "import time; time.sleep(2); print('done')"], env=env(), node="node1")
        ended = asyncio.get_running_loop().create_task(h.wait())
        deadline = time.monotonic() + 20
        while h.pid is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert h.pid, "no start heard"
        with pytest.raises(KrexError) as refused:
            await fc.cancel(h.command, signal.SIGKILL, queued_only=True)
        assert refused.value.code == "not_queued", refused.value
        r = await ended
    assert r.report.state == "exited" and r.stdout == b"done\n", r.report


async def test_two_clients_of_one_process_join_the_cluster_together(local_fleet: LocalFleet) -> None:
    """A process that connects twice at once (the gateway's job runner and its env view) joins Ray
    once: both find it not yet joined before their address check, and the second ray.init must not
    fail the second client."""
    assert local_fleet.cluster is not None
    code = (
        "import asyncio, sys\n"
        "from krex_async.fleet.client import FleetClient\n"
        "async def main(address):\n"
        "    a, b = await asyncio.gather(FleetClient.connect(address), FleetClient.connect(address))\n"
        "    async with a, b:\n"
        "        print(len(a.nodes), len(b.nodes))\n"
        "asyncio.run(main(sys.argv[1]))\n"
    )
    async with await local_fleet.connect():  # the agents exist first
        pass
    proc = await asyncio.create_subprocess_exec(
        sys.executable,  # a client, as root: this venv's Python (Ray wants the cluster's exact one)
        "-c",
        code,
        local_fleet.cluster.address,
        env=env(KREX_RAY_TOKEN_FILE=local_fleet.token_file),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 0, err.decode()[-2000:]
    assert out.decode().split() == ["3", "3"], out
