"""In-process device helpers for code running inside a command (the quiesce listener, region()).

    synchronize()          wait for this process's queued device work; never creates a context
    idle_verify(timeout_s) time a tiny kernel until its latency is back at the idle level
    ready_probe()          build that kernel ahead (outside regions), where the device is in use
    warm(ms)               keep the device busy for ms so its clocks reach their working level

These only use libraries the process has already imported or loaded (torch, cupy, libcuda,
libamdhip64): none is imported or loaded here, so a CPU-only command pays nothing and no GPU context
is created behind its back. Errors from the device libraries are caught and reported in the return
value, never raised: a failed sync must not kill the user's program. Nothing here changes clocks,
power limits or compute modes.

This file is imported both as `krex_async.runtime.devicework` and, inside commands whose Python
cannot import krex_async, by path from sitecustomize; it uses the standard library only.
"""

from __future__ import annotations

import ctypes
import os
import sys
import time
from collections.abc import Callable
from typing import Any

_CUDA_NAMES = ("libcuda.so.1", "libcuda.so")
_HIP_NAMES = ("libamdhip64.so.7", "libamdhip64.so.6", "libamdhip64.so.5", "libamdhip64.so")


def _loaded(names: tuple[str, ...]) -> ctypes.CDLL | None:
    """A library this process has already loaded (dlopen RTLD_NOLOAD), else None: never loads one."""
    mode = getattr(os, "RTLD_NOLOAD", 4) | getattr(os, "RTLD_LAZY", 1)
    for name in names:
        try:
            return ctypes.CDLL(name, mode=mode)
        except OSError:
            continue
    return None


def _torch_cuda() -> Any:
    """torch, when it is imported and has initialised CUDA (or ROCm, which torch also calls cuda)."""
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    try:
        return torch if cuda is not None and cuda.is_initialized() else None
    except Exception:  # noqa: BLE001 - a half-imported torch
        return None


def cuda_context_current() -> bool:
    """Whether the calling thread has a current CUDA driver context (False when libcuda is not
    loaded or not initialised: cuCtxGetCurrent then returns an error without initialising)."""
    lib = _loaded(_CUDA_NAMES)
    if lib is None:
        return False
    ctx = ctypes.c_void_p()
    try:
        return lib.cuCtxGetCurrent(ctypes.byref(ctx)) == 0 and bool(ctx.value)
    except AttributeError:
        return False


def synchronize() -> str:
    """Wait until the device work this process queued (from the calling thread's context) is done.

    Returns what was used: "torch", "cupy", "cuda" (driver API, cuCtxSynchronize on the current
    context), "hip" (hipDeviceSynchronize), "none" (nothing to synchronise), or "error: ..." when the
    library call failed (the caller should then verify the drain another way).
    """
    try:
        torch = _torch_cuda()
        if torch is not None:
            torch.cuda.synchronize()
            return "torch"
        cupy = sys.modules.get("cupy")
        if cupy is not None and cuda_context_current():
            cupy.cuda.runtime.deviceSynchronize()
            return "cupy"
        cuda = _loaded(_CUDA_NAMES)
        if cuda is not None:
            ctx = ctypes.c_void_p()
            if cuda.cuCtxGetCurrent(ctypes.byref(ctx)) == 0 and ctx.value:
                rc = cuda.cuCtxSynchronize()
                return "cuda" if rc == 0 else f"error: cuCtxSynchronize returned {rc}"
        hip = _loaded(_HIP_NAMES)
        if hip is not None:
            ctx = ctypes.c_void_p()
            if hip.hipCtxGetCurrent(ctypes.byref(ctx)) == 0 and ctx.value:
                rc = hip.hipDeviceSynchronize()
                return "hip" if rc == 0 else f"error: hipDeviceSynchronize returned {rc}"
        return "none"
    except Exception as e:  # noqa: BLE001 - never raise into the user's program
        return f"error: {type(e).__name__}: {e}"


# --------------------------------------------------------------------------- timing a tiny kernel

_probe: tuple[int, str, Callable[[], None]] | None = None  # (pid, library, run): one per process


def _tiny_kernel() -> tuple[str, Callable[[], None]] | None:
    """(library, launch-and-wait) for a small matmul (tens of microseconds alone), using torch or
    cupy if imported: a matmul's round trip shows a neighbour's queued work; a one-element kernel's
    does not.

    Built once per process and kept (`_probe`): its first run loads the library's GEMM code, which
    costs a hundred milliseconds or more inside a region, and about 1 ms from then on."""
    global _probe
    if _probe is not None and _probe[0] == os.getpid():
        return _probe[1], _probe[2]
    made = _make_probe()
    if made is not None:
        _probe = (os.getpid(), *made)
    return made


def _make_probe() -> tuple[str, Callable[[], None]] | None:
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            if torch.cuda.is_available():
                x = torch.randn(2048, 2048, device="cuda", dtype=torch.float16)

                def run_torch() -> None:
                    torch.matmul(x, x)
                    torch.cuda.synchronize()

                return "torch", run_torch
        except Exception:  # noqa: BLE001
            pass
    cupy = sys.modules.get("cupy")
    if cupy is not None:
        try:
            y = cupy.random.random((2048, 2048), dtype=cupy.float32)

            def run_cupy() -> None:
                cupy.matmul(y, y)
                cupy.cuda.runtime.deviceSynchronize()

            return "cupy", run_cupy
        except Exception:  # noqa: BLE001
            pass
    return None


def forget_probe() -> None:
    """Drop the kept kernel and its buffer (a pool worker does, before checking that the device
    memory a command used came back)."""
    global _probe
    _probe = None


