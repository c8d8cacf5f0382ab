"""A local Ray cluster of 3 nodes, each with its own krex daemon (`--devices cpu:2`), shared by the
tests of this package and stopped before the rest of the suite runs: starting one costs ~7 s and
~1 GB. Kept small for a 2-core CI box: 1 CPU and a 100 MB object store per node, no dashboard,
workers' logs not sent to the driver."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest

from tests.conftest import ROOT

if TYPE_CHECKING:
    from krex_async.fleet.local import LocalFleet

NEEDS_RAY = "the fleet tests need Ray (pip install 'krex[fleet]')"


@pytest.fixture(scope="package")
def local_fleet() -> Iterator[LocalFleet]:
    pytest.importorskip("ray", reason=NEEDS_RAY)
    from krex_async.fleet.local import LocalFleet

    fleet = LocalFleet(3, daemon_args=("--devices", "cpu:2"))
    try:
        fleet.start()
        yield fleet
    finally:
        fleet.close()


def env(**extra: str) -> dict[str, str]:
    """The commands' environment: this interpreter's, with krex_async importable."""
    e = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    e.pop("KREX_SOCKET", None)
    e["PYTHONPATH"] = str(ROOT) + os.pathsep + e.get("PYTHONPATH", "")
    e.update(extra)
    return e


def by_node(items: list[Any]) -> dict[str, int]:
    out: dict[str, int] = {}
    for h in items:
        out[h.node] = out.get(h.node, 0) + 1
    return out
