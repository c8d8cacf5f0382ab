"""Regions on real processes: exclusivity, overlap outside regions, FIFO, per-device parallelism,
expiry, crash inside a region, commands landing frozen."""

from __future__ import annotations

import asyncio
import json
import os
import time

import pytest

from krex_async import Client

from .conftest import PY, py_env, run_daemon

# A sibling that appends time.monotonic() every millisecond until killed.
TICKER = """
import sys, time
with open(sys.argv[1], "a", buffering=1) as f:
    while True:
        f.write(f"{time.monotonic()}\\n")
        time.sleep(0.001)
"""

# An owner that waits, takes a region, spins inside it for a while, and prints its entry and exit.
OWNER = """
import json, os, sys, time
from krex_async import region
time.sleep(float(sys.argv[1]))
with region("timing") as r:
    t0 = time.monotonic()
    aff = sorted(os.sched_getaffinity(0))
    end = t0 + float(sys.argv[2])
    while time.monotonic() < end:
        pass
    t1 = time.monotonic()
print(json.dumps({"t0": t0, "t1": t1, "enter_s": r.report.enter_s, "frozen": r.report.frozen,
                  "cores": r.report.cores, "outcome": r.report.outcome,
                  "affinity_in": aff}))
"""


async def held(c: Client, timeout: float = 30.0) -> None:
    """Until a region is held on the (first) device: a loaded machine may take long to get there."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        region = (await c.status())["devices"][0]["region"]
        if region is not None and region["state"] == "held":
            return
        await asyncio.sleep(0.02)
    raise AssertionError("no region was held in time")


def ticks(path: str) -> list[float]:
    with open(path) as f:
        return [float(x) for x in f.read().split()]


async def start_ticker(c: Client, script, tmp_path, name: str = "ticks", device: str = "auto"):
    out = str(tmp_path / name)
    h = await c.submit([PY, script("ticker.py", TICKER), out], env=py_env(), device=device)
    deadline = time.monotonic() + 10
    while not (os.path.exists(out) and os.path.getsize(out) > 0):
        assert time.monotonic() < deadline, "ticker did not start"
        await asyncio.sleep(0.01)
    return h, out


@pytest.mark.parametrize("policy", ["region", "shared"])
async def test_sibling_makes_no_progress_during_region(policy, script, tmp_path):
    async with run_daemon("--policy", policy) as d:
        async with await d.client() as c:
            ticker, out = await start_ticker(c, script, tmp_path)
            res = await c.run([PY, script("owner.py", OWNER), "0.2", "0.3"], env=py_env())
            assert res.returncode == 0, res.stderr
            info = json.loads(res.stdout)
            await ticker.cancel(9)
            await ticker.wait()
        inside = [t for t in ticks(out) if info["t0"] < t < info["t1"]]
        if policy == "region":
            assert inside == [], f"{len(inside)} ticks inside the region"
            assert info["frozen"], "the report names no frozen command"
            assert info["outcome"] == "released"
        else:
            assert len(inside) > 50, "the shared policy must leave the sibling running"
            assert info["frozen"] == []


async def test_commands_overlap_outside_regions(script):
    async with run_daemon() as d:
        async with await d.client() as c:
            t0 = time.monotonic()
            results = await asyncio.gather(*(c.run(["sleep", "0.6"]) for _ in range(4)))
            elapsed = time.monotonic() - t0
    assert all(r.returncode == 0 for r in results)
    assert elapsed < 1.5, f"4 x 0.6 s commands took {elapsed:.2f} s: they did not overlap"


async def test_fifo_order_of_regions(script):
    # With device-holders freezing, CPU-only siblings keep running and queue their requests in order.
    async with run_daemon("--freeze", "device-holders") as d:
        async with await d.client() as c:
            owner = script("owner.py", OWNER)
            hs = []
            for i, delay in enumerate(["0.0", "0.5", "0.8", "1.1"]):
                hs.append(await c.submit([PY, owner, delay, "0.6" if i == 0 else "0.05"], env=py_env()))
            results = [await h.wait() for h in hs]
    infos = [json.loads(r.stdout) for r in results]
    starts = [i["t0"] for i in infos]
    assert starts == sorted(starts), "regions were not granted in request order"
    for a, b in zip(infos, infos[1:]):
        assert b["t0"] >= a["t1"], "regions on one device overlapped"


async def test_regions_on_different_devices_run_in_parallel(script):
    async with run_daemon("--devices", "cpu:2") as d:
        async with await d.client() as c:
            owner = script("owner.py", OWNER)
            a, b = await asyncio.gather(
                c.run([PY, owner, "0.1", "0.5"], env=py_env(), device="0"),
                c.run([PY, owner, "0.1", "0.5"], env=py_env(), device="1"),
            )
    ia, ib = json.loads(a.stdout), json.loads(b.stdout)
    assert a.report.device == "cpu0" and b.report.device == "cpu1"
    overlap = min(ia["t1"], ib["t1"]) - max(ia["t0"], ib["t0"])
    assert overlap > 0.3, f"regions on two devices overlapped only {overlap:.3f} s"


async def test_region_cores_fence_other_commands(script, tmp_path):
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs at least 2 cpus")
    probe = script(
        "aff.py",
        """
        import os, sys, time
        end = time.monotonic() + 1.5
        seen = set()
        while time.monotonic() < end:
            seen.add(frozenset(os.sched_getaffinity(0)))
            time.sleep(0.005)
        print(sorted(sorted(s) for s in seen))
    """,
    )
    # device-holders: the probe keeps running (it holds no GPU file) and is only fenced.
    async with run_daemon("--freeze", "device-holders", "--region-cores", "1") as d:
        async with await d.client() as c:
            h = await c.submit([PY, probe], env=py_env())
            res = await c.run([PY, script("owner.py", OWNER), "0.3", "0.5"], env=py_env())
            other = await h.wait()
    info = json.loads(res.stdout)
    assert len(info["cores"]) == 1
    assert info["affinity_in"] == info["cores"], "the owner did not run on its region cores"
    sets = eval(other.stdout)  # noqa: S307 - our own probe's output
    everything = sorted(os.sched_getaffinity(0))
    assert everything in sets, "the sibling never ran unfenced"
    fenced = [s for s in sets if s != everything]
    assert fenced and all(info["cores"][0] not in s for s in fenced), sets


async def test_region_expires_after_timeout(script):
    async with run_daemon("--region-timeout", "0.3") as d:
        async with await d.client() as c:
            src = script(
                "long.py",
                """
                import time
                from krex_async import region
                with region("long") as r:
                    time.sleep(1.0)
                print(r.report.outcome, r.expired)
            """,
            )
            res = await c.run([PY, src], env=py_env())
    assert res.stdout.split() == [b"expired", b"True"], res.stderr
    assert res.report.regions[0].outcome == "expired"
    assert b"expired" in res.stderr


async def test_crash_inside_region_releases_it(script, tmp_path):
    async with run_daemon() as d:
        async with await d.client() as c:
            ticker, out = await start_ticker(c, script, tmp_path)
            crash = script(
                "crash.py",
                """
                import os, time
                from krex_async import region
                with region("timing"):
                    time.sleep(0.2)
                    os._exit(7)
            """,
            )
            res = await c.run([PY, crash], env=py_env())
            t_end = time.monotonic()
            assert res.returncode == 7
            assert res.report.regions[0].outcome == "owner-died"
            await asyncio.sleep(0.3)
            await ticker.cancel(9)
            await ticker.wait()
    assert any(t > t_end for t in ticks(out)), "the sibling was not thawed after the crash"


async def test_command_started_during_region_lands_frozen(script, tmp_path):
    marker = tmp_path / "started"
    async with run_daemon() as d:
        async with await d.client() as c:
            owner = await c.submit([PY, script("owner.py", OWNER), "0", "1.0"], env=py_env())
            await held(c)
            late = await c.submit(["sh", "-c", f"date +%s.%N > {marker}"])
            await asyncio.sleep(0.2)
            assert not marker.exists(), "a command started during the region ran its first instruction"
            info = json.loads((await owner.wait()).stdout)
            res = await late.wait()
    assert res.returncode == 0 and marker.exists()
    assert late.command in info["frozen"]


async def test_region_outside_krex_is_a_noop_that_warns_once(script):
    import subprocess

    src = script(
        "alone.py",
        """
        from krex_async import region
        for _ in range(3):
            with region("timing") as r:
                pass
        print(r.report)
    """,
    )
    p = subprocess.run([PY, src], env=py_env(), capture_output=True, timeout=30)
    assert p.returncode == 0
    assert p.stdout.strip() == b"None"
    assert p.stderr.count(b"not running under krex") == 1


async def test_other_devices_keep_running_fenced_off_the_region_cores(script, tmp_path):
    """A region on one device never freezes commands on another; it only fences them off its
    cores (the host-side protection a multi-GPU node needs; simulated with two cpu devices)."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs at least 2 cpus")
    spinner = script(
        "spin.py",
        """
        import os, sys, time
        end = time.monotonic() + float(sys.argv[2])
        with open(sys.argv[1], "a", buffering=1) as f:
            while time.monotonic() < end:
                x = sum(i * i for i in range(20000))  # CPU-heavy, like a compile
                f.write(f"{time.monotonic()} {sorted(os.sched_getaffinity(0))}\\n")
    """,
    )
    ticks_file = tmp_path / "spin"
    async with run_daemon("--devices", "cpu:2", "--region-cores", "1") as d:
        async with await d.client() as c:
            other = await c.submit([PY, spinner, str(ticks_file), "2.5"], env=py_env(), device="1")
            res = await c.run([PY, script("owner.py", OWNER), "0.5", "0.8"], env=py_env(), device="0")
            await other.wait()
    info = json.loads(res.stdout)
    rows = [line.split(" ", 1) for line in ticks_file.read_text().splitlines()]
    during = [eval(aff) for t, aff in rows if info["t0"] < float(t) < info["t1"]]  # noqa: S307
    assert len(during) > 10, "the command on the other device did not keep running"
    assert info["frozen"] == [], "a command on another device was frozen"
    assert all(info["cores"][0] not in aff for aff in during), "it ran on the region's core"
    assert info["affinity_in"] == info["cores"]
