"""Keeping the probes' background threads quiet while the daemon's loop enters a region.

The probe backends read their ring buffers (and do upkeep: /proc scans, map pruning) on Python
threads. A Python thread that runs while the loop works costs the loop a GIL hand-off at each of its
system calls: threads running beside a region's entry made it 2-3x slower (bench/RESULTS.md).

    with HOLD.held():           # on the loop: from the region's turn to its grant
        ...freeze, fence, grant...
    HOLD.wait()                 # on a probe thread, before each unit of work: returns at once
                                # unless a hold is on, then when it ends (at most MAX_S later)

Nothing is lost meanwhile: events wait in the kernel's ring buffer (seconds of room) and the counts
are kept kernel-side. A hold that is never ended (a bug) lets the threads go after MAX_S.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager


class Hold:
    MAX_S = 0.05

    def __init__(self, max_s: float = MAX_S) -> None:
        self.max_s = max_s
        self._lock = threading.Lock()
        self._depth = 0  # regions entering at once (one per device)
        self._until = 0.0
        self._clear = threading.Event()
        self._clear.set()
        self.waited = 0  # how often a thread waited (tests, diagnostics)

    def begin(self) -> None:
        with self._lock:
            self._depth += 1
            self._until = time.monotonic() + self.max_s
            self._clear.clear()

    def end(self) -> None:
        with self._lock:
            self._depth = max(0, self._depth - 1)
            if self._depth == 0:
                self._clear.set()

    @contextmanager
    def held(self) -> Iterator[None]:
        self.begin()
        try:
            yield
        finally:
            self.end()

    def active(self) -> bool:
        return not self._clear.is_set() and time.monotonic() < self._until

    def wait(self) -> None:
        """On a probe thread: return when no hold is on (at once in the common case)."""
        if self._clear.is_set():
            return
        left = self._until - time.monotonic()
        if left > 0:
            self.waited += 1
            self._clear.wait(left)


HOLD = Hold()  # one per process: the daemon has one loop, and its probes all yield to it
