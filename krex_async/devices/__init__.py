"""Devices of the node: one module per vendor behind devices.base.Vendor; `cpu` otherwise.

    discover(spec) -> (devices, notes)     what the daemon serialises regions on
    open_node(spec) -> Node                the same, keeping the opened vendors for live queries
    place(devices, counts, mem_bytes)      `--device auto`: fewest commands among those that fit

spec: "auto" (NVIDIA, then AMD; every vendor that answers contributes its GPUs; none: one `cpu`
device), "none" (only `cpu`), "cpu:N" (N logical cpu devices cpu0..cpuN-1 splitting the host's
cpus), "nvidia" / "amd" (only that vendor; Unavailable with the reason when it is missing), "fake:N"
(N test GPUs whose memory the tests control: devices/fake.py; never for production).
Notes are one line per vendor asked, for logs and `krex status`:
"nvidia: unavailable: NVML library not found (libnvidia-ml.so.1)", "nvidia: 8 device(s)".
"""

from __future__ import annotations

from dataclasses import dataclass, field

from krex_async.devices.base import ClockState, Device, DeviceProcess, Unavailable, Vendor
from krex_async.devices.cpu import CpuVendor, allowed_cpus

__all__ = [
    "Device",
    "DeviceProcess",
    "Node",
    "NoDevice",
    "Unavailable",
    "Vendor",
    "check_spec",
    "describe",
    "discover",
    "open_node",
    "place",
]


class NoDevice(Exception):
    """No device satisfies a placement request; the message names what was asked and what exists."""


def _gpu_vendors() -> dict[str, type[Vendor]]:
    from krex_async.devices.amd import AmdVendor
    from krex_async.devices.nvidia import NvidiaVendor

    return {"nvidia": NvidiaVendor, "amd": AmdVendor}


@dataclass
class Node:
    """The node's devices and the vendors that answer for them (close() shuts the libraries)."""

    devices: list[Device]
    notes: list[str]
    vendors: dict[str, Vendor] = field(default_factory=dict)

    def vendor(self, device: Device) -> Vendor | None:
        return self.vendors.get(device.vendor)

    def processes(self, device: Device) -> list[DeviceProcess]:
        v = self.vendor(device)
        return v.processes(device) if v else []

    def utilisation(self, device: Device) -> float | None:
        v = self.vendor(device)
        return v.utilisation(device) if v else None

    def clock(self, device: Device) -> ClockState | None:
        v = self.vendor(device)
        return v.clock(device) if v else None

    def refresh(self) -> list[Device]:
        """Re-read memory and clocks of every device (blocking library calls: run off the loop)."""
        self.devices = [(v.refresh(d) if (v := self.vendor(d)) else d) for d in self.devices]
        return self.devices

    def close(self) -> None:
        for v in self.vendors.values():
            v.close()
        self.vendors.clear()


MAX_CPU_DEVICES = 1024  # cpu:N stands in for N GPUs: a node has at most a few dozen


def _parse_cpu_spec(spec: str) -> int:
    kind = spec.split(":", 1)[0]
    try:
        n = int(spec.split(":", 1)[1])
    except ValueError:
        raise ValueError(f"bad device spec {spec!r}: expected {kind}:N with N a number") from None
    if not 1 <= n <= MAX_CPU_DEVICES:
        raise ValueError(f"bad device spec {spec!r}: N must be 1 to {MAX_CPU_DEVICES}")
    return n


def check_spec(spec: str) -> None:
    """Whether `spec` can be served here, without keeping anything open (ValueError saying why
    not): one open_node knows; cpu:N at most one logical device per cpu krex may use (more would
    put regions of different devices, which run in parallel, on one cpu); a vendor named alone
    answers (its library is opened and shut again)."""
    spec = spec.strip().lower()
    if spec.startswith("cpu:"):
        n, cpus = _parse_cpu_spec(spec), allowed_cpus()
        if n > len(cpus):
            raise ValueError(
                f"{spec}: {n} logical cpu devices, but krex may use {len(cpus)} cpus here: give cpu:1 to "
                f"cpu:{len(cpus)} (each device needs a cpu of its own, or regions on different "
                "devices, which run in parallel, would share one)"
            )
    elif spec in _gpu_vendors() or spec.startswith("fake:"):
        try:
            open_node(spec).close()
        except Unavailable as e:  # the vendor's reason
            raise ValueError(f"{e}") from None
    elif spec not in ("auto", "none", "cpu"):
        raise ValueError(f"bad device spec {spec!r}: expected auto, none, cpu:N, nvidia or amd")


