"""The short form of bench/soak.py (64 agents, 10 s) in CI: no deadlock, every result exactly once,
no fd, cgroup or command leaked, memory flat. The long form: see the report / bench/RESULTS.md."""

from __future__ import annotations

import subprocess

import pytest

from ..conftest import PY, ROOT, py_env


@pytest.mark.slow
def test_soak_short_form():
    p = subprocess.run([PY, str(ROOT / "bench" / "soak.py"), "--agents", "64", "--seconds", "10",
                        "--grace", "30"], env=py_env(), capture_output=True, text=True, timeout=180)
    print(p.stdout)
    assert p.returncode == 0, p.stdout + p.stderr
