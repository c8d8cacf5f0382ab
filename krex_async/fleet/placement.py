"""Where a fleet command goes: pure logic over the nodes' last capacity reports and the client's own
commands, testable without Ray.

A node's report lists the command ids on each device. The client knows which of those are its own
and which of its own it placed since the report was taken, so a device's load is exact for this
client's commands and as fresh as the last report for everyone else's. The pick itself is the
daemon's `--device auto` rule (`devices.place`) over every device of every node that is up.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from krex_async.devices import NoDevice, place
from krex_async.devices.base import Device


@dataclass
class NodeView:
    """One node as the client sees it: its last capacity report and what it placed there since."""

    name: str
    up: bool = False
    reason: str = ""  # why the node is down ("" when up)
    devices: list[dict[str, Any]] = field(default_factory=list)  # the report's devices
    ours: dict[str, set[str]] = field(default_factory=dict)  # device key -> our command ids

    def load(self, key: str) -> int:
        """Commands on device `key`: everyone else's as last reported, ours exactly."""
        reported: set[str] = set()
        for d in self.devices:
            if d["key"] == key:
                reported = set(d.get("commands", []))
        mine = self.ours.get(key, set())
        return len(reported - mine) + len(mine)


def pick(
    nodes: list[NodeView], mem: int = 0, device: str = "auto", node: str | None = None
) -> tuple[str, str]:
    """(node name, device key) for one command: among the nodes that are up (only `node` if given)
    and their devices (only those keyed `device` unless it is "auto"), the one with the fewest
    commands that has `mem` bytes free; ties to the most free memory, then the first node.

    device "none" picks the node with the fewest commands and passes "none" on. Raises NoDevice
    saying what was asked and what the fleet has when nothing fits.
    """
    up = [n for n in nodes if n.up and (node is None or n.name == node)]
    if not up:
        if node is not None and not any(n.name == node for n in nodes):
            raise NoDevice(
                f"no node {node!r} in the fleet (nodes: {', '.join(n.name for n in nodes) or 'none'})"
            )
        down = "; ".join(f"{n.name}: {n.reason or 'down'}" for n in nodes if not n.up)
        raise NoDevice(f"no node of the fleet is up ({down or 'no nodes'})")
    if device == "none":
        best = min(up, key=lambda n: (sum(n.load(d["key"]) for d in n.devices), nodes.index(n)))
        return best.name, "none"
    candidates: list[Device] = []
    where: list[tuple[str, str]] = []
    counts: dict[str, int] = {}
    for n in up:
        for d in n.devices:
            if device != "auto" and device not in (d["key"], str(d.get("index"))):
                continue
            candidates.append(
                Device(
                    index=len(candidates),
                    key=f"{n.name}/{d['key']}",
                    vendor=d.get("vendor", ""),
                    name=d.get("name", ""),
                    memory_total_bytes=d.get("memory_total_bytes") or 0,
                    memory_free_bytes=d.get("memory_free_bytes") or 0,
                )
            )
            where.append((n.name, d["key"]))
            counts[candidates[-1].key] = n.load(d["key"])
    if not candidates:
        raise NoDevice(f"no node that is up has device {device!r}")
    chosen = place(candidates, counts, mem)
    return where[chosen.index]
