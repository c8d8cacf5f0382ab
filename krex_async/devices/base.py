"""The device interface: one module per vendor, each able to say "unavailable, because ...".

A vendor module exposes a `Vendor` subclass. `discover()` (in devices/__init__.py) asks each in turn and
falls back to the single `cpu` device. Fields carry their unit in their name.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field

# The variables the GPU runtimes narrow their devices by (HIP reads CUDA_VISIBLE_DEVICES too, and
# ROCr's list applies before HIP's): a command given a GPU drops what it inherited of them, or an
# inherited ROCR_VISIBLE_DEVICES=1 with krex's HIP_VISIBLE_DEVICES=0 would be another GPU.
VISIBILITY_VARS = (
    "CUDA_VISIBLE_DEVICES",
    "HIP_VISIBLE_DEVICES",
    "ROCR_VISIBLE_DEVICES",
    "GPU_DEVICE_ORDINAL",
)


def parse_size(text: str) -> int:
    """Bytes from "123", "64K", "512M", "2G", "2GiB" (binary units): a device memory size as
    people write it. ValueError naming the text."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    mult = units.get(t[-1:], 1)
    try:
        n = int(float(t[:-1] if mult > 1 else t) * mult)
    except ValueError:
        raise ValueError(f"not a size: {text!r} (e.g. 512M, 2G)") from None
    if n < 0:
        raise ValueError(f"not a size: {text!r} (negative)")
    return n


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


@dataclass(frozen=True)
class ClockState:
    """The shader clock now, and the clock a timing alone would run at (the applications clock, else
    the maximum). `capped`: the vendor says the clock is held down by power or thermal limits;
    `idle`: held down because the device is idle (work of its own raises it within milliseconds)."""

    sm_mhz: int
    target_mhz: int
    capped: bool = False
    idle: bool = False

    def settled(self, fraction: float = 0.97) -> bool:
        return self.sm_mhz >= fraction * self.target_mhz


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

    def clock(self, device: Device) -> ClockState | None:
        """The shader clock's state now (a fast query, callable per region); None where unknown."""
        return None

    def refresh(self, device: Device) -> Device:
        """The device with current memory and clocks."""
        return device

    def close(self) -> None:
        """Shut the library down."""
