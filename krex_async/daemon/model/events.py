"""What the region engine (regions/engine.py) and the command lifecycle (lifecycle.py, warmpools.py,
admission.py) tell their observers, through the core's `events` bus (fanout.py).

Each event is emitted once, at one point of a region's or a command's life; the docstrings say
when. Observers read the region's report or the command's report for the rest: an event carries
only what those do not hold at that moment.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from krex_async.daemon.model.command import Command
    from krex_async.daemon.model.core import Region


# ------------------------------------------------------------------------------------ regions


@dataclass(frozen=True, slots=True)
class RegionQueued:
    """The region waits behind another on its device."""

    region: Region


@dataclass(frozen=True, slots=True)
class RegionGranted:
    """Isolated, the grant about to be sent: the owner waits on every subscriber, keep them short."""

    region: Region
    frozen: int  # commands it froze
    locked: int  # commands it holds by the lock


@dataclass(frozen=True, slots=True)
class RegionRunning:
    """The grant is on its way to the owner: what need not delay it happens here."""

    region: Region


@dataclass(frozen=True, slots=True)
class RegionReleasing:
    """The region ends (released, expired, withdrawn, refused): before anything it held thaws."""

    region: Region


@dataclass(frozen=True, slots=True)
class RegionReleased:
    """Released and its successor promoted, before its owner is answered."""

    region: Region
    granted: bool  # it was granted (else withdrawn or refused before the grant)
    held: tuple[str, ...]  # the commands it held (frozen or locked)


@dataclass(frozen=True, slots=True)
class RegionAnswered:
    """Its owner has been answered (granted, revoked or refused): what need not delay the answer
    (the trace) happens here."""

    region: Region


@dataclass(frozen=True, slots=True)
class ShareWaiting:
    """With its turn, the region waits while siblings run their owed share (share.py)."""

    region: Region
    owed: dict[str, float]  # command -> seconds owed


@dataclass(frozen=True, slots=True)
class ShareWaited:
    region: Region
    seconds: float


@dataclass(frozen=True, slots=True)
class SiblingHeld:
    """A region held `command` from its entry to the thaw; `seconds`: what it was charged for that
    (share.py: the span, less the CPU time it used while only locked)."""

    device: str
    command: str
    seconds: float


@dataclass(frozen=True, slots=True)
class SiblingForgotten:
    """A command the share tracked runs no more."""

    command: str


# ----------------------------------------------------------------------------------- commands


@dataclass(frozen=True, slots=True)
class CommandSubmitted:
    cmd: Command
    queued: bool


@dataclass(frozen=True, slots=True)
class CommandStarted:
    """Its processes run (or start frozen, under a region: `frozen`)."""

    cmd: Command
    frozen: bool


@dataclass(frozen=True, slots=True)
class WorkerJoined:
    """A warm pool worker took over a process of the command."""

    cmd: Command
    pid: int


@dataclass(frozen=True, slots=True)
class CommandRequeued:
    """Ended by `reason` and put back in line to run again (reruns.py)."""

    cmd: Command
    reason: str


@dataclass(frozen=True, slots=True)
class CommandEnded:
    """Its report (cmd.report) is final; emitted before its agents hear of it."""

    cmd: Command


@dataclass(frozen=True, slots=True)
class CommandGone:
    """Reported and its group removed: only late events of its processes remain."""

    cmd: Command


# ------------------------------------------------------------------------------- device memory


@dataclass(frozen=True, slots=True)
class MemoryWaiting:
    """Commands waiting for device memory (admission.py)."""

    device: str
    waiting: int


@dataclass(frozen=True, slots=True)
class MemoryReserved:
    device: str
    reserved: int
    used: int
