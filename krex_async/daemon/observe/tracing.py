"""The daemon's trace sink: each event goes into the timeline ring, which `krex export --perfetto`
reads back (timeline.py draws it), and out at once to the `krex trace` subscribers. The region and
command events (events.py) reach it through the core's bus (`Tracer.observe`); the region engine's
finer steps (freeze, thaw, unlock) call the sink itself."""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Mapping
from typing import Any

import msgspec

from krex_async import protocol as P
from krex_async.daemon.model import events as E
from krex_async.daemon.model.core import Send
from krex_async.daemon.model.fanout import Bus, undo_all
from krex_async.daemon.observe.timeline import TraceRing

NAMES_KEPT = 4096  # region id -> name, for the strays and probes that name only the id
ARGV_CHARS = 256  # a command's argv as one string, cut: a trace names it, the report has it whole
FROZEN_NAMED = 64  # frozen command ids a freeze/thaw event lists (its `groups` counts them all)


class Tracer:
    def __init__(self, commands: Mapping[str, Any] | None = None) -> None:
        self.ring = TraceRing(P.TraceEvent)
        self.subscribers: list[tuple[Send, int]] = []  # `krex trace` peers: (send, request id)
        self.commands: Mapping[str, Any] = commands if commands is not None else {}
        self.names: collections.OrderedDict[str, str] = collections.OrderedDict()

    def observe(self, bus: Bus) -> Callable[[], None]:
        """Trace the region and command events; returns what unsubscribes them all."""
        undo = [
            bus.subscribe(E.RegionQueued, lambda e: self.trace("region_queued", e.region)),
            bus.subscribe(E.RegionRunning, self._region_grant),
            bus.subscribe(E.RegionAnswered, self._region_release),
            bus.subscribe(E.ShareWaiting, self._share_wait),
            bus.subscribe(E.CommandStarted, self._command_start),
            bus.subscribe(E.CommandEnded, self._command_end),
        ]
        return undo_all(undo)

    def _region_grant(self, e: E.RegionRunning) -> None:
        rep = e.region.report
        self.trace(
            "region_grant", e.region, enter_s=rep.enter_s, frozen=rep.frozen, pool_wait_s=rep.pool_wait_s
        )

    def _region_release(self, e: E.RegionAnswered) -> None:
        rep = e.region.report
        self.trace("region_release", e.region, outcome=rep.outcome, held_s=rep.held_s)

    def _share_wait(self, e: E.ShareWaiting) -> None:
        self.trace("region_share_wait", e.region, owed={k: round(v, 3) for k, v in e.owed.items()})

    def _command_start(self, e: E.CommandStarted) -> None:
        cmd = e.cmd
        self.trace(
            "command_start",
            None,
            command=cmd.id,
            device=cmd.device_key or "",
            pid=cmd.pid or 0,
            frozen=e.frozen,
        )

    def _command_end(self, e: E.CommandEnded) -> None:
        cmd, report = e.cmd, e.cmd.report
        assert report is not None
        self.trace(
            "command_end",
            None,
            command=cmd.id,
            device=cmd.device_key or "",
            state=report.state,
            exit_code=report.exit_code,
        )

    def _describe(self, kind: str, region: Any, command: str, region_id: str, detail: dict[str, Any]) -> None:
        """What makes an event readable without a lookup (bcc tools name COMM and PID): the name
        the code gave the region beside its id, the commands a freeze or thaw held, a command's
        label and argv at its start."""
        name = getattr(getattr(region, "report", None), "name", "") if region is not None else ""
        rid = region_id or (region.id if region is not None else "")
        if name and rid:
            self.names[rid] = name
            self.names.move_to_end(rid)
            while len(self.names) > NAMES_KEPT:
                self.names.popitem(last=False)
        if rid and (name := name or self.names.get(rid, "")):
            detail.setdefault("region_name", name)
        if kind in ("freeze", "thaw") and region is not None and not detail.get("late"):
            detail.setdefault("frozen", list(region.frozen_ids)[:FROZEN_NAMED])
        if kind == "command_start" and (cmd := self.commands.get(command)) is not None:
            spec = getattr(cmd, "spec", None)
            if spec is not None:
                if spec.label:
                    detail.setdefault("label", spec.label)
                detail.setdefault("argv", " ".join(spec.argv)[:ARGV_CHARS])

    def trace(
        self,
        kind: str,
        region: Any = None,
        *,
        command: str = "",
        device: str = "",
        pid: int = 0,
        region_id: str = "",
        **detail: Any,
    ) -> None:
        """Record a trace event in the timeline ring and stream it to `krex trace` subscribers.
        Fields not given come from `region` (its device, owner, id and pid)."""
        self._describe(kind, region, command, region_id, detail)
        ev = P.TraceEvent(
            id=0,
            ts=time.time(),
            kind=kind,
            device=device or (region.device if region is not None else ""),
            command=command or (region.command.id if region is not None else ""),
            region=region_id or (region.id if region is not None else ""),
            pid=pid or (region.pid if region is not None else 0),
            detail=detail,
        )
        self.ring.append(ev)
        for send, req_id in list(self.subscribers):
            if not send(msgspec.structs.replace(ev, id=req_id)):
                self.subscribers.remove((send, req_id))

    def send_timeline(
        self, req: P.Timeline, send: Send, visible: Callable[[P.TraceEvent], bool] | None = None
    ) -> None:
        """The timeline ring in chunks; only the events `visible` allows, when given."""
        events = [e for e in self.ring if visible is None or visible(e)]
        step = 2000
        for i in range(0, max(1, len(events)), step):
            chunk = [msgspec.structs.replace(e, id=req.id) for e in events[i : i + step]]
            if not send(P.TimelineChunk(id=req.id, events=chunk, last=i + step >= len(events))):
                return

    def drop(self, send: Send) -> None:
        """A connection closed: it subscribes no more (in place: the core shares the list)."""
        self.subscribers[:] = [(s, i) for s, i in self.subscribers if s != send]
