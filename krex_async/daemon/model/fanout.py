"""One small fan-out from the daemon's engine to its observers (events.py names the events).

The region engine and the command lifecycle emit an event once at each point of a region's or a
command's life; the metrics (metering.py), the trace (tracing.py) and the probe attributor
(attribution.py) subscribe to the kinds they care about. Delivery is synchronous, on the loop, in
subscription order, by the event's exact type. An observer that raises is logged and skipped: it
never breaks the engine that emitted nor the observers after it (a metrics bug must not refuse a
region nor strand a command's report).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from krex_async import logs

log = logs.get("krex.events")

E = TypeVar("E")
Handler = Callable[[Any], None]


class Bus:
    def __init__(self) -> None:
        self._subs: dict[type, tuple[Handler, ...]] = {}  # a tuple: emit iterates a stable copy

    def subscribe(self, kind: type[E], handler: Callable[[E], None]) -> Callable[[], None]:
        """Call `handler` with each event of type `kind`, after those subscribed before it.
        Returns what unsubscribes it."""
        self._subs[kind] = (*self._subs.get(kind, ()), handler)
        return lambda: self.unsubscribe(kind, handler)

    def unsubscribe(self, kind: type[E], handler: Callable[[E], None]) -> None:
        """Stop calling `handler` for `kind` (its first subscription); one not subscribed is ignored."""
        subs = list(self._subs.get(kind, ()))
        if handler in subs:
            subs.remove(handler)
            if subs:
                self._subs[kind] = tuple(subs)
            else:
                del self._subs[kind]

    def subscribers(self, kind: type) -> int:
        return len(self._subs.get(kind, ()))

    def emit(self, event: object) -> None:
        for handler in self._subs.get(type(event), ()):
            try:
                handler(event)
            except Exception:  # one observer's bug costs its own part of the event, nothing else
                log.exception(
                    "observer_failed",
                    kind=type(event).__name__,
                    observer=getattr(handler, "__qualname__", repr(handler)),
                )


def undo_all(undo: list[Callable[[], None]]) -> Callable[[], None]:
    """One callable that ends several subscriptions (each observer's `observe` returns it)."""

    def run() -> None:
        for u in undo:
            u()

    return run
