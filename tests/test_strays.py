"""Probe events through a real daemon: strays during a region are attributed and reported.

The "GPU" here is a private character device node (like /dev/null) under a unique prefix that the
daemon is told to watch (`--probe-prefixes`): its ioctls are real syscalls the eBPF program sees.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from krex_async import Client

from .conftest import PY, py_env, run_daemon
from .devices.test_admission import eventually

IOCTLS = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR)
for _ in range(int(sys.argv[2])):
    try:
        fcntl.ioctl(fd, 0x5401, bytes(64))
    except OSError:
        pass
print(os.getpid(), flush=True)
if len(sys.argv) > 3:  # linger, so that the daemon can read who it was (or freeze it)
    import time
    try:
        time.sleep(float(sys.argv[3]))
    except ValueError:  # until a file exists
        while not os.path.exists(sys.argv[3]):
            time.sleep(0.01)
"""


async def entered(marker: Path) -> None:
    """Until the owner has written `marker` inside its region."""
    deadline = time.monotonic() + 20
    while not marker.exists():
        assert time.monotonic() < deadline, "the owner never entered its region"
        await asyncio.sleep(0.02)


async def frozen(c: Client, command: str) -> bool:
    return any(x["command"] == command and x["frozen"] for x in (await c.status())["commands"])


@pytest.fixture
def device() -> str:
    if os.geteuid() != 0:
        pytest.skip("needs root (eBPF, mknod)")
    from krex_async.probes import bcc_works

    ok, why = bcc_works()
    if not ok:
        pytest.skip(f"bcc unavailable: {why} (run .ci/install-bcc.sh)")
    d = tempfile.mkdtemp(prefix="krexgpu-", dir="/tmp")
    os.mknod(f"{d}/gpu0", 0o20666, os.makedev(1, 3))
    yield f"{d}/gpu0"
    shutil.rmtree(d, ignore_errors=True)


async def test_strays_during_a_region_are_reported_with_their_pids(device, script, tmp_path):
    """The owner holds its region until the test has seen both strays' effects (no fixed span: a
    1.5 s region once ended first on a loaded machine)."""
    marker, release = tmp_path / "inside", tmp_path / "release"
    ioctls = script("io.py", IOCTLS)
    owner = script(
        "owner.py",
        f"""
        import fcntl, os, time
        from krex_async import region
        fd = os.open({device!r}, os.O_RDWR)
        with region("timing") as r:
            for _ in range(20):  # the owner's own driver calls are never strays
                try:
                    fcntl.ioctl(fd, 0x5401, bytes(64))
                except OSError:
                    pass
            open({str(marker)!r}, "w").close()
            end = time.monotonic() + 60
            while not os.path.exists({str(release)!r}) and time.monotonic() < end:
                time.sleep(0.01)
        print(os.getpid())
    """,
    )
    prefix = os.path.dirname(device) + "/"
    async with run_daemon("--probes", "ioctl", "--probe-prefixes", prefix, "--freeze", "device-holders") as d:
        async with await d.client() as c:
            h = await c.submit([PY, owner], env=py_env())
            await entered(marker)
            # A process outside krex touches the device during the region.
            outside = await asyncio.to_thread(
                subprocess.run, [PY, ioctls, device, "7", "0.5"], capture_output=True, text=True, timeout=30
            )
            outside_pid = int(outside.stdout)
            # A sibling command that opened nothing when the region began (device-holders: it
            # was not frozen) opens the device now: a stray, and it is frozen at once. It lingers
            # until the release (one that exits at once may be gone before its freeze comes).
            sib = await c.submit([PY, ioctls, device, "3", str(release)], env=py_env())
            await eventually(
                lambda: frozen(c, sib.command), bool, "the sibling that opened the device is frozen"
            )
            release.touch()
            res = await h.wait()
            sib_res = await sib.wait()
    assert res.returncode == 0, res.stderr
    owner_pid = int(res.stdout)
    rep = res.report.regions[0]
    assert outside_pid in rep.stray_pids, rep
    assert int(sib_res.stdout) in rep.stray_pids, rep
    assert sib.command in rep.frozen, "the sibling that opened the device was not frozen"
    assert owner_pid not in rep.stray_pids
    assert rep.strays >= 7 + 1, rep
    assert rep.first_strays and f"pid {outside_pid}" in " ".join(rep.first_strays)
    # Who each stray was: the outside process (it lingers) by its parent, cgroup and command
    # line; the sibling likewise, or "gone" if it exited before its events were read.
    sib_pid = int(sib_res.stdout)
    assert set(rep.stray_procs) == {outside_pid, sib_pid}, rep.stray_procs
    who = rep.stray_procs[outside_pid]
    assert f"{ioctls} {device} 7" in who and f"ppid {os.getpid()}" in who and "cgroup /" in who, who
    sib_who = rep.stray_procs[sib_pid]
    assert sib_who == "gone" or f"cmd-{sib.command}" in sib_who, sib_who
    assert not rep.tainted


