"""bench/freeze_floor.py and bench/wakeup.py: real runs where the machine allows, clear refusals of
bad arguments, and nothing left behind in the cgroup tree."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest

from krex_async.probes.attribution import cgroup2_root

from ..conftest import remove_cgroup_tree
from ..testcgroups import prefix
from .conftest import run_script

V2 = cgroup2_root()


@pytest.mark.parametrize(
    "args, says",
    [
        (["-m", "bench.freeze_floor", "--root", "/tmp"], "not a cgroup v2 directory"),
        (["-m", "bench.wakeup", "--pairs", "0:x"], "expected a:b"),
        (["-m", "bench.wakeup", "--pairs", "0:4096"], "CPUs must be pairs"),
        (["-m", "bench.wakeup", "--rounds", "3"], "at least 10"),
        (["-m", "bench.replay", "--repeats", "0", "--plan"], "--repeats must be at least 1"),
    ],
)
def test_bad_arguments_are_refused_by_name(args: list[str], says: str) -> None:
    p = run_script(*args, check=False)
    assert p.returncode == 2 and says in p.stderr, p.stderr


def test_wakeup_measures_every_pair(tmp_path: Path) -> None:
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two CPUs")
    out = tmp_path / "w.json"
    run_script("-m", "bench.wakeup", "--rounds", "50", "--json", str(out))
    rows = json.loads(out.read_text())["rows"]
    assert rows and all(0 < r["wake_p50_us"] <= r["wake_p99_us"] <= r["wake_max_us"] for r in rows)


def test_freeze_floor_freezes_and_cleans_up(tmp_path: Path) -> None:
    if os.geteuid() != 0 or V2 is None:
        pytest.skip("needs root and a writable cgroup v2 hierarchy")
    # Its own parent cgroup: daemons of concurrent test runs add and remove theirs under V2.
    root = tempfile.mkdtemp(prefix=prefix() + "floor-", dir=V2)
    try:
        before = set(os.listdir(root))
        out = tmp_path / "f.json"
        run_script(
            "-m",
            "bench.freeze_floor",
            "--root",
            root,
            "--groups",
            "2",
            "--rounds",
            "5",
            "--json",
            str(out),
            timeout=60,
        )
        row = json.loads(out.read_text())
        assert row["groups"] == 2 and 0 < row["writes_p50_us"] <= row["frozen_p50_us"]
        assert set(os.listdir(root)) == before  # its cgroups are gone
    finally:
        remove_cgroup_tree(root)
