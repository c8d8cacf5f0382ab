"""Probe events to commands, devices and regions: who touched the GPU driver, and was it a stray.

Every event names a tgid (and, from bcc, its cgroup id). It belongs to a command when its cgroup is the
command's or the tgid descends from the command's leader (probes.attribution); otherwise it is from
outside krex. While a
region is held on a device, an event from any process that is not the owner command's, on that device
or from outside krex (which could be on any device), is a *stray*: it is counted in the region's report
with its pid and first events, and sent to `krex trace` at once.

The event stream can lose events under load; the backend's kernel-side counts per tgid do not. At
release the region compares those counts to what it saw, and a region during which the backend lost
events is marked `tainted`, never reported clean.
The tracefs backend keeps no counts kernel-side (its counts are the lines its reader has parsed), so
at a grant and at a release the loop first waits for its reader to catch up (settle(), about a
millisecond; a region whose window could not be settled within SETTLE_S is `tainted`), and the
region keeps its window watched until the settle has handed over every batch: its stream is then
complete, and its counts are not compared (they are the same lines, and later ones).

A backend that fails at runtime (its polling thread died; probes/failure.py) calls probe_failed()
on the loop: it is logged once as an error, `core.probes` (shown by `krex status`) says
`failed` with the reason, `krex trace` subscribers get a `probes_failed` event, the backend is
stopped (thread joined, program detached, tracefs instance removed), and every region held then or
granted later is `tainted`: nothing watched it. The daemon goes on serving.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from krex_async import logs
from krex_async.daemon.model import events as E
from krex_async.daemon.model.fanout import Bus, undo_all
from krex_async.daemon.observe.metrics import Metrics
from krex_async.linux import procfs
from krex_async.probes.attribution import EventMapper, parent_pid
from krex_async.probes.base import ProbeBackend, ProbeEvent

if TYPE_CHECKING:
    from krex_async.daemon.model.command import Command
    from krex_async.daemon.model.core import Core, Region
    from krex_async.daemon.regions.engine import Regions

log = logs.get("krex.probes")

FIRST_STRAYS = 10
SETTLE_S = 0.1  # longest the loop waits, at a grant or release, for a lagging tracefs reader


@dataclass
class RegionWatch:
    """What a held region has seen so far."""

    since_ns: int
    lost_at_start: int
    until_ns: int | None = None  # set at the release: an event stamped later is not the region's
    counts_at_start: dict[int, int] | None = None  # None until counts_snapshot() (or if it failed)
    pids: dict[int, int] = field(default_factory=dict)  # stray tgid -> events
    first: list[str] = field(default_factory=list)
    procs: dict[int, str] = field(default_factory=dict)  # stray tgid -> who it was (describe())
    unverified: bool = False  # a batch could not be attributed while it was held

    def covers(self, ts_ns: int) -> bool:
        """Whether an event stamped `ts_ns` falls in the region's window."""
        return self.since_ns <= ts_ns and (self.until_ns is None or ts_ns < self.until_ns)


def describe(pid: int, proc: str = procfs.PROC) -> str:
    """Who a process is, for a stray's report: its parent, cgroup and command line, read once when
    its first stray event is attributed (a few /proc reads; a process that is gone says so)."""
    parts = []
    ppid = parent_pid(pid, proc)
    if ppid is not None:
        parts.append(f"ppid {ppid}")
    lines = procfs.cgroups(pid, proc)
    if lines is None:
        return ", ".join(parts) or "gone"
    cg = [path for hid, ctrls, path in lines if hid == "0" and not ctrls]
    if cg:
        parts.append(f"cgroup {cg[0]}")
    if (raw := procfs.cmdline(pid, proc, 512)) is not None:
        argv = raw.rstrip(b"\0").replace(b"\0", b" ").decode("utf-8", "replace")
        parts.append(f"cmd {argv[:200]!r}")
    return ", ".join(parts) or "gone"


