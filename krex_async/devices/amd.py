"""AMD GPUs through AMD SMI (the `amdsmi` package that ships with ROCm, also on PyPI).

`import amdsmi` without ROCm prints to stdout and then raises KeyError('libamd_smi.so'); that print
is swallowed here (it must not reach the daemon's or a command's output) and, like a failed
amdsmi_init(), becomes Unavailable with the reason. The import is attempted once per process: its
outcome is cached, so discovery does not print or pay for it again. Only queries: nothing here
changes clocks, power limits or compute modes.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable
from dataclasses import replace
from typing import Any, TypeVar

from krex_async.devices.base import ClockState, Device, DeviceProcess, Unavailable, Vendor
from krex_async.devices.cpu import pci_local_cpus, pci_numa_node, usable_cpus

T = TypeVar("T")
_import_outcome: tuple[Any, str] | None = None  # (module or None, reason)


def _import_amdsmi() -> Any:
    """The amdsmi module, or Unavailable naming why it cannot be imported (cached)."""
    global _import_outcome
    if _import_outcome is None:
        noise = io.StringIO()
        try:
            with contextlib.redirect_stdout(noise), contextlib.redirect_stderr(noise):
                import amdsmi
            _import_outcome = (amdsmi, "")
        except ImportError as e:
            _import_outcome = (None, f"amdsmi is not installed: {e}")
        except KeyError as e:  # its loader's way of saying the shared library is missing
            said = " ".join(noise.getvalue().split())
            _import_outcome = (
                None,
                f"AMD SMI library {e.args[0] if e.args else ''} not found" + (f" ({said})" if said else ""),
            )
        except Exception as e:  # noqa: BLE001 - any import failure means "not here", with its text
            _import_outcome = (None, f"amdsmi failed to import: {type(e).__name__}: {e}")
    module, reason = _import_outcome
    if module is None:
        raise Unavailable(reason)
    return module


class AmdVendor(Vendor):
    name = "amd"

    def __init__(self) -> None:
        self._smi: Any = None
        self._handles: dict[str, Any] = {}

    def _try(self, fn: Callable[[], T], default: T) -> T:
        try:
            return fn()
        except self._smi.AmdSmiException:
            return default

    def open(self) -> list[Device]:
        smi = _import_amdsmi()
        try:
            smi.amdsmi_init(smi.AmdSmiInitFlags.INIT_AMD_GPUS)
        except smi.AmdSmiException as e:
            raise Unavailable(f"amdsmi_init failed (amdgpu driver not loaded?): {e}") from None
        self._smi = smi
        try:
            handles = smi.amdsmi_get_processor_handles()
        except smi.AmdSmiException as e:
            self.close()
            raise Unavailable(f"amdsmi_get_processor_handles failed: {e}") from None
        if not handles:
            self.close()
            raise Unavailable("AMD SMI found no GPU")
        return [self._device(i, h) for i, h in enumerate(handles)]

    def _device(self, index: int, handle: Any) -> Device:
        smi = self._smi
        key = f"amd{index}"
        self._handles[key] = handle
        uuid = self._try(lambda: smi.amdsmi_get_gpu_device_uuid(handle), "")
        bdf = self._try(lambda: smi.amdsmi_get_gpu_device_bdf(handle), "")
        asic: dict[str, Any] = self._try(lambda: smi.amdsmi_get_gpu_asic_info(handle), {})
        total = self._try(lambda: smi.amdsmi_get_gpu_memory_total(handle, smi.AmdSmiMemoryType.VRAM), 0)
        used = self._try(lambda: smi.amdsmi_get_gpu_memory_usage(handle, smi.AmdSmiMemoryType.VRAM), 0)
        node = self._try(lambda: smi.amdsmi_topo_get_numa_node_number(handle), None)
        enum: dict[str, Any] = self._try(lambda: smi.amdsmi_get_gpu_enumeration_info(handle), {})
        hip_uuid = enum.get("hip_uuid") or ""
        if hip_uuid:  # ROCr narrows to this GPU by uuid; HIP then sees it as device 0
            env = {"ROCR_VISIBLE_DEVICES": hip_uuid, "HIP_VISIBLE_DEVICES": "0"}
        else:
            env = {"HIP_VISIBLE_DEVICES": str(enum.get("hip_id", index))}
        return Device(
            index=index,
            key=key,
            vendor="amd",
            name=str(asic.get("market_name") or "AMD GPU"),
            uuid=str(uuid),
            memory_total_bytes=int(total),
            memory_free_bytes=max(0, int(total) - int(used)),
            numa_node=int(node)
            if isinstance(node, int) and node >= 0
            else (pci_numa_node(bdf) if bdf else None),
            cpus=usable_cpus(pci_local_cpus(bdf) if bdf else frozenset()),
            env=env,
            clocks_mhz=self._clocks(handle),
        )

    def _clocks(self, handle: Any) -> dict[str, int]:
        smi = self._smi
        clocks = {}
        for name, kind in (("graphics", smi.AmdSmiClkType.GFX), ("mem", smi.AmdSmiClkType.MEM)):
            info: dict[str, Any] = self._try(lambda: smi.amdsmi_get_clock_info(handle, kind), {})  # noqa: B023 - called now
            if isinstance(info.get("clk"), int):
                clocks[name] = info["clk"]
        if "graphics" in clocks:
            clocks["sm"] = clocks["graphics"]  # AMD has one shader clock (GFX)
        return clocks

    def processes(self, device: Device) -> list[DeviceProcess]:
        handle = self._handles.get(device.key)
        if handle is None:
            return []
        procs: list[Any] = self._try(lambda: self._smi.amdsmi_get_gpu_process_list(handle), [])
        return [
            DeviceProcess(pid=int(p["pid"]), used_memory_bytes=int(p.get("mem") or 0))
            for p in procs
            if isinstance(p, dict) and "pid" in p
        ]

    def clock(self, device: Device) -> ClockState | None:
        """The GFX clock against its maximum; AMD SMI reports no cap reasons here, and a clock in
        deep sleep counts as idle. Not measured on AMD hardware (none was available)."""
        handle = self._handles.get(device.key)
        if handle is None:
            return None
        smi = self._smi
        info: dict[str, Any] = self._try(lambda: smi.amdsmi_get_clock_info(handle, smi.AmdSmiClkType.GFX), {})
        cur, top = info.get("clk"), info.get("max_clk")
        if not isinstance(cur, int) or not isinstance(top, int) or top <= 0:
            return None
        return ClockState(sm_mhz=cur, target_mhz=top, idle=bool(info.get("clk_deep_sleep")))

    def utilisation(self, device: Device) -> float | None:
        handle = self._handles.get(device.key)
        if handle is None:
            return None
        activity: dict[str, Any] = self._try(lambda: self._smi.amdsmi_get_gpu_activity(handle), {})
        gfx = activity.get("gfx_activity")
        return float(gfx) if isinstance(gfx, (int, float)) else None

    def refresh(self, device: Device) -> Device:
        handle = self._handles.get(device.key)
        if handle is None:
            return device
        smi = self._smi
        used = self._try(lambda: smi.amdsmi_get_gpu_memory_usage(handle, smi.AmdSmiMemoryType.VRAM), None)
        free = device.memory_free_bytes if used is None else max(0, device.memory_total_bytes - int(used))
        return replace(device, memory_free_bytes=free, clocks_mhz=self._clocks(handle) or device.clocks_mhz)

    def close(self) -> None:
        if self._smi is not None:
            try:
                self._smi.amdsmi_shut_down()
            except self._smi.AmdSmiException:
                pass
            self._smi = None
            self._handles.clear()
