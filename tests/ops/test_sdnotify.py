"""sd_notify over a real datagram socket (path and abstract), the watchdog's pace, and the daemon."""

from __future__ import annotations

import asyncio
import inspect
import os
import socket
import time

import pytest

from krex_async.linux import sdnotify

from ..conftest import run_daemon


def listener(addr: str | bytes) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(addr)
    s.settimeout(5)
    return s


def test_notify_to_a_path(tmp_path):
    path = str(tmp_path / "notify")
    with listener(path) as s:
        assert sdnotify.notify("READY=1\nSTATUS=serving", {"NOTIFY_SOCKET": path})
        assert s.recv(4096) == b"READY=1\nSTATUS=serving"


def test_notify_to_an_abstract_socket():
    name = f"krex-test-{os.getpid()}-{time.monotonic_ns()}"
    with listener(b"\0" + name.encode()) as s:
        assert sdnotify.notify("WATCHDOG=1", {"NOTIFY_SOCKET": "@" + name})
        assert s.recv(4096) == b"WATCHDOG=1"


def test_notify_without_or_with_a_dead_socket_is_a_noop(tmp_path):
    assert sdnotify.notify("READY=1", {}) is False
    assert sdnotify.notify("READY=1", {"NOTIFY_SOCKET": str(tmp_path / "gone")}) is False
    assert sdnotify.notify("READY=1", {"NOTIFY_SOCKET": "vsock:2:1234"}) is False


def test_watchdog_interval_rules():
    pid = str(os.getpid())
    assert sdnotify.watchdog_interval({"WATCHDOG_USEC": "4000000"}) == 2.0
    assert sdnotify.watchdog_interval({"WATCHDOG_USEC": "4000000", "WATCHDOG_PID": pid}) == 2.0
    assert sdnotify.watchdog_interval({"WATCHDOG_USEC": "4000000", "WATCHDOG_PID": "1"}) is None
    assert sdnotify.watchdog_interval({"WATCHDOG_USEC": "x"}) is None
    assert sdnotify.watchdog_interval({}) is None


async def test_watchdog_pings_at_half_the_period(tmp_path):
    path = str(tmp_path / "notify")
    with listener(path) as s:
        s.setblocking(False)
        env = {"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "100000"}  # 0.1 s: a ping every 0.05 s
        task = asyncio.get_running_loop().create_task(sdnotify.watchdog_loop(env))
        await asyncio.sleep(0.32)
        task.cancel()
        pings = []
        while True:
            try:
                pings.append(s.recv(64))
            except BlockingIOError:
                break
    assert set(pings) == {b"WATCHDOG=1"}
    assert 5 <= len(pings) <= 8, len(pings)
    await asyncio.wait_for(sdnotify.watchdog_loop({}), 1)  # no watchdog: returns at once


async def test_daemon_sends_ready_and_watchdog(tmp_path):
    from krex_async.daemon import server

    if "sdnotify" not in inspect.getsource(server):
        pytest.skip("wired by lead: server.py does not call sdnotify yet")
    path = str(tmp_path / "notify")
    with listener(path) as s:
        env = {"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "200000"}
        async with run_daemon(env=env) as d:
            got = []
            deadline = time.monotonic() + 10
            while not (any(b"READY=1" in m for m in got) and sum(m == b"WATCHDOG=1" for m in got) >= 2):
                assert time.monotonic() < deadline, got
                got.append(await asyncio.get_running_loop().run_in_executor(None, s.recv, 4096))
            ready = next(m for m in got if b"READY=1" in m)
            assert os.path.exists(d.socket)  # READY only once the socket exists
            assert d.socket.encode() in ready or b"STATUS=" not in ready
