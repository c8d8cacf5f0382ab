"""The short form of bench/soak.py in CI (64 agents, as the issue asks, for 8 s): no deadlock
(progress stops while agents wait), every result exactly once, no fd, cgroup or command leaked,
memory flat. The long form and its figures: bench/RESULTS.md.

This is also the regression test for a race that left a command frozen for good: a command admitted
frozen into a region that released while the daemon was still spawning it (creating its cgroup
awaits) was added to the region's frozen set after the thaw. 3 of 3 runs at 16 agents left one or
two of ~70 commands without a result before `Joins.join` reconciled starts with regions."""

from __future__ import annotations

import subprocess

import pytest

from ..conftest import PY, ROOT, py_env


@pytest.mark.slow
def test_soak_short_form():
    p = subprocess.run(
        [PY, "-m", "bench.soak", "--agents", "64", "--seconds", "8", "--grace", "60", "--stall", "20"],
        env=py_env(),
        capture_output=True,
        cwd=ROOT,
        text=True,
        timeout=240,
    )
    print(p.stdout)
    assert p.returncode == 0, p.stdout + p.stderr
