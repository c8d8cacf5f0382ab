"""NVIDIA GPUs through NVML (nvidia-ml-py, import name `pynvml`).

`NvidiaVendor.open()` raises Unavailable with the reason when the package, the library
(libnvidia-ml.so.1) or the driver is missing, or NVML sees no GPU. Per-field queries that a GPU or
driver does not support leave that field unknown instead of failing the device: a missing clock is
left out of `clocks_mhz`, a missing NUMA node falls back to sysfs, then None. Nothing here changes
clocks, power limits or compute modes: only queries.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import replace
from typing import Any, TypeVar

from krex_async.devices.base import ClockState, Device, DeviceProcess, Unavailable, Vendor
from krex_async.devices.cpu import cpus_from_mask, pci_local_cpus, pci_numa_node, sysfs_bus_id, usable_cpus

T = TypeVar("T")

# nvmlClocksEventReason* bits (nvml.h): GpuIdle; SwPowerCap, HwSlowdown, SwThermalSlowdown,
# HwThermalSlowdown, HwPowerBrakeSlowdown.
_IDLE = 0x1
_CAPPED = 0x4 | 0x8 | 0x20 | 0x40 | 0x80


def visible_only(devices: list[Device], spec: str) -> list[Device]:
    """The devices CUDA_VISIBLE_DEVICES=`spec` leaves a CUDA program, as CUDA reads it: a comma
    list of indices (NVML's order, which krex keeps: the daemon's NVML and CUDA enumerate alike
    when CUDA_DEVICE_ORDER=PCI_BUS_ID, and NVML's order is the PCI bus order) or UUIDs (`GPU-...`,
    a unique prefix is enough), read up to the first entry that names no device; MIG instances
    (`MIG-...`) name no whole GPU and end the list too. An empty spec leaves none."""
    out: list[Device] = []
    for token in (t.strip() for t in spec.split(",")):
        if token.isdigit():
            found = [d for d in devices if d.index == int(token)]
        elif token.startswith("GPU-"):
            found = [d for d in devices if d.uuid.startswith(token)]
        else:
            found = []
        if len(found) != 1 or found[0] in out:
            break
        out.append(found[0])
    return out


def _text(value: object) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


class NvidiaVendor(Vendor):
    name = "nvidia"

    def __init__(self) -> None:
        self._nvml: Any = None
        self._handles: dict[str, Any] = {}  # device key -> NVML handle
        self._bus: dict[str, str] = {}  # device key -> sysfs PCI bus id
        self._targets: dict[str, int] = {}  # device key -> the SM clock a timing alone runs at

    # ------------------------------------------------------------------------------------ library

    def _load(self) -> Any:
        try:
            import pynvml
        except ImportError as e:
            raise Unavailable(f"nvidia-ml-py (pynvml) is not installed: {e}") from None
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError_LibraryNotFound:
            raise Unavailable("NVML library not found (libnvidia-ml.so.1)") from None
        except pynvml.NVMLError_DriverNotLoaded:
            raise Unavailable("NVIDIA driver not loaded") from None
        except pynvml.NVMLError as e:
            raise Unavailable(f"nvmlInit failed: {e}") from None
        except OSError as e:  # a broken library file
            raise Unavailable(f"NVML could not be loaded: {e}") from None
        return pynvml

    def _try(self, fn: Callable[[], T], default: T) -> T:
        """One query; NVML errors (not supported, function not found in an old driver) -> default."""
        try:
            return fn()
        except (self._nvml.NVMLError, AttributeError):
            return default

    # ------------------------------------------------------------------------------------ devices

    def open(self) -> list[Device]:
        nvml = self._nvml = self._load()
        try:
            count = nvml.nvmlDeviceGetCount()
        except nvml.NVMLError as e:
            self.close()
            raise Unavailable(f"nvmlDeviceGetCount failed: {e}") from None
        if count == 0:
            self.close()
            raise Unavailable("NVML found no GPU")
        devices = []
        for index in range(count):
            try:
                devices.append(self._device(index))
            except nvml.NVMLError:  # a GPU that fell off the bus: leave it out, keep the others
                continue
        if not devices:
            self.close()
            raise Unavailable(f"NVML lists {count} GPU(s) but none answers queries")
        spec = os.environ.get("CUDA_VISIBLE_DEVICES")
        if spec is not None:  # the daemon was given some GPUs (Slurm, a shared host): those only
            devices = visible_only(devices, spec)
            if not devices:
                self.close()
                raise Unavailable(
                    f"CUDA_VISIBLE_DEVICES={spec!r} names none of the {count} GPU(s) NVML lists"
                )
        return devices

    def _device(self, index: int) -> Device:
        nvml = self._nvml
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        key = f"nvidia{index}"
        uuid = _text(nvml.nvmlDeviceGetUUID(handle))
        bus = sysfs_bus_id(_text(self._try(lambda: nvml.nvmlDeviceGetPciInfo(handle).busId, "")))
        self._handles[key] = handle
        self._bus[key] = bus
        mem = self._try(lambda: nvml.nvmlDeviceGetMemoryInfo(handle), None)
        return Device(
            index=index,
            key=key,
            vendor="nvidia",
            name=_text(self._try(lambda: nvml.nvmlDeviceGetName(handle), "NVIDIA GPU")),
            uuid=uuid,
            memory_total_bytes=int(mem.total) if mem else 0,
            memory_free_bytes=int(mem.free) if mem else 0,
            numa_node=self._numa_node(handle, bus),
            cpus=usable_cpus(self._cpu_affinity(handle, bus)),
            env={"CUDA_VISIBLE_DEVICES": uuid or str(index)},
            clocks_mhz=self._clocks(handle),
        )

    def _numa_node(self, handle: Any, bus: str) -> int | None:
        node = self._try(lambda: self._nvml.nvmlDeviceGetNumaNodeId(handle), None)
        if node is not None and node >= 0:
            return int(node)
        return pci_numa_node(bus) if bus else None

    def _cpu_affinity(self, handle: Any, bus: str) -> frozenset[int]:
        words = math.ceil((os.cpu_count() or 1) / 64)
        mask = self._try(lambda: self._nvml.nvmlDeviceGetCpuAffinity(handle, words), None)
        cpus = cpus_from_mask([int(w) for w in mask]) if mask is not None else frozenset()
        return cpus or (pci_local_cpus(bus) if bus else frozenset())

    def _clocks(self, handle: Any) -> dict[str, int]:
        nvml = self._nvml
        clocks = {}
        for name, kind in (
            ("sm", nvml.NVML_CLOCK_SM),
            ("mem", nvml.NVML_CLOCK_MEM),
            ("graphics", nvml.NVML_CLOCK_GRAPHICS),
        ):
            mhz = self._try(lambda: nvml.nvmlDeviceGetClockInfo(handle, kind), None)  # noqa: B023 - called now
            if mhz is not None:
                clocks[name] = int(mhz)
        return clocks

    # ------------------------------------------------------------------------------ live queries

    def processes(self, device: Device) -> list[DeviceProcess]:
        """Processes holding a compute context on the device, with the device memory each uses, as
        NVML reports them (memory admission samples this: daemon/commands/admission.py).

        NVML reports pids in the host's pid namespace; inside a container without it they do not
        match the daemon's pids. Empty when NVML cannot tell.
        """
        handle = self._handles.get(device.key)
        if handle is None:
            return []
        return [
            DeviceProcess(
                pid=int(p.pid), used_memory_bytes=None if p.usedGpuMemory is None else int(p.usedGpuMemory)
            )
            for p in self._compute_processes(handle)
        ]

    def _compute_processes(self, handle: Any) -> list[Any]:
        """nvmlDeviceGetComputeRunningProcesses, newest version first: pynvml's unversioned name
        calls _v3 and raises NVMLLibraryMismatchError (no NVMLError) where the driver lacks it."""
        nvml = self._nvml
        mismatch = getattr(nvml, "NVMLLibraryMismatchError", nvml.NVMLError)
        missing = getattr(nvml, "NVMLError_FunctionNotFound", mismatch)
        for name in ("_v3", "_v2", ""):
            fn = getattr(nvml, f"nvmlDeviceGetComputeRunningProcesses{name}", None)
            if fn is None:
                continue
            try:
                return list(fn(handle))
            except (missing, mismatch):
                continue  # an older driver: the version before
            except nvml.NVMLError:
                return []
        return []

    def clock(self, device: Device) -> ClockState | None:
        """The SM clock against the applications clock (else the maximum), with NVML's reasons.

        After a neighbour's large matmuls stop, the SM clock sits well below its maximum under the
        power cap for about 100 ms, and short kernels time slow meanwhile (bench/gpu/check_settle.py).
        """
        handle = self._handles.get(device.key)
        if handle is None:
            return None
        nvml = self._nvml
        sm = self._try(lambda: nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM), None)
        if sm is None:
            return None
        target = self._targets.get(device.key)
        if target is None:
            app = self._try(lambda: nvml.nvmlDeviceGetApplicationsClock(handle, nvml.NVML_CLOCK_SM), 0)
            top = self._try(lambda: nvml.nvmlDeviceGetMaxClockInfo(handle, nvml.NVML_CLOCK_SM), 0)
            target = self._targets[device.key] = int(app or top or sm)
        reasons = self._try(lambda: int(nvml.nvmlDeviceGetCurrentClocksEventReasons(handle)), None)
        if reasons is None:  # drivers before 535 name it "throttle reasons"
            reasons = self._try(lambda: int(nvml.nvmlDeviceGetCurrentClocksThrottleReasons(handle)), 0)
        return ClockState(
            sm_mhz=int(sm), target_mhz=target, capped=bool(reasons & _CAPPED), idle=bool(reasons & _IDLE)
        )

    def utilisation(self, device: Device) -> float | None:
        """Percent of the last sample period in which a kernel ran (NVML's coarse gpu rate)."""
        handle = self._handles.get(device.key)
        if handle is None:
            return None
        rates = self._try(lambda: self._nvml.nvmlDeviceGetUtilizationRates(handle), None)
        return None if rates is None else float(rates.gpu)

    def refresh(self, device: Device) -> Device:
        handle = self._handles.get(device.key)
        if handle is None:
            return device
        mem = self._try(lambda: self._nvml.nvmlDeviceGetMemoryInfo(handle), None)
        return replace(
            device,
            memory_free_bytes=int(mem.free) if mem else device.memory_free_bytes,
            clocks_mhz=self._clocks(handle) or device.clocks_mhz,
        )

    def close(self) -> None:
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except self._nvml.NVMLError:
                pass
            self._nvml = None
            self._handles.clear()
