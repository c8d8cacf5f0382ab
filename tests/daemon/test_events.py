"""The daemon's event fan-out (daemon/model/fanout.py): order, unsubscribe, and an observer that raises."""

from __future__ import annotations

from dataclasses import dataclass

import structlog

from krex_async.daemon.model import events as E
from krex_async.daemon.model.fanout import Bus


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


# ------------------------------------------------------------------- the daemon's own observers


def _observers(bus: Bus, commands: dict[str, object] | None = None):
    """The observers the daemon subscribes (daemon.py, Daemon.attributor), on `bus`."""
    from krex_async.daemon.observe.attribution import Attributor
    from krex_async.daemon.observe.metering import Metering
    from krex_async.daemon.observe.metrics import Metrics
    from krex_async.daemon.observe.tracing import Tracer

    metrics, tracer = Metrics(), Tracer()
    Metering(metrics, commands if commands is not None else {}, {}).observe(bus)  # type: ignore[arg-type]
    tracer.observe(bus)
    attributor = Attributor(None, None, None, metrics)  # type: ignore[arg-type]  # observe() needs none
    return metrics, tracer, attributor, attributor.observe(bus)


def _event_types() -> list[type]:
    return [v for v in vars(E).values() if isinstance(v, type) and v.__module__ == E.__name__]


def test_every_event_the_engine_emits_has_an_observer_and_unobserve_ends_the_attributors() -> None:
    bus = Bus()
    _, _, _, unobserve = _observers(bus)
    kinds = _event_types()
    assert len(kinds) >= 15
    assert [k.__name__ for k in kinds if not bus.subscribers(k)] == []
    unobserve()  # probes stopped: only the metrics and the trace still follow the regions
    assert bus.subscribers(E.RegionReleasing) == 0 and bus.subscribers(E.WorkerJoined) == 0
    assert bus.subscribers(E.RegionReleased) == 1 and bus.subscribers(E.RegionAnswered) == 1


def _sample(metrics, name: str, **labels: str) -> float | None:
    from prometheus_client.parser import text_string_to_metric_families

    for fam in text_string_to_metric_families(metrics.scrape().decode()):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return None


def test_a_region_s_events_reach_the_metrics_and_the_trace() -> None:
    from types import SimpleNamespace

    from krex_async import protocol as P

    bus = Bus()
    commands: dict[str, object] = {"c-2": SimpleNamespace(id="c-2", uid=0)}  # a sibling it holds
    metrics, tracer, _, unobserve = _observers(bus, commands)
    unobserve()  # no probe backend here
    if not metrics.available:
        import pytest

        pytest.skip("prometheus_client is not installed")
    report = P.RegionReport(region="c-1.1", name="loop", device="cpu:0", pid=42, policy="region")
    owner = SimpleNamespace(id="c-1", uid=0)
    r = SimpleNamespace(id="c-1.1", device="cpu:0", pid=42, command=owner, report=report, frozen_ids=[])
    bus.emit(E.RegionGranted(r, frozen=2, locked=1))  # type: ignore[arg-type]
    assert _sample(metrics, "krex_regions_held", device="cpu:0") == 1
    assert _sample(metrics, "krex_commands_held", device="cpu:0", mode="frozen") == 2
    assert _sample(metrics, "krex_commands_held", device="cpu:0", mode="locked") == 1
    bus.emit(E.RegionRunning(r))  # type: ignore[arg-type]
    report.outcome, report.held_s = "released", 0.25
    bus.emit(E.RegionReleased(r, granted=True, held=("c-2", "gone")))  # type: ignore[arg-type]
    bus.emit(E.RegionAnswered(r))  # type: ignore[arg-type]
    assert _sample(metrics, "krex_regions_held", device="cpu:0") == 0
    assert _sample(metrics, "krex_commands_held", device="cpu:0", mode="frozen") == 0
    assert _sample(metrics, "krex_held_seconds_total", user="root") == 0.25  # c-2's; "gone" ended
    assert _sample(metrics, "krex_regions_total", device="cpu:0", outcome="released") == 1
    assert [(e.kind, e.region, e.command) for e in tracer.ring] == [
        ("region_grant", "c-1.1", "c-1"),
        ("region_release", "c-1.1", "c-1"),
    ]
    assert tracer.ring and list(tracer.ring)[-1].detail["outcome"] == "released"


def test_a_probe_reading_that_fails_at_the_release_taints_the_region_and_the_others_still_run() -> None:
    from types import SimpleNamespace

    from krex_async import protocol as P

    bus = Bus()
    _, tracer, attributor, _ = _observers(bus)
    seen: list[str] = []
    bus.subscribe(E.RegionReleasing, lambda e: seen.append(e.region.id))

    def broken(r: object) -> None:
        raise OSError("map read failed")

    attributor.region_released = broken  # type: ignore[method-assign]
    report = P.RegionReport(region="c-1.1", name="loop", device="cpu:0", pid=42, policy="region")
    r = SimpleNamespace(id="c-1.1", device="cpu:0", pid=42, command=SimpleNamespace(id="c-1"), report=report)
    bus.emit(E.RegionReleasing(r))  # type: ignore[arg-type]
    assert report.tainted and "map read failed" in report.taint[0]
    assert seen == ["c-1.1"]
