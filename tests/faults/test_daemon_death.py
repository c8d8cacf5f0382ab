"""SIGKILL of the daemon in the middle of a region, on both backends: nothing stays stopped (signal)
or frozen (cgroup: the watchdog thaws) after 1 s, a new daemon starts on the same socket path (the
dead one's file is stale), and on the same state dir it ends the dead daemon's commands (their
reports: tests/faults/test_lost_commands.py)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time

import pytest

from krex_async import Client

from ..conftest import PY, private_cgroup_root, proc_state, py_env, remove_cgroup_tree, run_daemon, v2_mount

OWNER = """
import time
from krex_async import region
with region("hold"):
    print("inside", flush=True)
    time.sleep(60)
"""
SIBLING = ["/bin/sh", "-c", "while :; do sleep 0.05; done"]


def tree(pid: int) -> list[int]:
    """pid and its descendants, from /proc."""
    kids: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    data = f.read()
            except OSError:
                continue
            ppid = int(data[data.rindex(b")") + 2 :].split()[1])
            kids.setdefault(ppid, []).append(int(name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p, []))
    return out


def cgroup_frozen(pid: int) -> bool | None:
    """Whether `pid`'s v2 cgroup reads `frozen 1` (None: the process or its cgroup is gone)."""
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            rel = next(line.split(":", 2)[2].strip() for line in f if line.startswith("0::"))
        with open(f"{v2_mount()}{rel}/cgroup.events") as f:
            return "frozen 1" in f.read()
    except (OSError, StopIteration):
        return None


@pytest.mark.parametrize("isolation", ["signal", "cgroup"])
async def test_daemon_sigkill_mid_region_leaves_nothing_stopped_and_a_new_daemon_starts(script, isolation):
    cg = None
    backend = ["--isolation", isolation]
    if isolation == "cgroup":
        cg = private_cgroup_root()
        if cg is None:
            pytest.skip("the cgroup backend needs root and a cgroup v2 mount")
        backend += ["--cgroup-root", cg]
    held = (
        (lambda p: proc_state(p) in ("T", "t"))
        if isolation == "signal"
        else (lambda p: bool(cgroup_frozen(p)))
    )
    owner = script("owner.py", OWNER)
    try:
        await _sigkill_mid_region(owner, backend, held)
    finally:
        if cg is not None:
            remove_cgroup_tree(cg)


async def _sigkill_mid_region(owner: str, backend: list[str], held) -> None:  # type: ignore[no-untyped-def]
    async with run_daemon(*backend, "--region-timeout", "120") as d:
        c = await d.client()
        await c.submit(SIBLING, on_disconnect="keep")
        own = await c.submit([PY, owner], env=py_env(), on_disconnect="keep")
        async for _, data in own.output():
            assert b"inside" in data
            break
        sib_pid = (await c.status())["commands"][0]["pid"]
        victims = tree(sib_pid)
        assert all(held(p) for p in victims), victims
        d.proc.kill()  # SIGKILL: no shutdown path runs
        d.proc.wait()
        t0 = time.monotonic()
        try:
            while any(held(p) for p in victims):
                assert time.monotonic() - t0 < 1.0, {p: proc_state(p) for p in victims}
                await asyncio.sleep(0.01)
            # The path still holds the dead daemon's socket file: a new daemon takes it over.
            assert os.path.exists(d.socket)
            log = open(d.log, "ab")
            state = os.path.join(os.path.dirname(d.socket), "state")  # run_daemon's
            new = subprocess.Popen(
                [
                    PY,
                    "-m",
                    "krex_async",
                    "serve",
                    "--socket",
                    d.socket,
                    *backend,
                    "--log-format",
                    "json",
                    "--state-dir",
                    state,
                    "--probes",
                    "off",
                ],
                env=py_env(),
                stdout=log,
                stderr=subprocess.STDOUT,
            )
            d.proc = new  # run_daemon stops it at the end
            for _ in range(200):
                with contextlib.suppress(Exception):
                    async with await Client.connect(d.socket, timeout=1) as c2:
                        res = await c2.run(["echo", "reborn"])
                        assert res.stdout == b"reborn\n"
                        break
                assert new.poll() is None, d.logs()
                await asyncio.sleep(0.05)
            else:
                raise AssertionError("the new daemon did not serve: " + d.logs())
            orphans = [p for p in victims + tree(own.pid or 0) if p > 1]
            t1 = time.monotonic()
            while any(proc_state(p) not in (None, "Z") for p in orphans):
                assert time.monotonic() - t1 < 5, {p: proc_state(p) for p in orphans}
                await asyncio.sleep(0.02)
        finally:
            await c.close()
            for p in tree(sib_pid) + tree(own.pid or 0):  # should the new daemon have failed
                with contextlib.suppress(ProcessLookupError):
                    if p > 1:
                        os.kill(p, signal.SIGKILL)
