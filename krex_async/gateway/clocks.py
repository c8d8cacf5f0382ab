"""`lock_clocks: true` on eval and profile jobs: the GPUs' clocks locked while the job runs.

The reference gateway locks every NVIDIA GPU's graphics clock at its highest supported value
(`nvidia-smi --lock-gpu-clocks MAX,MAX`, reset after), or sets AMD GPUs to the `high` performance
level, and fails the job (execution_error) when it cannot. krex does the same through NVML where
nvidia-ml-py is installed (nvidia-smi otherwise, rocm-smi for AMD). GPUs are shared here, so the
lock is counted: the first job that asks locks, the last one to end resets; jobs in between share
the locked clocks. Locking needs root (the gateway's user, not the job's). Locking and resetting
run off the event loop, one at a time: the gateway answers requests while nvidia-smi works.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")
TOOL_TIMEOUT = 20.0  # seconds one nvidia-smi or rocm-smi call may take
SETTLE_TIMEOUT = TOOL_TIMEOUT + 10.0  # how long shutdown waits for a reset in flight
RESET_HINT = "reset them with `nvidia-smi -rgc` and `nvidia-smi -rmc` (AMD: `rocm-smi --setperflevel auto`)"


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
    """Lock each GPU at its top graphics clock; a GPU that cannot be locked (an NVML error, no
    clock listed) fails the whole lock, and the GPUs locked before it are reset first."""
    locked: list[Any] = []
    try:
        handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(nv.nvmlDeviceGetCount())]
        if not handles:
            raise ClockError("lock_clocks: NVML sees no GPU")
        for h in handles:
            top = max(
                (
                    max(nv.nvmlDeviceGetSupportedGraphicsClocks(h, m), default=0)
                    for m in nv.nvmlDeviceGetSupportedMemoryClocks(h)
                ),
                default=0,
            )
            if top <= 0:
                raise ClockError("lock_clocks: NVML lists no supported graphics clock")
            nv.nvmlDeviceSetGpuLockedClocks(h, top, top)
            locked.append(h)
    except BaseException as e:
        for h in locked:
            try:
                nv.nvmlDeviceResetGpuLockedClocks(h)
            except nv.NVMLError:
                pass  # the others are still reset
        if isinstance(e, nv.NVMLError):
            raise ClockError(f"lock_clocks: NVML could not lock the GPU clocks: {e}") from None
        raise

    def reset() -> None:
        for h in locked:
            try:
                nv.nvmlDeviceResetGpuLockedClocks(h)
            except nv.NVMLError:
                pass

    return reset


def _run(argv: list[str]) -> str:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=TOOL_TIMEOUT, check=True).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise ClockError(f"lock_clocks: {argv[0]} failed: {e}") from None


def _lock_tools(why_not_nvml: str) -> Callable[[], None]:
    smi = shutil.which("nvidia-smi")
    if smi:
        out = _run([smi, "--query-supported-clocks=gr", "--format=csv,noheader,nounits"])
        clocks = [int(float(x)) for x in out.split() if x.replace(".", "", 1).isdigit()]
        if not clocks:
            raise ClockError("lock_clocks: nvidia-smi returned no supported graphics clocks")
        try:
            _run([smi, "--lock-gpu-clocks", f"{max(clocks)},{max(clocks)}"])
        except ClockError:
            _quiet([smi, "--reset-gpu-clocks"])  # it may have locked the GPUs before the one that failed
            raise
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
        subprocess.run(argv, capture_output=True, timeout=TOOL_TIMEOUT, check=False)
    except (OSError, subprocess.SubprocessError):
        pass


def lock_now() -> Callable[[], None]:
    """Blocking: lock every GPU's clocks; returns the reset. Raises ClockError."""
    nv, why = _nvml()
    return _lock_nvml(nv) if nv is not None else _lock_tools(why)


def _off_loop(fn: Callable[[], T]) -> asyncio.Future[T]:
    """fn() on a daemon thread: a call that hangs (NVML has no timeout) cannot keep the gateway
    from exiting, as one on the loop's executor would (asyncio.run joins its threads)."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[T] = loop.create_future()

    def land(value: T | None, exc: BaseException | None) -> None:
        if fut.done():
            return
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(value)  # type: ignore[arg-type]  # fn() returned it

    def work() -> None:
        value: T | None = None
        exc: BaseException | None = None
        try:
            value = fn()
        except BaseException as e:
            exc = e
        try:
            loop.call_soon_threadsafe(land, value, exc)
        except RuntimeError:
            pass  # the loop closed meanwhile (the gateway gave up waiting)

    threading.Thread(target=work, name="krex-clocks", daemon=True).start()
    return fut


class Lock:
    """One job's share of the locked clocks; `await release()` once (the last share resets them)."""

    def __init__(self, owner: _Shared) -> None:
        self._owner: _Shared | None = owner

    async def release(self) -> None:
        if self._owner is not None:
            owner, self._owner = self._owner, None
            await owner.release()


class _Shared:
    """The count of shares and the reset. Locking and resetting block (nvidia-smi: up to 20 s), so
    they run on a thread; `lock` makes them one at a time in the order asked, so a reset never
    overlaps the next lock. Each runs as its own task that the asking job's cancellation does not
    stop: a lock still landing on its thread is given back after it lands, never before."""

    def __init__(self) -> None:
        self.count = 0
        self.reset: Callable[[], None] | None = None
        self.lock = asyncio.Lock()
        self.pending: set[asyncio.Task[None]] = set()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro)
        self.pending.add(task)
        task.add_done_callback(self.pending.discard)
        return task

    async def _lock(self) -> None:
        async with self.lock:
            if self.count == 0:
                self.reset = await _off_loop(lock_now)
            self.count += 1

    async def _unlock(self) -> None:
        async with self.lock:
            self.count -= 1
            if self.count == 0 and self.reset is not None:
                reset, self.reset = self.reset, None
                await _off_loop(reset)

    async def acquire(self) -> Lock:
        task = self._spawn(self._lock())
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            task.add_done_callback(self._give_back)
            raise
        return Lock(self)

    def _give_back(self, task: asyncio.Task[None]) -> None:
        """A lock whose job was cancelled while it was taken: its share goes back now."""
        if not task.cancelled() and task.exception() is None:
            self._spawn(self._unlock())

    async def release(self) -> None:
        await asyncio.shield(self._spawn(self._unlock()))


_SHARED: _Shared | None = None


async def acquire() -> Lock:
    """Lock the clocks (or join the jobs already holding them). Raises ClockError."""
    global _SHARED
    if _SHARED is None:
        _SHARED = _Shared()
    return await _SHARED.acquire()


async def settle(timeout: float | None = None) -> bool:
    """Wait for the locks and resets in flight (at shutdown: no clock is left locked); False if
    some still run after `timeout` seconds (a hung NVML or nvidia-smi call)."""
    loop = asyncio.get_running_loop()
    end = None if timeout is None else loop.time() + timeout
    while _SHARED is not None and _SHARED.pending:
        left = None if end is None else end - loop.time()
        if left is not None and left <= 0:
            return False
        await asyncio.wait(set(_SHARED.pending), timeout=left)
    return True
