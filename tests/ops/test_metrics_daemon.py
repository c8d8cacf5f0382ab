"""A real daemon with `--metrics`: the endpoint serves the counters after commands with regions."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import time
import urllib.error

import pytest

from ..conftest import PY, ROOT, py_env, run_daemon
from .test_metrics import L, scrape

pytest.importorskip("prometheus_client", reason="prometheus-client not installed")

OWNER = """
import time
from krex_async import region
with region("timing") as r:
    time.sleep(0.05)
print(r.report.outcome)
"""


def _accepts_metrics_flag() -> bool:
    p = subprocess.run(
        [PY, "-m", "krex_async", "serve", "--help"],
        capture_output=True,
        text=True,
        env=py_env(),
        cwd=ROOT,
        timeout=30,
    )
    return "--metrics" in p.stdout


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _scrape_when_up(addr: tuple[str, int], timeout: float = 10):
    deadline = time.monotonic() + timeout
    while True:
        try:
            return scrape(addr)
        except (urllib.error.URLError, ConnectionError):
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)


async def test_counters_after_commands_with_regions(script):
    if not _accepts_metrics_flag():
        pytest.skip("wired by lead: `krex serve --metrics` is not accepted yet")
    addr = ("127.0.0.1", _free_port())
    async with run_daemon("--metrics", f"{addr[0]}:{addr[1]}", "--policy", "region", "--devices", "cpu") as d:
        before = await _scrape_when_up(addr)
        assert not any(k[0] == "krex_commands_ended_total" for k in before)
        owner = script("owner.py", OWNER)
        async with await d.client() as c:
            results = await asyncio.gather(
                *(c.run([PY, owner], env=py_env()) for _ in range(3)),
                c.run([PY, "-c", "print('no region')"], env=py_env()),
            )
        assert [r.returncode for r in results] == [0, 0, 0, 0]
        assert [r.stdout.strip() for r in results[:3]] == [b"released"] * 3
        # The daemon counts a command and a region before it tells their owner: no waiting here.
        got = scrape(addr)
    assert got[("krex_commands_ended_total", L(policy="region", device="cpu", state="exited"))] == 4
    assert got[("krex_commands", L(state="running", policy="region", device="cpu"))] == 0
    assert sum(v for k, v in got.items() if k[0] == "krex_commands_started_total") == 4
    assert got[("krex_command_wall_seconds_count", L(policy="region", device="cpu"))] == 4
    assert got[("krex_regions_total", L(device="cpu", outcome="released"))] == 3
    assert got[("krex_region_enter_seconds_count", L(device="cpu"))] == 3
    assert got[("krex_region_freeze_seconds_count", L(device="cpu"))] == 3
    assert got[("krex_region_hold_seconds_count", L(device="cpu"))] == 3
    # Each owner slept 0.05 s inside; the daemon's clock starts just after it sent the grant, so on
    # a loaded machine its held_s can come out a little shorter than the owner's sleep.
    assert 3 * 0.025 <= got[("krex_region_hold_seconds_sum", L(device="cpu"))] < 10
    assert got[("krex_regions_held", L(device="cpu"))] == 0
    assert sum(v for k, v in got.items() if k[0] == "krex_region_drain_total") == 3


async def test_pool_metrics_after_a_pooled_command():
    addr = ("127.0.0.1", _free_port())
    async with run_daemon(
        "--metrics", f"{addr[0]}:{addr[1]}", "--pool-size", "1", "--pool-preload", "json"
    ) as d:
        async with await d.client() as c:
            for _ in range(100):
                if (await c.status())["pools"]["cpu"]["warm"] >= 1:
                    break
                await asyncio.sleep(0.1)
            res = await c.run([PY, "-c", "print('pooled')"], env=py_env())
        assert res.report.via == "pool"
        got = await _scrape_when_up(addr)
    assert got[("krex_pool_start_seconds_count", L(device="cpu"))] == 1
    assert ("krex_pool_workers", L(device="cpu", state="busy")) in got
