"""What memory admission (admission.py) knows of one device: its use at the last sample, what runs
there and what waits, in order."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from krex_async.devices.base import Device


def gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


@dataclass
class DeviceMemory:
    """What admission knows of one device's memory."""

    device: Device
    used: int = 0  # what the vendor reported used at the last sample (all processes)
    pool: int = 0  # the pool's workers outside any command, at the last sample
    baseline: int = 0  # used with no command running: what a lone command's use is counted from
    running: set[str] = field(default_factory=set)  # admitted, not yet ended
    gated: set[str] = field(default_factory=set)  # started, admitted at their first CUDA use (--mem-gate)
    starts: deque[str] = field(default_factory=deque)  # gated, waiting to start (ahead_cap), in order
    waiting: deque[str] = field(default_factory=deque)  # queued for memory, in order
    head_since: dict[str, float] = field(default_factory=dict)  # when each first headed the queue
    sampled_at: float = 0.0  # monotonic time of the last sample of `used`
    mapped: bool = False  # a sample found a process of ours among the vendor's (its pids are ours)

    @property
    def total(self) -> int:
        return self.device.memory_total_bytes
