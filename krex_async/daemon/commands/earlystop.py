"""SIGTERM and SIGINT while the daemon starts: noted from its first instant, acted on between the
phases of its start (each releases what was made so far), and handed to the server's loop once it
serves, so a stop that comes early ends as cleanly as a later one.

Until the hand-over a Python handler only notes the signal: the start is mostly synchronous (the
cgroup backend, the watchdog, the vendor libraries, the probes' compilation), and a handler that
raised there (SIGINT's KeyboardInterrupt) would leave half-made state and a traceback, while the
default SIGTERM killed the daemon without its release.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable
from types import FrameType

from krex_async import logs
from krex_async.linux import interrupt

log = logs.get("krex.server")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class EarlyStop:
    """The stop signal that came before the server took the signals over, if one did."""

    def __init__(self) -> None:
        self.signal: int | None = None

    def install(self) -> EarlyStop:
        """Note SIGTERM/SIGINT from now on instead of dying or raising; a Ctrl-C the CLI held
        pending while it imported (linux/interrupt.py) is noted now. Main thread only."""
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._note)
        interrupt.release()
        return self

    def _note(self, signum: int, _frame: FrameType | None) -> None:
        if self.signal is None:
            self.signal = signum

    def stopped(self, before: str) -> bool:
        """Whether a stop signal came; logged, with the phase it stopped the start `before`."""
        if self.signal is None:
            return False
        log.info("stopped_while_starting", signal=signal.Signals(self.signal).name, before=before)
        return True

    def hand_over(self, loop: asyncio.AbstractEventLoop, stop: Callable[[], None]) -> None:
        """From now on the loop calls `stop` on SIGTERM/SIGINT; a signal noted before calls it now."""
        for sig in STOP_SIGNALS:
            loop.add_signal_handler(sig, stop)
        if self.signal is not None:
            stop()
