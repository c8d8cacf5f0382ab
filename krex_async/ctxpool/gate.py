"""When a pool's worker may create its device context: one at a time per node (node_lock, shared by
every pool of the daemon), and never while a region holds the pool's device (pause/resume): a context
created mid-region would arrive unseen by the region's hold, and creating one is slow, driver-bound
work beside the region's timing. A creation that hangs in the driver is killed at CONTEXT_TIMEOUT_S.
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import Callable
from typing import Any

from krex_async.ctxpool import channel
from krex_async.ctxpool.handle import Worker
from krex_async.ctxpool.procs import kill as _kill

_NODE_LOCKS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Lock] = weakref.WeakKeyDictionary()
CONTEXT_TIMEOUT_S = 60.0  # a worker holding the node lock longer than this is killed


def node_lock() -> asyncio.Lock:
    """The lock every pool of this daemon holds while a worker creates its device context."""
    loop = asyncio.get_running_loop()
    lock = _NODE_LOCKS.get(loop)
    if lock is None:
        lock = _NODE_LOCKS[loop] = asyncio.Lock()
    return lock


class ContextGate:
    """One pool's gate. Every method runs on the daemon's event loop."""

    def __init__(self) -> None:
        self._resumed = asyncio.Event()
        self._resumed.set()
        self.creating: asyncio.Future[None] | None = None  # a context creation in flight
        self.creator: Worker | None = None  # the worker creating it
        self.deferred: list[Callable[[], None]] = []  # ends of retired workers, for resume()

    @property
    def paused(self) -> bool:
        return not self._resumed.is_set()

    def pause(self) -> None:
        """No new device context is created until resume(); one being created finishes."""
        self._resumed.clear()

    def resume(self) -> None:
        self._resumed.set()
        ends, self.deferred = self.deferred, []
        for end in ends:
            end()

    def later(self, end: Callable[[], None]) -> None:
        """End a retired worker (`end`: its kill, or the EOF it exits on) now, or at resume() while
        paused. Ending, a worker frees its device memory, in the kernel, which no hold stops: beside
        the timing of the region that paused the pool (docs/pool.md). Until then it waits, held as
        an idle worker is."""
        if self.paused:
            self.deferred.append(end)
        else:
            end()

    async def quiesce(self, timeout: float) -> float:
        """pause(), then wait up to `timeout` for a creation in flight to end; the seconds waited."""
        self.pause()
        creating = self.creating
        if creating is None or creating.done():
            return 0.0
        t0 = time.monotonic()
        await asyncio.wait([creating], timeout=timeout)
        return time.monotonic() - t0

    async def create(self, w: Worker, closed: Callable[[], bool]) -> None:
        """Let `w` create its context while holding the node lock, never while the device is paused;
        not at all once it died or the pool is `closed()`."""
        lock = node_lock()
        while True:
            await self._resumed.wait()
            async with lock:
                if not self._resumed.is_set():
                    continue
                if w.exited.done() or closed():
                    return
                try:
                    channel.send(w.sock, {"t": "init"})
                except OSError:
                    return
                self.creating = creating = asyncio.get_running_loop().create_future()
                self.creator = w
                ready: asyncio.Future[Any] = asyncio.ensure_future(w.ready.wait())
                try:
                    await asyncio.wait(
                        [ready, w.exited],  # type: ignore[list-item]
                        timeout=CONTEXT_TIMEOUT_S,
                        return_when=asyncio.FIRST_COMPLETED,
                    )
                    if not w.ready.is_set() and not w.exited.done():  # hung in the driver
                        w.error = f"no context after {CONTEXT_TIMEOUT_S} s"
                        _kill(w.pid)
                        await asyncio.wait([w.exited], timeout=5.0)  # gone before the node is free
                finally:
                    ready.cancel()
                    creating.set_result(None)
                    self.creating = self.creator = None
                return
