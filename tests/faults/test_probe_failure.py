"""A probe backend that fails at runtime: the daemon goes on without it, and says so.

The failure is real and comes from outside the daemon: while it runs the tracefs backend, the test
turns the backend's sys_enter_ioctl event off in the daemon's own tracefs instance
(instances/krex-<pid>), as an `echo 0 > .../enable` or `trace-cmd reset` by someone else would.
The instance itself cannot be removed from outside while the daemon holds its trace_pipe (EBUSY).
The bcc backend has no such outside lever (its programs are attached through perf-event fds only
the daemon holds); its poll-thread failure is shown in-process in tests/probes/test_failure.py,
and reaches the same Attributor.probe_failed.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import time
from collections.abc import Iterator

import pytest

from krex_async.protocol import TraceEvent

from ..conftest import PY, py_env, run_daemon, thread_names

OWNER = """
import os, sys, time
from krex_async import region
inside, go = sys.argv[1], sys.argv[2]
with region("during") as r:       # held while the probes fail
    open(inside, "w").close()
    while not os.path.exists(go):
        time.sleep(0.02)
with region("after"):             # granted after they failed
    pass
"""

CLEAN = "from krex_async import region\nwith region('before'):\n    pass\n"


@pytest.fixture
def prefix() -> Iterator[str]:
    """A private device node under a unique prefix, so only the test's processes match."""
    if os.geteuid() != 0:
        pytest.skip("needs root (tracefs instances, mknod)")
    from krex_async.probes import tracefs_works

    ok, why = tracefs_works()
    if not ok:
        pytest.skip(f"tracefs backend unavailable: {why}")
    d = tempfile.mkdtemp(prefix="krexpf-", dir="/tmp")
    os.mknod(f"{d}/gpu0", 0o20666, os.makedev(1, 3))
    yield d + "/"
    shutil.rmtree(d, ignore_errors=True)


def fd_targets(pid: int) -> list[str]:
    out = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            out.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            pass
    return out


async def wait_until(pred, timeout: float = 10.0) -> bool:  # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if await pred():
            return True
        await asyncio.sleep(0.05)
    return bool(await pred())


async def test_tracefs_backend_disabled_from_outside(prefix, script, tmp_path):
    inside, go = tmp_path / "inside", tmp_path / "go"
    owner, clean = script("owner.py", OWNER), script("clean.py", CLEAN)
    async with run_daemon("--probes", "tracefs", "--probe-prefixes", prefix) as d:
        pid = d.proc.pid
        instance = f"/sys/kernel/tracing/instances/krex-{pid}"
        async with await d.client() as c, await d.client() as watcher:
            st = (await c.status())["probes"]
            assert st["state"] == "running" and st["backend"] == "tracefs", st
            assert os.path.isdir(instance)
            assert any(t.endswith("trace_pipe") for t in fd_targets(pid))

            async def reader_named() -> bool:  # the thread names itself once it runs
                return "krex-probe-tfs" in thread_names(pid)

            assert await wait_until(reader_named, 5), thread_names(pid)

            # Control: with the probes healthy, a region is reported clean.
            res0 = await c.run([PY, clean], env=py_env())
            assert res0.returncode == 0, res0.stderr
            assert not res0.report.regions[0].tainted, res0.report.regions[0]

            seen: list[TraceEvent] = []

            async def collect() -> None:
                async for ev in watcher.trace():
                    seen.append(ev)

            tracer = asyncio.create_task(collect())
            await asyncio.sleep(0.2)  # subscribed

            h = await c.submit([PY, owner, str(inside), str(go)], env=py_env())
            end = time.monotonic() + 20
            while not inside.exists():
                assert time.monotonic() < end, "the owner never entered its region"
                await asyncio.sleep(0.02)

            # The failure, from outside the daemon.
            with open(f"{instance}/events/syscalls/sys_enter_ioctl/enable", "w") as f:
                f.write("0")

            async def failed() -> bool:
                return bool((await c.status())["probes"]["state"] == "failed")

            assert await wait_until(failed), (await c.status())["probes"]
            st = (await c.status())["probes"]
            assert "turned off from outside" in st["reason"], st

            go.touch()
            res = await h.wait()
            assert res.returncode == 0, res.stderr
            during, after = res.report.regions
            assert during.tainted, during  # held while the probes failed
            assert after.tainted, after  # granted after: nothing watched it

            # The daemon goes on serving.
            res2 = await c.run([PY, "-c", "print('still here')"], env=py_env())
            assert res2.returncode == 0 and res2.stdout == b"still here\n"

            async def told() -> bool:
                return any(e.kind == "probes_failed" for e in seen)

            assert await wait_until(told, 5), [e.kind for e in seen]
            tracer.cancel()
            ev = next(e for e in seen if e.kind == "probes_failed")
            assert ev.detail["backend"] == "tracefs"
            assert "turned off from outside" in str(ev.detail["reason"])

            # Nothing left behind: no trace_pipe fd, no reader thread, no instance.
            assert not any(t.endswith("trace_pipe") for t in fd_targets(pid)), fd_targets(pid)
            assert "krex-probe-tfs" not in thread_names(pid), thread_names(pid)
            assert not os.path.exists(instance)
        # One clear error line, not one per poll or per region.
        errors = [line for line in d.logs().splitlines() if "probes_failed" in line]
        assert len(errors) == 1, errors
        assert '"error"' in errors[0] and "turned off from outside" in errors[0], errors[0]
