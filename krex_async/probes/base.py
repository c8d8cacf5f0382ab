"""The probe interface: a backend watches GPU driver activity and hands typed events to the loop.

Backends: `bcc` (eBPF on syscall tracepoints, plus opt-in uprobes on launch APIs) and `tracefs`
(sys_enter_ioctl read from trace_pipe, for hosts without a compiler). Each polls on its own thread and
delivers batches through `loop.call_soon_threadsafe(on_events, batch)`. Counts kept kernel-side lose
nothing; the event stream is for detail, and what it lost is counted.
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


class ProbeUnavailable(Exception):
    """This backend cannot run here; the message says why."""


@dataclass(frozen=True, slots=True)
class ProbeEvent:
    ts_ns: int  # CLOCK_MONOTONIC nanoseconds (bpf_ktime_get_ns), comparable with time.monotonic_ns()
    tgid: int
    tid: int
    kind: str  # "open", "ioctl", "launch"
    fd: int = -1
    request: int = 0  # ioctl number
    name: str = ""  # decoded ioctl or launch API name, or the device path for "open"
    comm: str = ""


class ProbeBackend(abc.ABC):
    name: str = "?"

    @abc.abstractmethod
    def start(self, loop: asyncio.AbstractEventLoop, on_events: Callable[[list[ProbeEvent]], None]) -> None:
        """Load and attach; start polling on a thread. Raises ProbeUnavailable."""

    @abc.abstractmethod
    def stop(self) -> None:
        """Detach and join the polling thread."""

    def lost(self) -> int:
        """Events lost so far (ring-buffer reservation failures, perf-buffer losses)."""
        return 0

    def counts(self) -> dict[int, int]:
        """Kernel-side event counts per tgid since start (lossless where the backend keeps them)."""
        return {}

    def describe(self) -> dict[str, Any]:
        """Details a running backend adds to `krex status`'s probes entry (cheap; on the loop)."""
        return {}
