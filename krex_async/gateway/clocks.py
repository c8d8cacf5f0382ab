"""`lock_clocks: true` on eval and profile jobs: the GPUs' clocks locked while the job runs.

The reference gateway locks every NVIDIA GPU's graphics clock at its highest supported value
(`nvidia-smi --lock-gpu-clocks MAX,MAX`, reset after), or sets AMD GPUs to the `high` performance
level, and fails the job (execution_error) when it cannot. krex does the same through NVML where
nvidia-ml-py is installed (nvidia-smi otherwise, rocm-smi for AMD). GPUs are shared here, so the
lock is counted: the first job that asks locks, the last one to end resets; jobs in between share
the locked clocks. Locking needs root (the gateway's user, not the job's).
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from collections.abc import Callable
from typing import Any


class ClockError(Exception):
    """The clocks could not be locked; the message says why (no NVML, no permission, ...)."""


def _nvml() -> tuple[Any, str]:
    """(pynvml, "") once NVML is initialised, else (None, why not)."""
    try:
        import pynvml
    except ImportError:
        return None, "nvidia-ml-py is not installed"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        return None, f"NVML did not initialise: {e}"
    return pynvml, ""


def _lock_nvml(nv: Any) -> Callable[[], None]:
    handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(nv.nvmlDeviceGetCount())]
    if not handles:
        raise ClockError("lock_clocks: NVML sees no GPU")
    locked = []
    try:
        for h in handles:
            top = max(
                max(nv.nvmlDeviceGetSupportedGraphicsClocks(h, m), default=0)
                for m in nv.nvmlDeviceGetSupportedMemoryClocks(h)
            )
            if top <= 0:
                raise ClockError("lock_clocks: NVML lists no supported graphics clock")
            nv.nvmlDeviceSetGpuLockedClocks(h, top, top)
            locked.append(h)
    except nv.NVMLError as e:
        for h in locked:
            nv.nvmlDeviceResetGpuLockedClocks(h)
        raise ClockError(f"lock_clocks: NVML could not lock the GPU clocks: {e}") from None

    def reset() -> None:
        for h in locked:
            try:
                nv.nvmlDeviceResetGpuLockedClocks(h)
            except nv.NVMLError:
                pass

    return reset


def _run(argv: list[str]) -> str:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise ClockError(f"lock_clocks: {argv[0]} failed: {e}") from None


def _lock_tools(why_not_nvml: str) -> Callable[[], None]:
    smi = shutil.which("nvidia-smi")
    if smi:
        out = _run([smi, "--query-supported-clocks=gr", "--format=csv,noheader,nounits"])
        clocks = [int(float(x)) for x in out.split() if x.replace(".", "", 1).isdigit()]
        if not clocks:
            raise ClockError("lock_clocks: nvidia-smi returned no supported graphics clocks")
        _run([smi, "--lock-gpu-clocks", f"{max(clocks)},{max(clocks)}"])
        return lambda: _quiet([smi, "--reset-gpu-clocks"])
    rocm = shutil.which("rocm-smi")
    if rocm:
        _run([rocm, "--setperflevel", "high"])
        return lambda: _quiet([rocm, "--setperflevel", "auto"])
    raise ClockError(
        f"lock_clocks: cannot lock GPU clocks here: {why_not_nvml}, and neither "
        "nvidia-smi nor rocm-smi is on PATH"
    )


def _quiet(argv: list[str]) -> None:
    try:
        subprocess.run(argv, capture_output=True, timeout=20, check=False)
    except (OSError, subprocess.SubprocessError):
        pass


def lock_now() -> Callable[[], None]:
    """Blocking: lock every GPU's clocks; returns the reset. Raises ClockError."""
    nv, why = _nvml()
    return _lock_nvml(nv) if nv is not None else _lock_tools(why)


class Lock:
    """One job's share of the locked clocks; `release()` once (the last share resets them)."""

    def __init__(self, owner: _Shared) -> None:
        self._owner: _Shared | None = owner

    def release(self) -> None:
        if self._owner is not None:
            self._owner.release()
            self._owner = None


class _Shared:
    def __init__(self) -> None:
        self.count = 0
        self.reset: Callable[[], None] | None = None
        self.lock = asyncio.Lock()

    async def acquire(self) -> Lock:
        async with self.lock:
            if self.count == 0:
                self.reset = await asyncio.to_thread(lock_now)
            self.count += 1
        return Lock(self)

    def release(self) -> None:
        self.count -= 1
        if self.count == 0 and self.reset is not None:
            reset, self.reset = self.reset, None
            reset()  # a few ms of NVML; nvidia-smi's reset is bounded by its timeout


_SHARED: _Shared | None = None


async def acquire() -> Lock:
    """Lock the clocks (or join the jobs already holding them). Raises ClockError."""
    global _SHARED
    if _SHARED is None:
        _SHARED = _Shared()
    return await _SHARED.acquire()