async def test_no_strays_when_only_the_owner_touches_the_device(device, script):
    owner = script(
        "owner.py",
        f"""
        import fcntl, os
        from krex_async import region
        fd = os.open({device!r}, os.O_RDWR)
        with region("timing"):
            for _ in range(50):
                try:
                    fcntl.ioctl(fd, 0x5401, bytes(64))
                except OSError:
                    pass
    """,
    )
    prefix = os.path.dirname(device) + "/"
    async with run_daemon("--probes", "ioctl", "--probe-prefixes", prefix) as d:
        async with await d.client() as c:
            res = await c.run([PY, owner], env=py_env())
    rep = res.report.regions[0]
    assert res.returncode == 0 and rep.strays == 0 and rep.stray_pids == [], rep


async def test_a_sibling_opening_the_device_repeatedly_is_frozen_once(device, script, tmp_path):
    """Several opens of one sibling in a burst (a CUDA initialisation opens a handful of device
    files) freeze its command once: it is named once in the region's frozen list."""
    marker = tmp_path / "inside"
    owner = script(
        "owner.py",
        f"""
        import time
        from krex_async import region
        with region("timing"):
            open({str(marker)!r}, "w").close()
            time.sleep(1.0)
    """,
    )
    burst = f"for i in 1 2 3 4 5 6 7 8; do exec 3<{device}; exec 3<&-; done; sleep 2"
    prefix = os.path.dirname(device) + "/"
    async with run_daemon("--probes", "ioctl", "--probe-prefixes", prefix, "--freeze", "device-holders") as d:
        async with await d.client() as c:
            h = await c.submit([PY, owner], env=py_env())
            await entered(marker)
            sib = await c.submit(["/bin/sh", "-c", burst], env=py_env())
            res = await h.wait()
            await sib.cancel(9)
    rep = res.report.regions[0]
    assert rep.frozen == [sib.command], rep.frozen


# Imported by each warm pool worker (--pool-init): a thread that makes driver calls on the "GPU".
TICKER = """
import fcntl, os, threading, time
_fd = os.open({device!r}, os.O_RDWR)
def _tick():
    while True:
        try:
            fcntl.ioctl(_fd, 0x5401, bytes(64))
        except OSError:
            pass
        time.sleep(0.005)
threading.Thread(target=_tick, daemon=True).start()
"""

OWNER_JSON = """
import sys, time, msgspec
from krex_async import region
with region("timing") as r:
    time.sleep(0.5)
sys.stdout.write(msgspec.json.encode(r.report).decode())
"""


async def test_an_idle_pool_workers_driver_calls_are_not_strays_on_another_device(device, script, tmp_path):
    """A warm pool worker in no command is no command's, but it is on its pool's device: its
    driver calls during a region on another device are not that region's strays (they were,
    as any process outside krex: a worker creating its context on one GPU tainted the regions
    on the others)."""
    import json

    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "krex_ticker.py").write_text(TICKER.format(device=device))
    env = py_env()
    env["PYTHONPATH"] = f"{env['PYTHONPATH']}{os.pathsep}{mods}"
    prefix = os.path.dirname(device) + "/"
    args = ("--devices", "cpu:2", "--probes", "ioctl", "--probe-prefixes", prefix, "--hold", "freeze")
    pool = ("--pool-size", "1", "--pool-preload", "colorsys", "--pool-init", "krex_ticker")
    async with run_daemon(*args, *pool, env=env) as d:
        async with await d.client() as c:
            # a command on cpu1 that starts no Python: cpu1's pool warms a worker it leaves idle
            sleeper = await c.submit(["/bin/sleep", "30"], device="cpu1", env=env)
            deadline = time.monotonic() + 30
            idle: list[int] = []
            while not idle:
                workers = (await c.status())["pools"]["cpu1"]["workers"]
                idle = [w["pid"] for w in workers if w["state"] == "warm"]
                assert time.monotonic() < deadline, f"cpu1's worker did not warm: {workers}"
                await asyncio.sleep(0.05)
            res = await c.run([PY, script("owner.py", OWNER_JSON)], device="cpu0", env=env)
            await sleeper.cancel(9)
    assert res.returncode == 0, res.stderr
    rep = json.loads(res.stdout)
    assert idle[0] not in rep.get("stray_pids", []), rep
    assert not rep.get("tainted"), rep
