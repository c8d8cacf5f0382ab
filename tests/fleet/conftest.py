"""A local Ray cluster of 3 nodes, each with its own krex daemon (`--devices cpu:2`), shared by the
tests of this package and stopped before the rest of the suite runs: starting one costs ~7 s and
~1 GB. Kept small for a 2-core CI box: 1 CPU and a 100 MB object store per node, no dashboard,
workers' logs not sent to the driver.

The fleet runs no command as root: as root, the local fleet's commands run as `nobody`, so they use
the interpreter and import path that unprivileged users have (PY, env())."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from tests.conftest import ROOT, open_tmpdir
from tests.security.helpers import USER_PY, USER_PYTHONPATH

if TYPE_CHECKING:
    from krex_async.fleet.local import LocalFleet

NEEDS_RAY = "the fleet tests need Ray (pip install 'krex[fleet]')"
# What the fleet's commands run: as root they run as `nobody`, who cannot reach this venv's python.
PY = USER_PY if os.geteuid() == 0 else sys.executable


@pytest.fixture(scope="package")
def local_fleet() -> Iterator[LocalFleet]:
    pytest.importorskip("ray", reason=NEEDS_RAY)
    from krex_async.fleet.local import LocalFleet

    if os.geteuid() == 0:  # the gateway tests' job user, in the socket group, runs the commands
        from tests.gateway.conftest import JOB_USER, SOCKET_GROUP
        from tests.security.helpers import _ensure_group, _ensure_user

        _ensure_group(SOCKET_GROUP)
        _ensure_user(JOB_USER, [SOCKET_GROUP])
        fleet = LocalFleet(3, daemon_args=("--devices", "cpu:2"), run_as=JOB_USER, socket_group=SOCKET_GROUP)
    else:
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
    e["PYTHONPATH"] = os.pathsep.join([str(ROOT), USER_PYTHONPATH, e.get("PYTHONPATH", "")])
    e.update(extra)
    return e


def by_node(items: list[Any]) -> dict[str, int]:
    out: dict[str, int] = {}
    for h in items:
        out[h.node] = out.get(h.node, 0) + 1
    return out


@pytest.fixture
def shared_tmp() -> Iterator[Path]:
    """A directory the fleet's commands (run as an unprivileged user) can write: pytest's tmp_path
    is under a 0700 directory of root's."""
    with open_tmpdir("krex-fleettest-", 0o777) as path:
        yield path
