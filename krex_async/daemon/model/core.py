"""The daemon's shared core: the narrow state its parts take instead of the `Daemon` itself.

`Lifecycle` (commands/lifecycle.py), `WarmPools` (commands/warmpools.py), `Regions`
(regions/engine.py; its `Entry`, `Joins` and `Exits`), the probe `Attributor`
(observe/attribution.py), `DaemonStatus` (observe/status.py) and `recover` (commands/recovery.py)
each get a `Core`: the pieces of the daemon they use, each named below, and nothing else (uvicorn's
`ServerState`, CPython's process-pool manager). The observers (the metrics, the trace's region and
command events, the probe attributor) are not called through it: they subscribe to `events`
(fanout.py, events.py), which the region engine and the command lifecycle emit. The daemon's
layers, their floors and who owns which state: docs/architecture.md.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from krex_async import protocol as P
from krex_async.daemon.config import ServeConfig
from krex_async.daemon.model.command import Command
from krex_async.daemon.model.fanout import Bus
from krex_async.daemon.model.holdset import HoldSet
from krex_async.daemon.persist.records import Records
from krex_async.daemon.persist.spool import Spool
from krex_async.devices.base import ClockState, Device
from krex_async.isolation.base import Backend, Group
from krex_async.scheduler import Scheduler

if TYPE_CHECKING:
    from krex_async.ctxpool import Pool
    from krex_async.devices import Node
    from krex_async.probes.base import ProbeEvent

Send = Callable[[P.Msg], bool]  # to one connection; False once it is closed


class TraceSink(Protocol):
    """`Tracer.trace` (tracing.py): one event into the timeline ring and to `krex trace` subscribers."""

    def __call__(
        self,
        kind: str,
        region: Any = None,
        *,
        command: str = "",
        device: str = "",
        pid: int = 0,
        region_id: str = "",
        **detail: Any,
    ) -> None: ...


class Watcher(Protocol):
    """What the daemon's parts ask of the probe attributor (attribution.py) while probes run; it
    follows regions and commands through `Core.events`."""

    def command_of(self, ev: ProbeEvent | int) -> Command | None: ...
    def describe(self) -> dict[str, Any]: ...  # what the running probe backend says of itself


@dataclass(eq=False)
class Core:
    """The daemon's pieces its parts share. The containers are the daemon's own objects (shared,
    never copied), so a command registered through one is seen by all."""

    config: ServeConfig
    backend: Backend  # the isolation backend: groups, freezing, cpusets
    devices: list[Device]
    node: Node | None  # the opened vendor libraries, for live queries
    scheduler: Scheduler  # region queues per device, and the policy
    commands: dict[str, Command]  # every command the daemon knows: running, queued, kept
    pools: dict[str, Pool]  # device key -> warm workers
    trace: TraceSink  # the trace sink, for the region engine's steps (freeze, thaw, unlock)
    track: Callable[[asyncio.Task[Any]], asyncio.Task[Any]]  # keep a task until it ends
    records: Records | None  # durable command records (None without a state dir)
    spool: Spool | None  # output spool files (None without a state dir)
    probes: dict[str, Any] = field(default_factory=dict)  # probe state, shown by `krex status`
    events: Bus = field(default_factory=Bus)  # regions and commands to their observers (events.py)
    all_cpus: frozenset[int] = field(default_factory=lambda: frozenset(os.sched_getaffinity(0)))
    attributor: Watcher | None = None  # set when probes run
    closing: bool = False  # shutting down: no command, region or adoption starts any more

    def device(self, key: str) -> Device:
        return next(d for d in self.devices if d.key == key)


class Exiting(NamedTuple):
    """A process exiting with a GPU file (daemon/regions/exits.py)."""

    device: str
    noted: float  # monotonic, last noted (renewed at each release that froze it)
    start: int | None  # its start time: a reused pid is not it
    began: float  # monotonic, when its exit could first run: --exit-starve counts from here


class Outcome(StrEnum):
    """How a region stands, then how it ended (its report's `outcome` spells it)."""

    OPEN = "open"  # requested: queued, waiting its share, or entering
    HELD = "held"  # granted: the owner times
    RELEASED = "released"  # the owner exited it (RegionExit)
    EXPIRED = "expired"  # --region-timeout passed
    OWNER_DIED = "owner-died"  # its process, connection or command ended
    SHUTDOWN = "shutdown"  # the daemon shut down
    REFUSED = "refused"  # its entry failed: nothing held, the owner told why


@dataclass
class Region:
    """One region from its request to its release (regions/engine.py runs it). What it holds is its
    `held` HoldSet's (holdset.py), the only writer of the held processes and the report's hold
    fields; the read-only views below are for the daemon's readers (status, trace, cores)."""

    id: str
    command: Command
    device: str
    pid: int
    send: Callable[[P.Msg], bool]  # to the owner's connection
    req_id: int
    request: P.RegionEnter
    report: P.RegionReport
    t_request: float = field(default_factory=time.perf_counter)
    turn: asyncio.Future[None] | None = None
    ended: asyncio.Future[Outcome] | None = None
    held: HoldSet = field(init=False)
    # exits it found unfinished (Exits.wait): pid -> their Exits.exiting entry, given back at
    # the release, so that the next region finds them still exiting
    exits_left: dict[int, Exiting] = field(default_factory=dict)
    acks: dict[int, asyncio.Future[P.QuiesceAck]] = field(default_factory=dict)
    cores: frozenset[int] = frozenset()
    task: asyncio.Task[None] | None = None
    exit_id: int | None = None  # the RegionExit request that ended it, answered with the report
    paused_pool: bool = False
    # its turn has come, and it waits for siblings owed their share (share.py): they run, and it is
    # not yet the region a command starting or exiting meets (Joins.current_on)
    sharing: bool = False
    joins: list[asyncio.Task[None]] = field(default_factory=list)  # commands started meanwhile
    clock: ClockState | None = None  # the GPU clock at the grant, where the vendor can read it
    # when its entry chose whom to hold (CLOCK_MONOTONIC ns, the probes' clock): a sibling whose
    # GPU open the probes see from then on is frozen into it (Joins.freeze_late), entry included
    select_ns: int | None = None
    targets: set[str] = field(default_factory=set)  # the commands its entry chose to hold

    def __post_init__(self) -> None:
        self.held = HoldSet(self.id, self.report)

    @property
    def outcome(self) -> Outcome:
        return Outcome(self.report.outcome)

    @outcome.setter
    def outcome(self, value: Outcome) -> None:
        self.report.outcome = Outcome(value).value

    @property
    def frozen(self) -> Sequence[Group]:
        return self.held.frozen

    @property
    def frozen_ids(self) -> Sequence[str]:
        return self.held.frozen_ids

    @property
    def locked_ids(self) -> Sequence[str]:
        return self.held.locked_ids

    @property
    def locked_pids(self) -> Sequence[int]:
        return self.held.locked_pids

    def end(self, reason: Outcome) -> None:
        if self.ended is not None and not self.ended.done():
            self.ended.set_result(reason)