def ready_probe() -> str:
    """Build and run the idle check's kernel once, outside any region, so that a region whose drain
    the owner must verify does not pay the library's first-use cost while every sibling is frozen.

    Only where this process already uses the device (torch with CUDA initialised, or cupy with a
    current context): it never creates a context. Returns the library used, "none", or
    "error: ..." (never raises)."""
    if _probe is not None and _probe[0] == os.getpid():
        return _probe[1]  # built and run once already: its code is loaded
    try:
        if _torch_cuda() is None and not (sys.modules.get("cupy") is not None and cuda_context_current()):
            return "none"
        kernel = _tiny_kernel()
        if kernel is None:
            return "none"
        kernel[1]()
        return kernel[0]
    except Exception as e:  # noqa: BLE001 - never raise into the user's program
        return f"error: {type(e).__name__}: {e}"


IDLE_WINDOW_S = 0.02  # longer than a GPU time slice (about 2.5 ms on the H200), with margin
IDLE_BAR_S = 250e-6


class IdleWindow:
    """The drain check's rule, fed one round trip of the tiny kernel at a time.

    While another context's queued work still runs, the GPU time-slices between contexts and some
    of our round trips wait out its slice: milliseconds instead of tens of microseconds
    (bench/gpu/check_settle.py measures both). So the device counts as drained once every round
    trip for `window_s` (longer than a time slice, and at least `min_samples` of them) stayed under
    a bar: `bar_s`, or three times the fastest round trip seen where that is slower (a slow host),
    but never more than 1 ms. The bar is absolute on purpose: a baseline calibrated from the first
    samples is the busy level when those samples all waited for slices (which made an earlier
    version pass a busy device in 60 ms). A neighbour whose kernels are shorter than the bar delays
    no round trip past it (bench/RESULTS.md, session 16): bench/gpu/check_idle_window records
    round-trip streams beside such neighbours and replays them through this rule to choose a bar.

    idle_verify feeds it live; the bench replays recorded streams through the same rule, so what
    it reports for a bar and window is what the check would have decided."""

    __slots__ = ("window_s", "bar_s", "min_samples", "best", "good", "start")

    def __init__(self, window_s: float = IDLE_WINDOW_S, bar_s: float = IDLE_BAR_S, min_samples: int = 16):
        self.window_s, self.bar_s, self.min_samples = window_s, bar_s, min_samples
        self.best = float("inf")
        self.good = 0  # round trips under the bar in a row
        self.start = 0.0  # when the first of them began

    def add(self, t0: float, dt: float) -> bool:
        """One round trip that began at t0 (seconds, any monotonic origin) and took dt: whether the
        device now counts as drained."""
        self.best = min(self.best, dt)
        if dt > max(self.bar_s, min(3 * self.best, 1e-3)):
            self.good = 0
            return False
        if self.good == 0:
            self.start = t0
        self.good += 1
        return self.good >= self.min_samples and t0 + dt - self.start >= self.window_s


def idle_verify(
    timeout_s: float = 5.0, window_s: float = IDLE_WINDOW_S, bar_s: float = IDLE_BAR_S, min_samples: int = 16
) -> tuple[str, float]:
    """Time a small kernel's round trip (launch, then wait) until the device shows no other work
    (the rule: IdleWindow).

    Returns ("idle-verified", seconds), ("timeout", seconds) when that did not happen within
    timeout_s, or ("unverified", seconds) when neither torch nor cupy is imported here (nothing to
    time with) or the kernel fails: never a clean verdict that was not checked.
    """
    kernel = _tiny_kernel()
    if kernel is None:
        return "unverified", 0.0
    _, run = kernel
    t_start = time.perf_counter()
    deadline = t_start + timeout_s
    rule = IdleWindow(window_s, bar_s, min_samples)
    try:
        while True:
            t0 = time.perf_counter()
            run()
            dt = time.perf_counter() - t0
            if rule.add(t0, dt):
                return "idle-verified", time.perf_counter() - t_start
            if t0 + dt >= deadline:
                return "timeout", time.perf_counter() - t_start
    except Exception:  # noqa: BLE001 - a failing device must not raise into the owner
        return "unverified", time.perf_counter() - t_start


def warm(ms: float) -> tuple[str, float]:
    """Keep the device busy with matmuls for about `ms` milliseconds, then wait for them.

    The GPU raises its clocks under load and drops them when idle; a short timed loop started on an
    idle (or just-frozen-neighbour) GPU runs at the wrong clocks. Returns (library used, seconds
    spent): ("none", 0.0) when ms <= 0 or neither torch nor cupy is imported with a usable device.
    """
    if ms <= 0:
        return "none", 0.0
    t0 = time.perf_counter()
    end = t0 + ms / 1000.0
    try:
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available():
            a = torch.randn(2048, 2048, device="cuda", dtype=torch.float16)
            b = torch.empty_like(a)
            while time.perf_counter() < end:
                for _ in range(4):  # about 0.1-0.5 ms of work each on current GPUs
                    torch.matmul(a, a, out=b)
                torch.cuda.synchronize()
            return "torch", time.perf_counter() - t0
        cupy = sys.modules.get("cupy")
        if cupy is not None:
            c = cupy.random.random((2048, 2048), dtype=cupy.float32)
            while time.perf_counter() < end:
                for _ in range(4):
                    c @ c
                cupy.cuda.runtime.deviceSynchronize()
            return "cupy", time.perf_counter() - t0
    except Exception:  # noqa: BLE001
        return "none", time.perf_counter() - t0
    return "none", 0.0
