"""Regions.holding: whom a cancel must kill (held) rather than signal, as a region is released.

A release thaws its frozen commands one by one, then unlocks the locked ones, while the region is
still listed; a cancel that lands in between must find a command already thawed (or unlocked)
running, and send it the polite signal. The window is too short to hit with real processes
reliably, so the regions are stand-ins here; tests/lifecycle/test_cancel_held.py drives the rest."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from krex_async.daemon.regions.engine import Regions


def _regions(*active: Any) -> Any:
    return SimpleNamespace(active={i: r for i, r in enumerate(active)}, holder_on=lambda device: None)


def test_a_releasing_region_holds_only_what_it_has_not_undone() -> None:
    frozen_cmd = SimpleNamespace(id="a", group=SimpleNamespace(frozen=True), device_key="cpu0")
    thawed_cmd = SimpleNamespace(id="b", group=SimpleNamespace(frozen=False), device_key="cpu0")
    locked_cmd = SimpleNamespace(id="c", group=SimpleNamespace(frozen=False), device_key="cpu0")
    owner = SimpleNamespace(id="o", group=SimpleNamespace(frozen=True), device_key="cpu0")
    held = SimpleNamespace(frozen_ids=["a", "b"], locked_ids=["c"], locked_pids={7}, releasing=False)
    r = SimpleNamespace(command=owner, held=held)
    rs = _regions(r)
    assert Regions.holding(rs, frozen_cmd) == ("frozen", r)
    assert Regions.holding(rs, thawed_cmd) == ("frozen", r)  # entering: marked before its freeze
    assert Regions.holding(rs, locked_cmd) == ("locked", r)
    assert Regions.holding(rs, owner) is None
    held.releasing = True  # thawing: b is thawed, a not yet; c still locked
    assert Regions.holding(rs, frozen_cmd) == ("frozen", r)
    assert Regions.holding(rs, thawed_cmd) is None
    assert Regions.holding(rs, locked_cmd) == ("locked", r)
    held.locked_pids = set()  # unlocked
    assert Regions.holding(rs, locked_cmd) is None
