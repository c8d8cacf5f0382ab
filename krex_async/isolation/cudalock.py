"""Hold a sibling's GPU work with the NVIDIA driver's process lock instead of the freezer.

`cuCheckpointProcessLock(pid)` (CUDA driver API 12.8+, libcuda.so.1 through ctypes; the caller needs
cuInit(0), no context) makes every CUDA call of `pid` block until `cuCheckpointProcessUnlock`, while
its other threads run on: a sibling that is compiling or generating inputs keeps its CPU through a
region. A lock takes about 0.4-2 ms, an unlock ~0.5 ms; the lock does not wait for queued
kernels (the drain is still verified); a lock outlives the process that took it; a locked process
still dies of SIGKILL and SIGTERM; a process with no CUDA context cannot be locked.

    daemon loop ──LockPool.lock_many(pids)──► threads ── cuCheckpointProcessLock ──► driver
         │  (record first: <state_dir>/locks.json)          (each call bounded by timeoutMs)
         └──LockPool.unlock_many(pids)──► threads ── cuCheckpointProcessUnlock

Driver calls block in C (ctypes releases the GIL): they run on this module's own threads, never on
the event loop. Because a lock outlives its taker, every lock is recorded (pid and start time) before
it is taken, and `release_left()` (start-up, the watchdog, `krex cleanup`) unlocks what a dead daemon
recorded. `KREX_LIBCUDA` names another library (a test double, a non-standard install).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import functools
import json
import os
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

from krex_async.linux import reserve
from krex_async.linux.fsutil import replace_file
from krex_async.linux.procfs import start_time  # the one reading (model/holdset.py, exits.py import it here)

LIBRARY = "libcuda.so.1"
# What the record says of the library: a fixed key, not a path. Whoever reads the record back
# (start-up, the watchdog, `krex cleanup`) opens its own library_path(): no file names code to load.
DRIVER_KEY = "libcuda"
RECORD = "locks.json"
LOCKED = 1  # CU_PROCESS_STATE_LOCKED (RUNNING 0, CHECKPOINTED 2, FAILED 3)
# CUprocessState
PROCESS_STATES = {0: "running", 1: "locked", 2: "checkpointed", 3: "failed"}
NOT_READY = 600  # CUDA_ERROR_NOT_READY: inside a driver call (context creation among them) at the timeout
SYMBOLS = ("cuCheckpointProcessLock", "cuCheckpointProcessUnlock", "cuCheckpointProcessGetState")
UNLOCK_BOUND_S = 5.0  # one cuCheckpointProcessUnlock: 0.35-0.63 ms on the H200 (FACTS.md)


class _LockArgs(ctypes.Structure):
    """CUcheckpointLockArgs: timeoutMs, then reserved fields that must be zero (64 bytes)."""

    _fields_ = [
        ("timeoutMs", ctypes.c_uint),
        ("reserved0", ctypes.c_uint),
        ("reserved1", ctypes.c_uint64 * 7),
    ]


def library_path() -> str:
    return os.environ.get("KREX_LIBCUDA") or LIBRARY


class Driver:
    """The checkpoint-lock entry points of one libcuda. Construct with `open_driver`; every method
    blocks in the driver (call it off the event loop) and returns the CUresult, 0 for success."""

    def __init__(self, lib: ctypes.CDLL, path: str, version: int) -> None:
        self.lib = lib
        self.path = path
        self.version = version  # cuDriverGetVersion, e.g. 13000; 0 when unknown
        self._lock, self._unlock, self._state = (getattr(lib, s) for s in SYMBOLS)
        for fn in (self._lock, self._unlock, self._state):
            fn.restype = ctypes.c_int

    def lock(self, pid: int, timeout_ms: int) -> int:
        args = _LockArgs(timeoutMs=max(1, timeout_ms))
        return int(self._lock(ctypes.c_int(pid), ctypes.byref(args)))

    def unlock(self, pid: int) -> int:
        return int(self._unlock(ctypes.c_int(pid), None))

    def state(self, pid: int) -> tuple[int, int]:
        """(CUresult, CUprocessState); the state means something only when the result is 0."""
        st = ctypes.c_int(-1)
        rc = int(self._state(ctypes.c_int(pid), ctypes.byref(st)))
        return rc, st.value

    def error(self, rc: int) -> str:
        """`CUDA_ERROR_X (rc)` from cuGetErrorName where the library has it."""
        fn = getattr(self.lib, "cuGetErrorName", None)
        if fn is not None:
            name = ctypes.c_char_p()
            fn.restype = ctypes.c_int
            if fn(ctypes.c_int(rc), ctypes.byref(name)) == 0 and name.value:
                return f"{name.value.decode(errors='replace')} ({rc})"
        return f"CUresult {rc}"


def open_driver(path: str | None = None) -> tuple[Driver | None, str]:
    """(driver, "") where the lock can serve, else (None, why not): no library, no such symbol (a
    driver older than the API), or cuInit failing (no GPU, no device files). Never raises."""
    path = path or library_path()
    try:
        lib = ctypes.CDLL(path)
    except OSError as e:
        return None, f"cannot load {path}: {e}"
    missing = [s for s in SYMBOLS if not hasattr(lib, s)]
    if missing:
        return None, f"{path} has no {', '.join(missing)} (the driver predates the checkpoint API)"
    lib.cuInit.restype = ctypes.c_int
    rc = int(lib.cuInit(ctypes.c_uint(0)))
    version = ctypes.c_int(0)
    if hasattr(lib, "cuDriverGetVersion"):
        lib.cuDriverGetVersion(ctypes.byref(version))
    drv = Driver(lib, path, version.value)
    if rc != 0:
        return None, f"cuInit(0) in {path} failed: {drv.error(rc)}"
    return drv, ""


@dataclass
class LockResult:
    """One lock attempt: taken or not, how long the call took, and the driver's error if any."""

    pid: int
    ok: bool
    seconds: float
    error: str = ""
    not_ready: bool = False  # CUDA_ERROR_NOT_READY: no context yet, try again shortly
    state: str = ""  # on NOT_READY, what cuCheckpointProcessGetState says of the process (evidence)


