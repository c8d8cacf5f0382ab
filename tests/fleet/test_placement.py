"""Placement over capacity reports: pure logic, no Ray."""

from __future__ import annotations

import pytest

from krex_async.devices import NoDevice
from krex_async.fleet.placement import NodeView, pick

GiB = 1 << 30


def view(name: str, *devs: tuple[str, int, list[str]], up: bool = True) -> NodeView:
    return NodeView(
        name,
        up=up,
        reason="" if up else "daemon gone",
        devices=[
            {"key": k, "index": i, "vendor": "nvidia", "memory_free_bytes": free, "commands": cmds}
            for i, (k, free, cmds) in enumerate(devs)
        ],
    )


def test_fewest_commands_across_nodes_then_most_memory() -> None:
    a = view("a", ("nvidia0", 80 * GiB, ["1", "2"]), ("nvidia1", 80 * GiB, ["3"]))
    b = view("b", ("nvidia0", 40 * GiB, ["9"]), ("nvidia1", 70 * GiB, []))
    assert pick([a, b]) == ("b", "nvidia1")
    b.devices[1]["commands"] = ["7"]
    assert pick([a, b]) == ("a", "nvidia1")  # 1 command each on 3 devices: most free memory wins


def test_memory_asked_for_excludes_devices_and_says_what_there_is() -> None:
    a = view("a", ("nvidia0", 10 * GiB, []))
    b = view("b", ("nvidia0", 60 * GiB, ["1", "2", "3"]))
    assert pick([a, b], mem=20 * GiB) == ("b", "nvidia0")
    with pytest.raises(NoDevice, match="memory"):
        pick([a, b], mem=100 * GiB)


def test_our_commands_count_at_once_and_once() -> None:
    a = view("a", ("cpu0", 0, []))
    b = view("b", ("cpu0", 0, []))
    a.ours["cpu0"] = {"x"}  # placed since a's report: counts before the next report
    assert pick([a, b]) == ("b", "cpu0")
    b.devices[0]["commands"] = ["y"]
    b.ours["cpu0"] = {"y"}  # reported and ours: counted once
    a.ours["cpu0"] = {"x", "z"}
    assert pick([a, b]) == ("b", "cpu0")


def test_down_nodes_pinned_nodes_and_device_keys() -> None:
    a = view("a", ("cpu0", 0, []), up=False)
    b = view("b", ("cpu0", 0, ["1"]), ("cpu1", 0, ["2", "3"]))
    assert pick([a, b]) == ("b", "cpu0")
    assert pick([a, b], device="cpu1") == ("b", "cpu1")
    assert pick([a, b], device="none") == ("b", "none")
    with pytest.raises(NoDevice, match="no node 'c'"):
        pick([a, b], node="c")
    with pytest.raises(NoDevice, match="a: daemon gone"):
        pick([a, b], node="a")
    with pytest.raises(NoDevice, match="nvidia7"):
        pick([a, b], device="nvidia7")
    b.up = False
    with pytest.raises(NoDevice, match="no node of the fleet is up"):
        pick([a, b])
