"""How a running backend says it failed: once, on the loop, and with the reason.

A backend's polling thread can die after start (an error reading the ring or trace_pipe, its tracefs
event disabled from outside, a bug). It must not die silently: a daemon whose probes stopped would
go on reporting regions clean. Each backend mixes in `FailureReporting`; the daemon sets
`backend.on_failure` before start(), and the thread, as its last act, calls `self._failed(loop,
reason)`, which records `failure` and schedules `on_failure(reason)` on the loop, once. The thread
then exits having closed what it owned; the backend's stop() releases the rest (detach, instance
removal) and stays safe to call again.

`name_thread()` gives the polling thread an OS-visible name (`krex-probe-...` in
/proc/<pid>/task/<tid>/comm and `top -H`), so an SRE, or a test, can see whether it still runs.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
from collections.abc import Callable

PR_SET_NAME = 15


class FailureReporting:
    """Mixin for ProbeBackend: `failure` (None while healthy) and the `on_failure` hook."""

    on_failure: Callable[[str], None] | None = None
    failure: str | None = None

    def _failed(self, loop: asyncio.AbstractEventLoop, reason: str) -> None:
        """Record the first failure and hand it to on_failure on the loop (from any thread).
        A closed loop (the daemon is exiting) is ignored."""
        if self.failure is not None:
            return
        self.failure = reason
        hook = self.on_failure
        if hook is None:
            return
        try:
            loop.call_soon_threadsafe(hook, reason)
        except RuntimeError:
            pass


_libc: ctypes.CDLL | None = None


def name_thread(name: str) -> None:
    """Set the calling thread's kernel name (15 bytes kept). Best effort: errors are ignored."""
    global _libc
    try:
        if _libc is None:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        _libc.prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass
