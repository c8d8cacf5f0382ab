"""Freeze, thaw and set_cores latency of the cgroup backend with N sibling commands.

    sudo python -m bench.cgroup_freeze [--reps 50] [--siblings 1,4,16,64]

Each sibling is a `sleep` in its own command cgroup under a private root (krex-bench-<id>/ below
the mount root, with the v1 cpuset twin on hybrid hosts), removed afterwards. One "enter" is what a
region entry costs the backend: freeze every sibling (concurrently, as the daemon does) and fence
every sibling off the region core; "exit" thaws and restores. Times are wall-clock milliseconds.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import tempfile
import time
import uuid
from typing import Any

from bench.harness.output import module_prog
from bench.harness.stats import quantile
from krex_async.isolation.cgroup import CgroupBackend
from krex_async.isolation.cgroupfs import CgroupFS, cgroup_mounts
from krex_async.isolation.intent import sweep


def _private_root() -> tuple[str, str | None]:
    v2_mount, v1_mount = cgroup_mounts()
    if v2_mount is None:
        raise SystemExit("no cgroup2 mount")
    name = f"krex-bench-{uuid.uuid4().hex[:6]}"
    v2 = os.path.join(v2_mount, name)  # below the mount root: our own cgroup may hold processes
    os.mkdir(v2)
    parent = CgroupFS(os.path.dirname(v2))
    if "cpuset" in parent.read("", "cgroup.subtree_control").split():
        CgroupFS(v2).write("", "cgroup.subtree_control", "+cpuset")
    v1 = None
    if v1_mount and "cpuset" not in parent.read("", "cgroup.controllers").split():
        v1 = os.path.join(v1_mount, name)
        os.mkdir(v1)
        for f in ("cpuset.cpus", "cpuset.mems"):
            CgroupFS(v1).write("", f, CgroupFS(os.path.dirname(v1)).read("", f).strip())
    return v2, v1


def _pct(xs: list[float], q: float) -> float:
    return quantile(xs, q, "round") * 1e3


async def measure(n_siblings: int, reps: int) -> dict[str, float]:
    """p50/p99 in ms of freeze, thaw, set_cores (fence + restore) and enter for `n_siblings`."""
    v2, v1 = _private_root()
    b = CgroupBackend(root=v2, state_dir=tempfile.mkdtemp(prefix="krex-bench-"), cpuset_root=v1)
    procs: list[subprocess.Popen[bytes]] = []
    groups: list[Any] = []  # CgroupBackend's own groups
    try:
        for i in range(n_siblings):
            g = await b.create(f"s{i}")
            p = subprocess.Popen(b.launch_argv(g, ["sleep", "3600"], frozen=False))
            await b.started(g, p.pid)
            procs.append(p)
            groups.append(g)
        deadline = time.monotonic() + 10
        while any(not b.pids(g) for g in groups) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        cpus = sorted(b.cpus)
        rest = frozenset(cpus[1:]) if len(cpus) > 1 else None
        t: dict[str, list[float]] = {"freeze": [], "thaw": [], "set_cores": [], "restore": [], "enter": []}
        for _ in range(reps):
            t0 = time.perf_counter()
            await b.freeze_many(groups)  # as the daemon freezes a region's siblings
            t1 = time.perf_counter()
            if rest is not None:
                await asyncio.gather(*(b.set_cores(g, rest) for g in groups))
            t2 = time.perf_counter()
            await asyncio.gather(*(b.thaw(g) for g in groups))
            t3 = time.perf_counter()
            if rest is not None:
                await asyncio.gather(*(b.set_cores(g, None) for g in groups))
            t4 = time.perf_counter()
            t["freeze"].append(t1 - t0)
            t["set_cores"].append(t2 - t1)
            t["enter"].append(t2 - t0)
            t["thaw"].append(t3 - t2)
            t["restore"].append(t4 - t3)
        out = {"siblings": float(n_siblings), "reps": float(reps)}
        for k, xs in t.items():
            out[f"{k}_p50_ms"], out[f"{k}_p99_ms"] = _pct(xs, 0.5), _pct(xs, 0.99)
        out["freeze_mean_ms"] = statistics.fmean(t["freeze"]) * 1e3
        return out
    finally:
        for g in groups:
            await b.kill(g)
        for p in procs:
            p.wait()
        for g in groups:
            await b.remove(g)
        await b.close()
        sweep(b.v2, b.v1, b.cores.mode, None)
        for root, fs in ((v2, b.v2), (v1, b.v1)):
            if root and fs:
                for rel in reversed(fs.walk("")):
                    os.rmdir(fs.path(rel))


def main() -> None:
    ap = argparse.ArgumentParser(
        prog=module_prog(__spec__),
    )
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--siblings", default="1,4,16,64")
    a = ap.parse_args()
    cols = ["freeze", "set_cores", "enter", "thaw", "restore"]
    print(f"{'siblings':>8} " + " ".join(f"{c + ' p50/p99 ms':>24}" for c in cols))
    for n in (int(x) for x in a.siblings.split(",")):
        r = asyncio.run(measure(n, a.reps))
        print(
            f"{n:>8} " + " ".join(f"{r[c + '_p50_ms']:>11.3f} /{r[c + '_p99_ms']:>10.3f}" for c in cols),
            flush=True,
        )


if __name__ == "__main__":
    main()
