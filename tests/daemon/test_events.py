"""The daemon's event fan-out (daemon/fanout.py): order, unsubscribe, and an observer that raises."""

from __future__ import annotations

from dataclasses import dataclass

import structlog

from krex_async.daemon import events as E
from krex_async.daemon.fanout import Bus


@dataclass(frozen=True)
class Ping:
    n: int


@dataclass(frozen=True)
class Pong:
    n: int


def test_observers_run_in_subscription_order_and_by_exact_type() -> None:
    bus = Bus()
    seen: list[tuple[str, int]] = []
    bus.subscribe(Ping, lambda e: seen.append(("a", e.n)))
    bus.subscribe(Ping, lambda e: seen.append(("b", e.n)))
    bus.subscribe(Pong, lambda e: seen.append(("pong", e.n)))
    bus.emit(Ping(1))
    bus.emit(Pong(2))
    bus.emit(object())  # nobody listens: nothing happens
    assert seen == [("a", 1), ("b", 1), ("pong", 2)]


def test_an_observer_that_raises_is_logged_and_the_others_still_run() -> None:
    bus = Bus()
    seen: list[str] = []

    def broken(e: Ping) -> None:
        raise RuntimeError("observer bug")

    bus.subscribe(Ping, lambda e: seen.append("before"))
    bus.subscribe(Ping, broken)
    bus.subscribe(Ping, lambda e: seen.append("after"))
    with structlog.testing.capture_logs() as logged:
        bus.emit(Ping(7))  # does not raise
        bus.emit(Ping(8))
    assert seen == ["before", "after", "before", "after"]
    failures = [x for x in logged if x["event"] == "observer_failed"]
    assert len(failures) == 2
    assert failures[0]["log_level"] == "error" and failures[0]["kind"] == "Ping"
    assert "broken" in failures[0]["observer"] and failures[0]["exc_info"] is True


def test_unsubscribe_stops_only_that_observer() -> None:
    bus = Bus()
    seen: list[str] = []

    def a(e: Ping) -> None:
        seen.append("a")

    def b(e: Ping) -> None:
        seen.append("b")

    bus.subscribe(Ping, a)
    undo_b = bus.subscribe(Ping, b)
    bus.emit(Ping(1))
    undo_b()
    bus.emit(Ping(2))
    bus.unsubscribe(Ping, a)
    bus.emit(Ping(3))
    bus.unsubscribe(Ping, a)  # twice, or never subscribed: ignored
    bus.unsubscribe(Pong, b)
    assert seen == ["a", "b", "a"]
    assert bus.subscribers(Ping) == 0


def test_an_observer_unsubscribing_while_the_event_runs_does_not_skip_the_next() -> None:
    bus = Bus()
    seen: list[str] = []
    undo: list[object] = []

    def once(e: Ping) -> None:
        seen.append("once")
        undo[0]()  # type: ignore[operator]

    undo.append(bus.subscribe(Ping, once))
    bus.subscribe(Ping, lambda e: seen.append("next"))
    bus.emit(Ping(1))
    bus.emit(Ping(2))
    assert seen == ["once", "next", "next"]


def test_bound_methods_unsubscribe_by_equality() -> None:
    class Watcher:
        def __init__(self) -> None:
            self.n = 0

        def on(self, e: Ping) -> None:
            self.n += 1

    bus, w = Bus(), Watcher()
    bus.subscribe(Ping, w.on)
    bus.emit(Ping(1))
    bus.unsubscribe(Ping, w.on)  # a new bound method object, equal to the subscribed one
    bus.emit(Ping(2))
    assert w.n == 1


def test_events_are_frozen() -> None:
    ev = E.SiblingHeld(device="cpu:0", command="c-1", seconds=1.5)
    try:
        ev.seconds = 2.0  # type: ignore[misc]
    except AttributeError:
        pass
    else:
        raise AssertionError("an event's fields must not change on its way to the observers")