class LockRecord:
    """`<state_dir>/locks.json`: the pids this daemon may hold locked, each with its start time (a
    reused pid is never unlocked); the library is DRIVER_KEY, resolved by each reader itself.
    Written before every lock and after unlocks. Not fsynced: a lock dies with the machine, only
    the daemon's death must be survived, and the page cache outlives a process."""

    def __init__(self, state_dir: str, library: str) -> None:
        self.path = os.path.join(state_dir, RECORD)
        self.library = library
        self.held: dict[int, int] = {}  # pid -> start time
        self._mutex = threading.Lock()

    def write(self) -> None:
        """Replace the record with the current set (any thread). Raises OSError."""
        with self._mutex:
            data = json.dumps(
                {
                    "version": 1,
                    "pid": os.getpid(),
                    "library": DRIVER_KEY,  # which one: the reader resolves it itself
                    "locked": sorted(self.held.items()),
                }
            ).encode()
            reserve.guarded(self.path, lambda: replace_file(self.path, data))  # before a lock: must land

    def add(self, pids: Iterable[int]) -> list[int]:
        """Record `pids` (those still alive) and write; returns the recorded ones. Raises OSError."""
        new = {p: st for p in pids if (st := start_time(p)) is not None}
        with self._mutex:
            self.held.update(new)
        self.write()
        return list(new)

    def drop(self, pids: Iterable[int]) -> None:
        with self._mutex:
            for p in pids:
                self.held.pop(p, None)


