"""The daemon reads each GPU's clock once at start-up, on the executor the region's clock settle
uses, so the first region of a daemon does not pay the vendor library's first query (5-20 ms on
the H200: bench/RESULTS.md, session 12) in its entry."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace
from typing import Any, cast

from krex_async.daemon.model.core import Core
from krex_async.daemon.regions.clock import Clock
from krex_async.devices import Node
from krex_async.devices.base import ClockState, Device, Vendor


class Recording(Vendor):
    name = "nvidia"

    def __init__(self) -> None:
        self.reads: list[tuple[str, str]] = []  # (device key, thread name)

    def open(self) -> list[Device]:
        return []

    def clock(self, device: Device) -> ClockState | None:
        self.reads.append((device.key, threading.current_thread().name))
        return ClockState(sm_mhz=1980, target_mhz=1980)


def _clock(devices: list[Device], vendors: dict[str, Vendor]) -> Clock:
    node = Node(devices, [], vendors)
    return Clock(cast(Core, SimpleNamespace(node=node, devices=devices)))


def test_warm_reads_each_gpu_once_off_the_loop_on_the_settle_executor() -> None:
    gpus = [Device(i, f"nvidia{i}", "nvidia", "H200") for i in range(2)]
    cpu = Device(0, "cpu", "cpu", "host")
    vendor = Recording()
    clock = _clock([*gpus, cpu], {"nvidia": vendor})

    async def main() -> Any:
        loop = asyncio.get_running_loop()
        await clock.warm()
        return loop._default_executor  # type: ignore[attr-defined]

    executor = asyncio.run(main())
    assert [k for k, _ in vendor.reads] == ["nvidia0", "nvidia1"]  # the cpu device has no clock
    assert all(t != "MainThread" for _, t in vendor.reads), vendor.reads
    assert executor is not None  # the thread settle's run_in_executor(None, ...) reuses


def test_warm_without_a_node_or_gpu_reads_nothing() -> None:
    cpu = Device(0, "cpu", "cpu", "host")
    vendor = Recording()
    asyncio.run(Clock(cast(Core, SimpleNamespace(node=None, devices=[cpu]))).warm())
    asyncio.run(_clock([cpu], {"nvidia": vendor}).warm())
    assert vendor.reads == []
