"""The daemon's trace sink: each event goes into the timeline ring, which `krex export --perfetto`
reads back (timeline.py draws it), and out at once to the `krex trace` subscribers."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import msgspec

from krex_async import protocol as P
from krex_async.daemon.core import Send
from krex_async.daemon.timeline import TraceRing


class Tracer:
    def __init__(self) -> None:
        self.ring = TraceRing(P.TraceEvent)
        self.subscribers: list[tuple[Send, int]] = []  # `krex trace` peers: (send, request id)

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
