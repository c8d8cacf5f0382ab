"""Which processes hold a GPU device file, as the region path needs to know it.

A region quiesces the siblings whose process holds a GPU device file (they may have queued work to
synchronise) and freezes the others outright; after the freeze it asks again of every frozen
process that did not acknowledge a quiesce, to tell a `synced` drain from one the owner must verify.
Reading /proc/<pid>/fd costs about 35 us a process (a listdir and a readlink per fd): with 16
siblings the two readings were most of what a region entry spent beyond freezing. So:

- a process seen holding one stays a holder for the life of its runtime connection (a process that
  opened a GPU device keeps its context);
- a process seen holding none is believed for `fresh_s` when choosing whom to quiesce, and the
  runtimes of a device are read again off the event loop after a region on it is released (at most
  every fresh_s / 2);
- to tell `synced` from a drain the owner must verify, the processes the freeze stopped are read
  once they are frozen (they cannot open a device meanwhile), on the event loop: a reading on a
  worker thread beside the freeze costs the loop more in GIL hand-offs than the reading itself
  (microseconds a process).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Hashable, Iterable

from krex_async.runtime.quiesce import holds_gpu_file

__all__ = ["GpuHolders", "read_holders"]


def read_holders(pids: Iterable[int]) -> list[int]:
    """The pids among `pids` that hold a GPU device file now. Reads /proc only: safe on a thread."""
    return [p for p in pids if holds_gpu_file(p)]


class GpuHolders:
    """Answers "does this runtime's process hold a GPU file" from what was read, keyed by (pid,
    token): the token is the runtime connection's identity, so a reused pid starts afresh. Use it
    from the event loop; the readings themselves run on a worker thread where they may take long."""

    def __init__(self, fresh_s: float = 1.0, limit: int = 4096) -> None:
        self.fresh_s = fresh_s
        self.limit = limit
        self._yes: dict[int, Hashable] = {}  # pid -> token
        self._no: dict[int, tuple[Hashable, float]] = {}  # pid -> (token, monotonic time read)
        self._refreshing: asyncio.Future[list[int]] | None = None

    def holds(self, pid: int, token: Hashable) -> bool:
        """From memory where it is fresh enough, else read now (on the calling thread)."""
        if self.known(pid, token):
            return True
        no = self._no.get(pid)
        if no is not None and no[0] == token and time.monotonic() - no[1] < self.fresh_s:
            return False
        held = holds_gpu_file(pid)
        self.note(pid, token, held)
        return held

    def known(self, pid: int, token: Hashable) -> bool:
        """Seen holding one (for the life of this runtime connection)."""
        return self._yes.get(pid) == token

    def note(self, pid: int, token: Hashable, held: bool, at: float | None = None) -> None:
        if len(self._yes) + len(self._no) > self.limit:  # runtimes come and go: start over
            self._yes.clear()
            self._no.clear()
        if held:
            self._yes[pid] = token
            self._no.pop(pid, None)
        elif self._yes.get(pid) != token:
            self._no[pid] = (token, time.monotonic() if at is None else at)

    def stale(self, items: Iterable[tuple[int, Hashable]]) -> list[tuple[int, Hashable]]:
        """The (pid, token) pairs not known to hold one whose reading is older than fresh_s / 2."""
        now = time.monotonic()
        out = []
        for pid, token in items:
            if self.known(pid, token):
                continue
            no = self._no.get(pid)
            if no is None or no[0] != token or now - no[1] >= self.fresh_s / 2:
                out.append((pid, token))
        return out

    def refresh(self, items: Iterable[tuple[int, Hashable]]) -> None:
        """Read the stale ones of `items` again on a worker thread (one refresh at a time)."""
        todo = self.stale(items)
        if not todo or (self._refreshing is not None and not self._refreshing.done()):
            return
        loop = asyncio.get_running_loop()
        at = time.monotonic()
        reading = loop.run_in_executor(None, read_holders, [p for p, _ in todo])

        def done(f: asyncio.Future[list[int]]) -> None:
            if f.cancelled() or f.exception() is not None:
                return
            yes = set(f.result())
            for pid, token in todo:
                self.note(pid, token, pid in yes, at)

        reading.add_done_callback(done)
        self._refreshing = reading
