"""The order a pool lends its warm workers in: the idle ones, oldest first, and the adopters waiting in
Pool.take() for one, served in arrival order and ahead of any launch (they came first). A worker
offered to a waiter is out of the idle queue until it is handed over or given back, so nothing takes
it while the region hold is checked in between. How many workers to keep is upkeep.py's to decide.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import Callable

from krex_async.ctxpool.handle import Worker


class Lending:
    """One pool's idle queue and its waiting adopters. Every method runs on the daemon's loop."""

    def __init__(self) -> None:
        self.idle: collections.deque[Worker] = collections.deque()
        self.waiters: collections.deque[asyncio.Future[Worker | None]] = collections.deque()  # take()

    def next_idle(self) -> Worker | None:
        """The next idle worker still warm and alive, out of the queue (the others are dropped)."""
        while self.idle:
            w = self.idle.popleft()
            if w.state == "warm" and not w.exited.done():
                return w
        return None

    def pop(self) -> Worker | None:
        """The next idle worker for a launch; None when adopters wait for one: they came first."""
        return None if self.waiters else self.next_idle()

    def enter(self) -> asyncio.Future[Worker | None]:
        """A new waiter, last in line: its future gets a worker, or None."""
        fut: asyncio.Future[Worker | None] = asyncio.get_running_loop().create_future()
        self.waiters.append(fut)
        return fut

    async def wait(
        self, timeout: float, refill: Callable[[], None], untake: Callable[[Worker], None]
    ) -> Worker | None:
        """Pool.take(): wait in line up to `timeout` s for a worker (`refill()` once in line, so
        what is due warms); one offered to a waiter cancelled meanwhile goes back (`untake`)."""
        fut = self.enter()
        try:
            refill()
            if timeout > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(fut), timeout)
        except BaseException:  # cancelled (the adopter is gone)
            if (w := self.leave(fut)) is not None:
                untake(w)
            raise
        return self.leave(fut)

    def leave(self, fut: asyncio.Future[Worker | None]) -> Worker | None:
        """A waiter leaves the line: the worker it was offered, if any (else it is cancelled)."""
        with contextlib.suppress(ValueError):
            self.waiters.remove(fut)
        if not fut.done():
            fut.cancel()
        return None if fut.cancelled() else fut.result()

    def serve(self, closed: bool, warming: Callable[[], bool], offered: Callable[[], None]) -> None:
        """Offer idle workers to the waiters in arrival order, calling `offered()` after each (its
        replacement starts, as at a hand-over); answer None to those left when nothing is
        `warming()` any more, or the pool is `closed`: waiting could only end at the timeout."""
        while self.waiters:
            fut = self.waiters[0]
            if fut.done():
                self.waiters.popleft()
                continue
            w = None if closed else self.next_idle()
            if w is not None:
                w.reserved = True
                self.waiters.popleft()
                fut.set_result(w)
                offered()
                continue
            if not closed and warming():
                return
            self.waiters.popleft()
            fut.set_result(None)

    def waiting(self) -> int:
        """Adopters waiting in take() now."""
        return sum(not f.done() for f in self.waiters)

    def idle_pids(self) -> list[int]:
        """The warm workers an adoption or a launch may take next."""
        return [w.pid for w in self.idle if w.state == "warm" and not w.exited.done()]
