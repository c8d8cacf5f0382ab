"""The `cpu` device: the node's cpus as one device, or split into N logical devices for testing.

Also the host-side helpers the GPU vendor modules share: reading a PCI device's NUMA node and local
cpus from sysfs and parsing kernel cpu lists. Nothing here raises for a missing sysfs file: the
field is then unknown (None / empty).
"""

from __future__ import annotations

import os
from pathlib import Path

from krex_async.devices.base import Device, Vendor
from krex_async.linux import procfs

SYS_PCI = Path("/sys/bus/pci/devices")


def allowed_cpus() -> frozenset[int]:
    """The cpus this process may run on (its affinity), which is what commands can be given."""
    return frozenset(os.sched_getaffinity(0))


def parse_cpulist(text: str) -> frozenset[int]:
    """Parse a kernel cpu list such as "0-3,8,10-11" (empty or blank text: no cpus).

    Raises ValueError naming the text when it is not a cpu list.
    """
    cpus: set[int] = set()
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        try:
            if "-" in part:
                lo, hi = part.split("-", 1)
                cpus.update(range(int(lo), int(hi) + 1))
            else:
                cpus.add(int(part))
        except ValueError:
            raise ValueError(f"not a cpu list: {text!r}") from None
    return frozenset(cpus)


def cpus_from_mask(words: list[int], bits_per_word: int = 64) -> frozenset[int]:
    """cpus set in a bitmask given as words, lowest word first (NVML's cpu affinity layout)."""
    return frozenset(
        w * bits_per_word + b for w, word in enumerate(words) for b in range(bits_per_word) if word >> b & 1
    )


def sysfs_bus_id(bus_id: str) -> str:
    """NVML's "00000000:3B:00.0" as sysfs names it: "0000:3b:00.0"."""
    bus_id = bus_id.strip().lower()
    domain, _, rest = bus_id.partition(":")
    if len(domain) > 4 and set(domain[:-4]) <= {"0"}:
        domain = domain[-4:]
    return f"{domain}:{rest}"


def pci_numa_node(bus_id: str, root: Path = SYS_PCI) -> int | None:
    """The PCI device's NUMA node from sysfs; None when unknown (-1 or no such file)."""
    try:
        node = int((root / sysfs_bus_id(bus_id) / "numa_node").read_text().strip())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def pci_local_cpus(bus_id: str, root: Path = SYS_PCI) -> frozenset[int]:
    """The PCI device's local cpus from sysfs (empty when unknown)."""
    try:
        return parse_cpulist((root / sysfs_bus_id(bus_id) / "local_cpulist").read_text())
    except (OSError, ValueError):
        return frozenset()


def usable_cpus(near: frozenset[int]) -> frozenset[int]:
    """The device's cpus this process may use; all allowed cpus when none of them is (or unknown)."""
    allowed = allowed_cpus()
    return (near & allowed) or allowed


def host_memory_bytes() -> tuple[int, int]:
    """(MemTotal, MemAvailable) from /proc/meminfo; (0, 0) when unreadable."""
    fields = procfs.meminfo()
    return fields.get("MemTotal", 0), fields.get("MemAvailable", 0)


class CpuVendor(Vendor):
    """The host's cpus: one `cpu` device, or `parts` logical devices cpu0..cpuN-1 (spec "cpu:N").

    Logical devices split the allowed cpus evenly in order (contiguous blocks) and the host memory
    in equal shares. With more parts than cpus, the cpus are dealt round-robin so every part has one.
    """

    name = "cpu"

    def __init__(self, parts: int | None = None) -> None:
        if parts is not None and parts < 1:
            raise ValueError(f"cpu:N needs N >= 1, got {parts}")
        self.parts = parts

    def open(self) -> list[Device]:
        cpus = sorted(allowed_cpus())
        total, free = host_memory_bytes()
        if self.parts is None:
            return [
                Device(
                    index=0,
                    key="cpu",
                    vendor="cpu",
                    name=f"cpu ({len(cpus)} cpus)",
                    memory_total_bytes=total,
                    memory_free_bytes=free,
                    cpus=frozenset(cpus),
                )
            ]
        n = self.parts
        if n <= len(cpus):
            base, extra = divmod(len(cpus), n)
            blocks, start = [], 0
            for i in range(n):
                size = base + (1 if i < extra else 0)
                blocks.append(cpus[start : start + size])
                start += size
        else:
            blocks = [[cpus[i % len(cpus)]] for i in range(n)]
        return [
            Device(
                index=i,
                key=f"cpu{i}",
                vendor="cpu",
                name=f"cpu part {i} of {n}",
                memory_total_bytes=total // n,
                memory_free_bytes=free // n,
                cpus=frozenset(block),
            )
            for i, block in enumerate(blocks)
        ]

    def refresh(self, device: Device) -> Device:
        from dataclasses import replace

        _, free = host_memory_bytes()
        share = 1 if self.parts is None else self.parts
        return replace(device, memory_free_bytes=free // share)
