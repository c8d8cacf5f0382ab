"""How often the fleet client asks Ray for its nodes: every 10 refreshes, and sooner, backing off,
while a known node has no agent. It asked at every refresh for as long as any node had none, a
node removed for good included: ray.nodes() (a GCS call listing every node the cluster had) each
second, for the client's life."""

from __future__ import annotations

import asyncio
import time

import pytest

from krex_async.fleet.discovery import DiscoverPace

from .conftest import NEEDS_RAY


def asks(pace: DiscoverPace, missing_at: dict[int, set[str]], ticks: int) -> list[int]:
    """The refreshes (1..ticks) that ask, with `missing_at[t]` the agentless nodes from refresh t."""
    missing: set[str] = set()
    out = []
    for tick in range(1, ticks + 1):
        missing = missing_at.get(tick, missing)
        if pace.due(tick, missing):
            out.append(tick)
    return out


def test_every_nth_refresh_while_every_node_has_its_agent() -> None:
    assert asks(DiscoverPace(10), {}, 35) == [10, 20, 30]


def test_a_node_without_agent_is_looked_for_sooner_backing_off_to_the_regular_pace() -> None:
    # lost at refresh 3 for good: 1, 2, 4, 8 refreshes after each ask, then every 10
    assert asks(DiscoverPace(10), {3: {"gone"}}, 60) == [3, 5, 9, 17, 27, 37, 47, 57]


def test_the_steps_start_again_for_another_loss_and_once_every_node_is_back() -> None:
    lost = {3: {"a"}, 20: {"a", "b"}, 30: set(), 31: {"c"}}
    assert asks(DiscoverPace(10), lost, 45) == [3, 5, 9, 17, 20, 22, 26, 31, 33, 37, 45]


@pytest.mark.slow
async def test_a_node_removed_for_good_is_not_looked_for_at_every_refresh(local_fleet: object) -> None:
    """A real node removed (its raylet and agent killed): once its agent is known dead, the
    refresher asks Ray for nodes at a small share of its refreshes, not at each."""
    pytest.importorskip("ray", reason=NEEDS_RAY)
    from krex_async.fleet.local import LocalFleet

    assert isinstance(local_fleet, LocalFleet)
    async with await local_fleet.connect(refresh_s=0.05) as fc:
        local_fleet.add_node("gone")
        try:
            deadline = time.monotonic() + 60
            while not fc.nodes.get("gone") or not fc.nodes["gone"].up:
                assert time.monotonic() < deadline, fc.nodes
                await asyncio.sleep(0.05)
        finally:
            local_fleet.remove_node("gone")
        deadline = time.monotonic() + 60
        while "gone" in fc.agents:  # Ray calls the agent unavailable until it knows it died
            assert time.monotonic() < deadline, fc.nodes["gone"]
            await asyncio.sleep(0.05)
        count = {"discover": 0, "refresh": 0}
        discover, refresh = fc.discover, fc.refresh

        async def counted_discover() -> list[str]:
            count["discover"] += 1
            return await discover()

        async def counted_refresh() -> None:
            count["refresh"] += 1
            await refresh()

        fc.discover, fc.refresh = counted_discover, counted_refresh  # type: ignore[method-assign]
        while count["refresh"] < 40:
            await asyncio.sleep(0.05)
        assert "gone" not in fc.agents and not fc.nodes["gone"].up, fc.nodes["gone"]
        assert 1 <= count["discover"] <= count["refresh"] // 4, count
        # the other nodes are still served
        assert all(fc.nodes[n].up for n in ("node0", "node1", "node2")), fc.nodes
