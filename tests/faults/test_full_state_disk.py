"""A full state disk under the cgroup backend's intent record: a region that cannot record what it
would freeze or fence is refused with an answer, it does not leave its owner waiting."""

from __future__ import annotations

import asyncio
import os

import pytest

from krex_async.ops.statusview import render

from ..conftest import PY, py_env, run_daemon
from ..isolation.cgroup_util import need_cgroups

REGION = """
from krex_async import region
try:
    with region("full"):
        print("granted")
except Exception as e:
    print("refused", type(e).__name__, e)
"""


def fill(d: str, name: str = "filler") -> None:
    fd = os.open(os.path.join(d, name), os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError:
        pass
    finally:
        os.close(fd)


async def test_a_state_disk_filled_by_others_keeps_regions_going_on_the_reserve(small_tmpfs):
    """Something else fills the state disk: the next record write spends the reserve, the region
    is granted and status says the disk is full; with the reserve's room taken too, a region that
    cannot record its intent is refused with an answer (not left waiting); space freed, the
    reserve is made again and the disk no longer reported full."""
    need_cgroups()
    state = os.path.join(small_tmpfs, "state")
    async with run_daemon("--isolation", "cgroup", "--state-dir", state) as d:
        async with await d.client() as c:
            assert (await c.status())["state_disk_full"] is False
            sib = await c.submit([PY, "-c", "import time; time.sleep(30)"], env=py_env())
            fill(small_tmpfs)
            res = await asyncio.wait_for(c.run([PY, "-c", REGION], env=py_env()), 20)
            assert res.stdout.decode().startswith("granted"), (res.stdout, res.stderr[-2000:])
            st = await c.status()
            assert st["state_disk_full"] is True
            assert "state disk FULL" in render(st), render(st)
            fill(small_tmpfs, "filler2")  # what the reserve gave back
            res = await asyncio.wait_for(c.run([PY, "-c", REGION], env=py_env()), 20)
            out = res.stdout.decode()
            assert out.startswith("refused") and "No space left" in out, (out, res.stderr[-2000:])
            for name in ("filler", "filler2"):
                os.unlink(os.path.join(small_tmpfs, name))
            assert (await c.status())["state_disk_full"] is False
            assert os.path.getsize(os.path.join(state, "space.reserve")) > 0
            await c.cancel(sib.command)
        assert d.proc.poll() is None


def test_the_full_state_disk_gauge() -> None:
    from krex_async.daemon.observe.metrics import Metrics

    m = Metrics()
    if not m.available:
        pytest.skip("prometheus-client is not installed")
    m.state_disk_full(True)
    assert b"krex_state_disk_full 1.0" in m.scrape()
    m.state_disk_full(False)
    assert b"krex_state_disk_full 0.0" in m.scrape()


BIG = """
import sys
chunk = b"x" * 65536
for _ in range(32):
    sys.stdout.buffer.write(chunk)
sys.stdout.buffer.flush()
"""


async def test_a_spool_that_fills_the_state_disk_leaves_the_intent_record_its_room(small_tmpfs):
    """A command's output would fill the state disk: the spool stops short of the free-space
    reserve (and says so), and the next region still records its intent and is granted."""
    need_cgroups()
    state = os.path.join(small_tmpfs, "state")
    async with run_daemon("--isolation", "cgroup", "--state-dir", state) as d:
        async with await d.client() as c:
            big = await asyncio.wait_for(c.run([PY, "-c", BIG], env=py_env()), 30)
            assert big.report.exit_code == 0 and len(big.stdout) == 32 * 65536
            assert (
                big.report.spool_error.startswith("stdout: ENOSPC") and "below the" in big.report.spool_error
            ), big.report.spool_error
            sib = await c.submit([PY, "-c", "import time; time.sleep(30)"], env=py_env())
            res = await asyncio.wait_for(c.run([PY, "-c", REGION], env=py_env()), 20)
            assert res.stdout.decode().startswith("granted"), (res.stdout, res.stderr[-2000:])
            await c.cancel(sib.command)
        assert d.proc.poll() is None


async def test_start_up_on_a_full_state_disk_serves_and_refuses_regions_with_an_answer(small_tmpfs):
    """The state disk is full when the daemon restarts: it serves (the intent record it could
    not write is named in the log), a region is refused with an answer until space is freed,
    and granted after."""
    need_cgroups()
    state = os.path.join(small_tmpfs, "state")
    async with run_daemon("--isolation", "cgroup", "--state-dir", state) as d:
        async with await d.client() as c:
            assert (await c.run(["echo", "before"])).stdout == b"before\n"
    os.unlink(os.path.join(state, "space.reserve"))  # filled while stopped, the reserve included
    fill(small_tmpfs)
    async with run_daemon("--isolation", "cgroup", "--state-dir", state) as d:
        async with await d.client() as c:
            assert (await c.run(["echo", "after"])).stdout == b"after\n"
            sib = await c.submit([PY, "-c", "import time; time.sleep(30)"], env=py_env())
            res = await asyncio.wait_for(c.run([PY, "-c", REGION], env=py_env()), 20)
            assert res.stdout.decode().startswith("refused"), res.stdout
            os.unlink(os.path.join(small_tmpfs, "filler"))
            res = await asyncio.wait_for(c.run([PY, "-c", REGION], env=py_env()), 20)
            assert res.stdout.decode().startswith("granted"), (res.stdout, res.stderr[-2000:])
            await c.cancel(sib.command)
        assert d.proc.poll() is None
        assert "intent record not written" in d.logs()