class Attributor:
    def __init__(
        self,
        core: Core,
        regions: Regions,
        backend: ProbeBackend,
        metrics: Metrics,
        tracers: Sequence[object] = (),
    ) -> None:
        self.core = core
        self.regions = regions  # the regions held now: their strays, and a late open to freeze
        self.backend = backend
        # settle(): what a backend whose counts are not kept kernel-side has (tracefs), else None
        self.settles: Callable[[float], bool] | None = getattr(backend, "settle", None)
        self.metrics = metrics  # the events the backend lost
        self.tracers = tracers  # `krex trace` subscribers: a probe event is traced only for them
        self.watches: dict[str, RegionWatch] = {}  # region id -> watch
        self.mapper = EventMapper()
        self.events = 0
        self.failed: str | None = None  # why the backend stopped at runtime

    def observe(self, bus: Bus) -> Callable[[], None]:
        """Follow the regions and commands (events.py) while probes run; returns what unsubscribes."""
        undo = [
            bus.subscribe(E.RegionGranted, lambda e: self.region_granted(e.region)),
            bus.subscribe(E.RegionRunning, lambda e: self.counts_snapshot(e.region)),
            bus.subscribe(E.RegionReleasing, self._releasing),
            bus.subscribe(E.CommandStarted, lambda e: self.command_started(e.cmd)),
            bus.subscribe(E.WorkerJoined, lambda e: self.worker_joined(e.cmd, e.pid)),
            bus.subscribe(E.CommandRequeued, lambda e: self.command_ended(e.cmd)),
            bus.subscribe(E.CommandGone, self._gone),
        ]
        return undo_all(undo)

    def _gone(self, e: E.CommandGone) -> None:
        """Its group is gone: late events of its processes still attribute for a second."""
        asyncio.get_running_loop().call_later(1.0, self.command_ended, e.cmd)

    def _releasing(self, e: E.RegionReleasing) -> None:
        """Close the stray window before anything thaws: driver calls of the siblings after the
        release are theirs to make. Events the stream still owes (a lagging reader) are covered
        by the backend's counts, or by its settle()."""
        try:
            self.region_released(e.region)
        except Exception as ex:  # the probes' reading failed: what they saw is unknown
            rep = e.region.report
            rep.tainted = True
            rep.taint.append(f"probe reading failed at the release: {ex!r}")
            log.exception(
                "region_probe_release_failed",
                region=e.region.id,
                command=e.region.command.id,
                device=e.region.device,
            )

    def command_started(self, cmd: Command) -> None:
        if cmd.pid is not None and cmd.group is not None:
            self.mapper.add(cmd.id, cmd.pid, cgroup_dir=self.core.backend.cgroup_dir(cmd.group))

    def worker_joined(self, cmd: Command, pid: int) -> None:
        """A pool worker took over a process of `cmd`: its events are the command's."""
        self.mapper.add(cmd.id, pid)

    def command_ended(self, cmd: Command) -> None:
        # a pool worker that served it is back in its pool (or gone): no longer the command's
        pool = self.core.pools.get(cmd.device_key or "")
        self.mapper.remove(cmd.id, forget=pool.pids() if pool is not None else ())

    def _pool_device(self, tgid: int) -> str | None:
        """The device whose warm pool `tgid` is a worker of (in no command), else None."""
        return next((key for key, pool in self.core.pools.items() if tgid in pool.pids()), None)

    def describe(self) -> dict[str, Any]:
        """What the probe backend says of itself (the launch probe: its scope, processes probed)."""
        return self.backend.describe()

    def command_of(self, ev: ProbeEvent | int) -> Command | None:
        if isinstance(ev, int):
            ev = ProbeEvent(ts_ns=0, tgid=ev, tid=ev, kind="count")
        cid = self.mapper.command_of(ev)
        return self.core.commands.get(cid) if cid else None

    # ------------------------------------------------------------------------------ regions

    def _settle(self) -> bool:
        """Bring a backend whose counts are not kept kernel-side (tracefs: what its reader has
        parsed) up to now. Blocks the loop (about a millisecond; at most SETTLE_S). False: its
        counts may miss events made before this call."""
        return True if self.settles is None or self.failed is not None else bool(self.settles(SETTLE_S))

    def region_granted(self, r: Region) -> None:
        """Open the region's stray window, just before the grant is sent. Only what must precede
        the grant happens here (the window's start and the loss count): the count snapshot waits
        for counts_snapshot(), after the grant, so the owner does not wait for it."""
        self.watches[r.id] = RegionWatch(since_ns=time.monotonic_ns(), lost_at_start=self.backend.lost())

    def counts_snapshot(self, r: Region) -> None:
        """The kernel-side counts at the region's start, read once the grant is on its way (a map
        read costs 0.1-0.7 ms). Taking it after the window opened is safe: an event between the
        two is in the stream (counted from since_ns) and in both count readings, so it is neither
        lost nor counted twice (release takes, per process, the larger of stream and counts)."""
        w = self.watches.get(r.id)
        if w is None:
            return
        if not self._settle():
            w.unverified = True
        w.counts_at_start = self._counts(r, w)

    def _counts(self, r: Region, w: RegionWatch) -> dict[int, int] | None:
        """The backend's counts now, or None (the region then unverified) when its map cannot be
        read: such a region is tainted, not failed."""
        try:
            return dict(self.backend.counts())
        except OSError as e:
            log.warning("probe_counts_failed", region=r.id, error=str(e))
            w.unverified = True
            return None

    def region_released(self, r: Region) -> None:
        w = self.watches.get(r.id)
        if w is None:
            return
        # The window closes now, but stays watched while the reader catches up: the batches
        # settle() hands over are the region's last strays. Closed first, they were left to the
        # counts alone, and those are short when the snapshot at the start came after the first
        # strays (2998 of 3000 under load, counted neither in the stream nor in the difference).
        w.until_ns = time.monotonic_ns()
        try:
            if not self._settle():
                w.unverified = True
        finally:
            self.watches.pop(r.id, None)
        rep = r.report
        # Lossless kernel-side counts catch strays whose events the stream dropped. A backend that
        # settles keeps none: its counts are the lines its stream was made of, then complete, and
        # later ones too (an outsider's ioctls in the settle, after the window closed).
        start = w.counts_at_start
        if start is None:
            w.unverified = True  # no snapshot at the start: the stream alone cannot be trusted
        elif self.settles is None:
            for tgid, n in (self._counts(r, w) or {}).items():
                extra = n - start.get(tgid, 0)
                if extra > w.pids.get(tgid, 0) and self._is_stray(r, tgid):
                    w.pids[tgid] = extra
        rep.strays = sum(w.pids.values())
        rep.stray_pids = sorted(w.pids)
        rep.first_strays = list(w.first)
        rep.stray_procs = dict(w.procs)
        for late in rep.lock_late:
            late.strays = w.pids.get(late.pid, 0)
        if self.failed is not None or w.unverified or self.backend.lost() > w.lost_at_start:
            rep.tainted = True

    def probe_failed(self, reason: str) -> None:
        """The backend died at runtime (called on the loop, once): say so everywhere, stop it."""
        if self.failed is not None:
            return
        self.failed = reason
        log.error(
            "probes_failed", backend=self.backend.name, reason=reason, regions_tainted=sorted(self.watches)
        )
        self.core.probes.update(state="failed", reason=reason, failed_at=time.time())
        self.core.trace("probes_failed", None, backend=self.backend.name, reason=reason)
        try:
            self.backend.stop()
        except Exception as e:  # stopping a broken backend must not take the loop down
            log.warning("probes_stop_failed", backend=self.backend.name, error=repr(e))

    def _is_stray(self, r: Region, ev: ProbeEvent | int) -> bool:
        if (ev if isinstance(ev, int) else ev.tgid) == os.getpid():
            return False
        cmd = self.command_of(ev)
        if cmd is None:  # outside krex, it may be on any device; a pool worker is on its pool's
            dev = self._pool_device(ev if isinstance(ev, int) else ev.tgid)
            return dev is None or dev == r.device
        if cmd is r.command:
            return False
        return cmd.device_key == r.device

    # ------------------------------------------------------------------------------- events

    def on_events(self, batch: list[ProbeEvent]) -> None:
        """Called on the loop with each batch the backend's polling thread delivered. A bug in
        attributing it costs that batch: it is logged, and the regions held now are tainted."""
        try:
            self._attribute(batch)
        except Exception:
            log.exception("probe_batch_failed", events=len(batch))
            for w in self.watches.values():
                w.unverified = True

    def _attribute(self, batch: list[ProbeEvent]) -> None:
        self.events += len(batch)
        self.metrics.probe_lost_total(self.backend.lost())
        held = [r for rid in self.watches if (r := self.regions.get(rid)) is not None]
        # a GPU open since a region chose whom to hold freezes the sibling, its entry included
        choosing = [*held, *self.regions.choosing()]
        for ev in batch:
            if ev.kind == "open":
                for r in choosing:
                    self.regions.freeze_late(r, ev)
            stray_for = None
            for r in held:
                w = self.watches[r.id]
                if w.covers(ev.ts_ns) and self._is_stray(r, ev):
                    stray_for = r
                    if ev.tgid not in w.pids and len(w.procs) < FIRST_STRAYS:
                        w.procs[ev.tgid] = describe(ev.tgid)
                    w.pids[ev.tgid] = w.pids.get(ev.tgid, 0) + 1
                    if len(w.first) < FIRST_STRAYS:
                        w.first.append(
                            f"+{(ev.ts_ns - w.since_ns) / 1e6:.3f} ms pid {ev.tgid} "
                            f"({ev.comm}) {ev.kind} {ev.name or hex(ev.request)}"
                        )
            if self.tracers:
                self._trace_event(ev, stray_for, held)

    def _trace_event(self, ev: ProbeEvent, stray_for: Region | None, held: list[Region]) -> None:
        """One probe event for `krex trace`: attributed to the process's own command ("" outside
        krex), never to the region's owner; a stray names the region and its owner, and an event
        of an owner inside its own region names that region."""
        cmd = self.command_of(ev)
        region = stray_for or next((r for r in held if cmd is not None and r.command is cmd), None)
        extra = {"owner": stray_for.command.id} if stray_for is not None else {}
        self.core.trace(
            "stray" if stray_for else "probe",
            None,
            command=cmd.id if cmd else "",
            device=region.device if region is not None else (cmd.device_key or "" if cmd else ""),
            region_id=region.id if region is not None else "",
            pid=ev.tgid,
            tid=ev.tid,
            probe=ev.kind,
            fd=ev.fd,
            request=ev.request,
            name=ev.name,
            comm=ev.comm,
            **extra,
        )
