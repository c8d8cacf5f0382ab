"""How many warm workers a pool keeps: towards the commands running on its device (its demand), at
least one, at most its size; and, for retiring, the largest demand of the last keep_s seconds.

Why the two differ: a command's end drops the demand by one until its agent's next job arrives
(milliseconds to a minute later). A reused worker coming back in that gap was one too many and
retired, and the next job waited while its replacement imported torch and created a context (on the
H100, 4-7 of 48 jobs a round). So the pool grows at once (target) and shrinks only once the demand
stayed low for keep_s (kept); 0 retires at once.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable


class Demand:
    """One pool's demand and the recent peaks of it. Every method runs on the daemon's event loop."""

    def __init__(self, size: int, keep_s: float) -> None:
        self.size, self.keep_s = size, keep_s
        self.now: int | None = None  # commands running on the device (None: keep `size`)
        # (when it ended, the demand until then): decreasing demands, each ended later than the one
        # before, so the first one still in the window is the largest
        self._past: collections.deque[tuple[float, int]] = collections.deque()
        self._timer: asyncio.TimerHandle | None = None  # when_kept_falls()

    def set(self, running: int) -> None:
        prev = self.size if self.now is None else self.now
        if self.keep_s > 0 and prev > running:
            while self._past and self._past[-1][1] <= prev:
                self._past.pop()  # smaller and older: within the window only while `prev` is
            self._past.append((time.monotonic(), prev))
        self.now = running

    def target(self) -> int:
        """How many workers to warm towards now."""
        return self._bound(self.size if self.now is None else self.now)

    def kept(self) -> int:
        """How many workers to keep from retiring: the largest demand within the last keep_s s."""
        cutoff = time.monotonic() - self.keep_s
        while self._past and self._past[0][0] < cutoff:
            self._past.popleft()
        return max(self.target(), self._bound(self._past[0][1]) if self._past else 0)

    def when_kept_falls(self, then: Callable[[], None]) -> None:
        """Call `then` once kept() may have fallen (the next peak leaves the window), unless a call
        is due already; not at all while kept() is target()."""
        if self._timer is None and self.kept() > self.target():
            delay = self._past[0][0] + self.keep_s - time.monotonic() + 0.01  # past the end, not at it
            self._timer = asyncio.get_running_loop().call_later(max(0.0, delay), self._call, then)

    def _call(self, then: Callable[[], None]) -> None:
        self._timer = None
        then()

    def cancel(self) -> None:
        """No call due any more (the pool closes)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _bound(self, n: int) -> int:
        return min(self.size, max(1, n))