class LockPool:
    """The daemon's locking: driver calls on a pool of threads, awaited with a bound, each lock
    recorded first. Use from the event loop only."""

    def __init__(self, driver: Driver, state_dir: str, workers: int = 16) -> None:
        self.driver = driver
        self.record = LockRecord(state_dir, driver.path)
        self.pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="krex-cudalock")
        # Unlocks on threads of their own: lock calls that never return cannot hold a release up.
        self.unlocks = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="krex-cudaunlock")
        self.stuck = 0  # calls that outlived their bound and still have not returned

    def _timed_lock(self, pid: int, timeout_ms: int) -> LockResult:
        t0 = time.perf_counter()
        rc = self.driver.lock(pid, timeout_ms)
        dt = time.perf_counter() - t0
        state = self.state_name(pid) if rc == NOT_READY else ""
        return LockResult(
            pid, rc == 0, dt, "" if rc == 0 else self.driver.error(rc), not_ready=rc == NOT_READY, state=state
        )

    def state_name(self, pid: int) -> str:
        """The driver's word for `pid` (running, locked, checkpointed, failed) or its error: whether a
        process that answered NOT_READY already had a context (then it was inside a driver call)."""
        rc, st = self.driver.state(pid)
        if rc != 0:
            return self.driver.error(rc)
        return PROCESS_STATES.get(st, f"state {st}")

    async def lock_many(self, pids: list[int], timeout: float) -> dict[int, LockResult]:
        """Lock `pids` in parallel, each call bounded by `timeout` in the driver and again here (a
        call that has not returned by then counts as failed; should it lock later, it is undone at
        once). Raises OSError when the record cannot be written (nothing is locked then)."""
        if not pids:
            return {}
        loop = asyncio.get_running_loop()
        recorded = self.record.add(pids)
        ms = max(1, int(timeout * 1000))
        futs = {p: loop.run_in_executor(self.pool, self._timed_lock, p, ms) for p in recorded}
        bound = timeout + 0.25  # the driver's own bound, and a margin for the threads
        done, late = await asyncio.wait(futs.values(), timeout=bound) if futs else (set(), set())
        out: dict[int, LockResult] = {}
        for pid, fut in futs.items():
            if fut in done:
                out[pid] = fut.result()
            else:
                out[pid] = LockResult(pid, False, bound, "no answer from the driver in time")
                self.stuck += 1
                fut.add_done_callback(functools.partial(self._late, pid))
        for pid in pids:
            out.setdefault(pid, LockResult(pid, False, 0.0, "process gone"))
        failed = [p for p, r in out.items() if not r.ok]
        if failed:
            self.record.drop(p for p in failed if futs.get(p) not in late)
        return out

    def _late(self, pid: int, fut: asyncio.Future[LockResult]) -> None:
        """A lock call that returned after its bound: undo it if it took, forget it either way."""
        self.stuck -= 1
        if not fut.cancelled() and fut.exception() is None and fut.result().ok:
            try:
                self.pool.submit(self.driver.unlock, pid)
            except RuntimeError:  # shut down meanwhile: the next start-up sweep unlocks it
                return
        self.record.drop([pid])

    async def unlock_many(self, pids: list[int]) -> tuple[float, dict[int, str]]:
        """Unlock `pids` in parallel, each call bounded by UNLOCK_BOUND_S; returns (seconds, {pid:
        error}) for those the driver refused (a process that died meanwhile among them) or did not
        answer in time. The record keeps each one that may still be locked (alive, not unlocked):
        the start-up sweep, the watchdog and `krex cleanup` unlock it should this daemon die."""
        if not pids:
            return 0.0, {}
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        futs = {p: loop.run_in_executor(self.unlocks, self.driver.unlock, p) for p in pids}
        _, late = await asyncio.wait(futs.values(), timeout=UNLOCK_BOUND_S)
        dt = time.perf_counter() - t0
        errors: dict[int, str] = {}
        for p, fut in futs.items():
            if fut in late:
                errors[p] = f"no answer from the driver in {UNLOCK_BOUND_S:g} s"
                fut.add_done_callback(functools.partial(self._late_unlock, p))
            elif (e := fut.exception()) is not None:
                errors[p] = repr(e)
            elif (rc := fut.result()) != 0:
                errors[p] = self.driver.error(rc)
        self.record.drop(p for p in pids if p not in errors or start_time(p) is None)
        try:
            await loop.run_in_executor(self.unlocks, self.record.write)
        except OSError:
            pass  # a stale record only makes a later sweep check pids that are not locked
        return dt, errors

    def _late_unlock(self, pid: int, fut: asyncio.Future[int]) -> None:
        """An unlock that returned after its bound: forget the pid once it took."""
        if not fut.cancelled() and fut.exception() is None and fut.result() == 0:
            self.record.drop([pid])

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.unlocks.shutdown(wait=False, cancel_futures=True)


def release_left(state_dir: str | None, library: str | None = None) -> list[str]:
    """Unlock what the record in `state_dir` says a (dead) daemon may have locked: each recorded pid
    that still runs with the same start time and reads LOCKED. Rewrites the record empty. One line
    per action or problem; never raises (start-up, the watchdog and `krex cleanup` call it)."""
    if not state_dir:
        return []
    path = os.path.join(state_dir, RECORD)
    try:
        with open(path) as f:
            rec = json.load(f)
        entries = [(int(p), int(st)) for p, st in rec.get("locked", [])]
    except FileNotFoundError:
        return []
    except (OSError, ValueError, TypeError, AttributeError) as e:
        return [f"lock record {path} unreadable: {e}"]
    lines: list[str] = []
    alive = [p for p, st in entries if start_time(p) == st]
    if alive:
        # The library is this process's own choice (library_path), never the record's: a file
        # that named a library would let whoever wrote it run code in the daemon or in cleanup.
        drv, why = open_driver(library or None)
        if drv is None:
            lines.append(f"cannot unlock {len(alive)} recorded process(es) {alive}: {why}")
            return lines
        for pid in alive:
            try:
                rc, state = drv.state(pid)
                if rc == 0 and state == LOCKED:
                    urc = drv.unlock(pid)
                    lines.append(
                        f"unlocked pid {pid}" if urc == 0 else f"could not unlock pid {pid}: {drv.error(urc)}"
                    )
            except Exception as e:  # a driver fault costs this pid, not the sweep
                lines.append(f"could not unlock pid {pid}: {e!r}")
    try:
        replace_file(path, json.dumps({"version": 1, "pid": 0, "library": DRIVER_KEY, "locked": []}).encode())
    except OSError as e:
        lines.append(f"could not clear {path}: {e.strerror}")
    return lines
