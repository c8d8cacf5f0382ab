"""The device interface: one module per vendor, each able to say "unavailable, because ...".

A vendor module exposes a `Vendor` subclass. `discover()` (in devices/__init__.py) asks each in turn and
falls back to the single `cpu` device. Fields carry their unit in their name.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field


class Unavailable(Exception):
    """This vendor's library or driver is missing here; the message says why."""


@dataclass(frozen=True)
class Device:
    """One device of the node. `key` is what regions serialise on ("cpu", "nvidia0", "cpu1" ...)."""

    index: int
    key: str
    vendor: str  # "cpu", "nvidia", "amd"
    name: str
    uuid: str = ""
    memory_total_bytes: int = 0
    memory_free_bytes: int = 0
    numa_node: int | None = None
    cpus: frozenset[int] = frozenset()  # cpus close to the device (its affinity); all cpus for `cpu`
    env: dict[str, str] = field(default_factory=dict)  # visible-device variables for a command on it
    clocks_mhz: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class DeviceProcess:
    pid: int
    used_memory_bytes: int | None = None


class Vendor(abc.ABC):
    name: str = "?"

    @abc.abstractmethod
    def open(self) -> list[Device]:
        """Initialise the library and list its devices; raises Unavailable(reason)."""

    def processes(self, device: Device) -> list[DeviceProcess]:
        """Processes holding a context on the device (empty where the vendor cannot tell)."""
        return []

    def utilisation(self, device: Device) -> float | None:
        """Recent utilisation in percent, None where unknown."""
        return None

    def refresh(self, device: Device) -> Device:
        """The device with current memory and clocks."""
        return device

    def close(self) -> None:
        """Shut the library down."""