def open_node(spec: str = "auto") -> Node:
    """Open the devices named by `spec` (see the module docstring).

    Raises ValueError for a spec it does not know and Unavailable (with the vendor's reason) when
    the spec names one vendor that is missing. Vendors that fail under "auto" are closed again and
    only noted.
    """
    spec = spec.strip().lower()
    if spec in ("none", "cpu"):
        cpu = CpuVendor()
        return Node(cpu.open(), ["cpu: devices=none, one cpu device"], {"cpu": cpu})
    if spec.startswith("cpu:"):
        cpu = CpuVendor(_parse_cpu_spec(spec))
        devs = cpu.open()
        return Node(devs, [f"cpu: {len(devs)} logical cpu devices"], {"cpu": cpu})
    if spec.startswith("fake:"):
        from krex_async.devices.fake import FakeVendor

        fake = FakeVendor(_parse_cpu_spec(spec))
        devs = fake.open()  # Unavailable without its directory
        return Node(devs, [f"fake: {len(devs)} test device(s)"], {"fake": fake})
    vendors = _gpu_vendors()
    if spec == "auto":
        wanted = list(vendors)
    elif spec in vendors:
        wanted = [spec]
    else:
        raise ValueError(f"bad device spec {spec!r}: expected auto, none, cpu:N, nvidia or amd")
    node = Node([], [])
    for name in wanted:
        vendor = vendors[name]()
        try:
            devs = vendor.open()
        except Unavailable as e:
            vendor.close()
            if spec != "auto":
                raise Unavailable(f"{name}: {e}") from None
            node.notes.append(f"{name}: unavailable: {e}")
            continue
        node.devices.extend(devs)
        node.vendors[name] = vendor
        node.notes.append(f"{name}: {len(devs)} device(s)")
    if not node.devices:
        cpu = CpuVendor()
        node.devices = cpu.open()
        node.vendors["cpu"] = cpu
        node.notes.append("cpu: no GPU vendor answered, one cpu device")
    return node


def discover(spec: str = "auto") -> tuple[list[Device], list[str]]:
    """The node's devices and one note per vendor asked; vendor libraries are shut again.

    Errors as open_node(). The daemon that needs live process and utilisation queries keeps the
    Node from open_node() instead.
    """
    node = open_node(spec)
    node.close()
    return node.devices, node.notes


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def place(devices: list[Device], counts: dict[str, int], mem_bytes: int = 0) -> Device:
    """The device for `--device auto`: fewest commands (counts[key], missing = 0) among those with
    at least `mem_bytes` free; ties go to the most free memory, then the lowest index.

    Raises NoDevice naming what was asked and what each device has free when none fits.
    """
    if not devices:
        raise NoDevice("no devices on this node")
    fits = [d for d in devices if mem_bytes <= 0 or d.memory_free_bytes >= mem_bytes]
    if not fits:
        have = ", ".join(f"{d.key} has {_gib(d.memory_free_bytes)} free" for d in devices)
        raise NoDevice(
            f"no device has the memory asked for (mem={mem_bytes} bytes, {_gib(mem_bytes)}): {have}"
        )
    return min(fits, key=lambda d: (counts.get(d.key, 0), -d.memory_free_bytes, d.index))


def describe(device: Device, node: Node | None = None) -> dict[str, object]:
    """A JSON-able view of one device for `krex status`, with live processes and utilisation when
    a Node is given (blocking library calls)."""
    out: dict[str, object] = {
        "key": device.key,
        "vendor": device.vendor,
        "index": device.index,
        "name": device.name,
        "uuid": device.uuid,
        "memory_total_bytes": device.memory_total_bytes,
        "memory_free_bytes": device.memory_free_bytes,
        "numa_node": device.numa_node,
        "cpus": sorted(device.cpus),
        "clocks_mhz": dict(device.clocks_mhz),
        "env": dict(device.env),
    }
    if node is not None:
        out["utilisation_pct"] = node.utilisation(device)
        out["processes"] = [
            {"pid": p.pid, "used_memory_bytes": p.used_memory_bytes} for p in node.processes(device)
        ]
    return out
