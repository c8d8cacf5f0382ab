"""bench/gpu's accelerator scripts, named after what they measure (they replaced run_s9.sh ..
run_s16.sh, named after the session that ran them), with BATCH_DRY=1: the commands each would run,
the set's defaults, arguments that replace them, and bad arguments refused before anything is set
up. Also: every bench/gpu script the docs name exists."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
GPU = ROOT / "bench" / "gpu"
POOL = "--pool-size 8 --pool-preload torch"


def dry(tmp_path: Path, script: str, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    e = {**os.environ, "OUT": str(tmp_path / "out"), "BATCH_DRY": "1", **env}
    return subprocess.run(
        ["bash", str(GPU / script), *args], capture_output=True, text=True, timeout=60, env=e
    )


def steps(p: subprocess.CompletedProcess[str]) -> list[str]:
    """The `== NAME (limit Ns): CMD` lines a run printed, as `NAME Ns: CMD`."""
    assert p.returncode == 0, p.stdout + p.stderr
    return [
        f"{m[1]} {m[2]}s: {m[3]}" for m in re.finditer(r"^== (\S+) \(limit (\d+)s\): (.*)$", p.stdout, re.M)
    ]


def test_each_set_runs_its_variants_and_arguments_replace_them(tmp_path: Path) -> None:
    res = "/tmp/res-kernelbench-jobs"
    kb = "python3 -m bench.jobs --kernelbench .suites/KernelBench"
    assert steps(dry(tmp_path, "kernelbench_jobs.sh", "tiny")) == [
        f"jobs 170s: {kb} --set tiny --device gpu --variants region shared --out {res}-tiny/jobs.json "
        "--triton 4 --alone-rounds 1"
    ]
    assert steps(dry(tmp_path, "kernelbench_jobs.sh", "large")) == [
        f"jobs 570s: {kb} --set large --device gpu --variants region-pool:{POOL} "
        f"region-pool-nostarve:{POOL} --exit-starve 600 shared --budget-s 540 "
        f"--out {res}-large/jobs.json --alone-rounds 1"
    ]
    given = dry(tmp_path, "kernelbench_jobs.sh", "default", "region", "command", JOBS_BUDGET="90", TAG="x")
    assert steps(given) == [
        f"jobs 430s: {kb} --set default --device gpu --variants region command --budget-s 90 "
        f"--out {res}-default-x/jobs.json"
    ]


def test_the_checks_and_waits_run_the_steps_asked_in_order(tmp_path: Path) -> None:
    locks = steps(dry(tmp_path, "lock_checks.sh"))
    assert [s.split(":")[0] for s in locks] == ["lock 150s", "lockstates 115s", "pool 100s"]
    assert "check_pool_adopt --jobs 8 --deadline 90 --out /tmp/res-lock-checks/" in locks[2]
    assert [s.split(":")[0] for s in steps(dry(tmp_path, "lock_checks.sh", "pool", "lock"))] == [
        "pool 100s",
        "lock 150s",
    ]
    waits = steps(dry(tmp_path, "region_waits.sh", BARS="250 60 30"))
    assert [s.split(":")[0] for s in waits] == [
        "idle-window-250 110s",
        "idle-window-60 110s",
        "idle-window-30 110s",
        "exit 100s",
    ]
    assert "check_idle_window --bar-us 60 --out /tmp/res-region-waits/bar60" in waits[1]
    atrex = steps(dry(tmp_path, "atrex_gateway.sh", "--only", "profile-deep", ATREX_TIMEOUT="200"))
    assert atrex == [
        "atrex 200s: python3 -m bench.gateway_profile_check --atrex-bench-root .suites/atrex-bench "
        "--out /tmp/res-atrex-gateway --only profile-deep"
    ]
    replay = steps(dry(tmp_path, "replay.sh"))
    assert replay[0].startswith(
        "replay 560s: python3 -m bench.replay --profile gpu-10min --seed 2 --pace trace"
    )
    assert "--seed 1 " in steps(dry(tmp_path, "replay.sh", "quick", "1"))[0]


@pytest.mark.parametrize(
    "script,args",
    [
        ("kernelbench_jobs.sh", ()),
        ("kernelbench_jobs.sh", ("huge",)),
        ("lock_checks.sh", ("lock", "bogus")),
        ("region_waits.sh", ("drain",)),
        ("replay.sh", ("gpu-10min", "two")),
    ],
)
def test_a_bad_argument_is_refused_before_the_set_up(
    tmp_path: Path, script: str, args: tuple[str, ...]
) -> None:
    p = dry(tmp_path, script, *args)
    assert p.returncode == 2 and p.stdout.startswith("usage: bash bench/gpu/"), p.stdout
    assert not (tmp_path / "out").exists()  # nothing was set up


def test_every_script_the_docs_name_exists() -> None:
    docs = [ROOT / "bench" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    named = {m for d in docs for m in re.findall(r"bench/gpu/([a-z_0-9]+\.sh)", d.read_text())}
    assert named and {n for n in named if not (GPU / n).exists()} == set()


def test_the_torchstate_check_compares_rng_states_and_says_where_it_cannot_run() -> None:
    """bench.gpu.check_torchstate: states compare element-wise (tensors, lists of them); without
    torch or a CUDA device it says so and exits 2, not a failure of the check."""
    import sys

    from bench.gpu import check_torchstate as ct

    class T:  # a tensor's face: shape, element-wise ==, all()
        def __init__(self, *v: int) -> None:
            self.v, self.shape = v, (len(v),)

        def __eq__(self, o: object) -> Any:
            return T(*(int(a == b) for a, b in zip(self.v, o.v)))  # type: ignore[attr-defined]

        def all(self) -> bool:
            return all(self.v)

    assert ct.same([T(1, 2), T(3)], [T(1, 2), T(3)]) and not ct.same([T(1, 2)], [T(1, 5)])
    assert ct.same("highest", "highest") and not ct.same(True, False) and not ct.same([T(1)], [])
    try:
        import torch

        if torch.cuda.is_available():
            pytest.skip("this machine has torch and a GPU: the check would run for real")
    except ImportError:
        pass
    p = subprocess.run(
        [sys.executable, "-m", "bench.gpu.check_torchstate"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert p.returncode == 2 and "check_torchstate:" in p.stderr, (p.returncode, p.stderr)
    bad = subprocess.run(
        [sys.executable, "-m", "bench.gpu.check_torchstate", "--rounds", "3"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert bad.returncode == 2 and "unrecognized arguments: --rounds 3" in bad.stderr, bad.stderr
