"""A full state disk under the cgroup backend's intent record: a region that cannot record what it
would freeze or fence is refused with an answer, it does not leave its owner waiting."""

from __future__ import annotations

import asyncio
import os

import pytest

from krex_async import Client
from krex_async.linux import reserve
from krex_async.linux.fsutil import replace_file
from krex_async.ops.statusview import render

from ..conftest import PY, py_env, run_daemon, until
from ..isolation.cgroup_util import need_cgroups

REGION = """
from krex_async import region
try:
    with region("full"):
        print("granted")
except Exception as e:
    print("refused", type(e).__name__, e)
"""


def intent_names(state: str, command: str) -> bool:
    """Whether the intent record on disk holds `command`'s cgroups (written in the background)."""
    try:
        with open(os.path.join(state, "intent.json")) as f:
            return f"cmd-{command}" in f.read()
    except OSError:
        return False


async def running(c: Client, command: str) -> None:
    """Until status shows `command` running (its start record is written by then)."""
    while not any(
        x["command"] == command and x["state"] == "running" for x in (await c.status())["commands"]
    ):
        await asyncio.sleep(0.01)


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
    reserve is made again and the disk no longer reported full.

    The sibling's records all land before the fill, so the write that meets the full disk is the
    region's own intent record, and nothing else takes the room the reserve gave back: the disk
    must still read full then (the reserve is not made back from its own room)."""
    need_cgroups()
    state = os.path.join(small_tmpfs, "state")
    async with run_daemon("--isolation", "cgroup", "--state-dir", state) as d:
        async with await d.client() as c:
            assert (await c.status())["state_disk_full"] is False
            sib = await c.submit([PY, "-c", "import time; time.sleep(30)"], env=py_env())
            await asyncio.wait_for(running(c, sib.command), 20)
            await until(
                lambda: intent_names(state, sib.command), "the sibling's cgroups in the intent record"
            )
            fill(small_tmpfs)
            res = await asyncio.wait_for(c.run([PY, "-c", REGION], env=py_env()), 20)
            assert res.stdout.decode().startswith("granted"), (res.stdout, res.stderr[-2000:])
            assert not os.path.exists(os.path.join(state, "space.reserve"))  # spent
            st = await c.status()
            assert st["state_disk_full"] is True
            assert not os.path.exists(os.path.join(state, "space.reserve"))  # not made from its own room
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


def test_the_reserve_comes_back_only_when_space_is_freed(small_tmpfs):
    """A write on a full disk spends the reserve; the room it gave back alone does not make it
    again (the disk is still full: the next write would only spend it again), space freed does."""
    state = os.path.join(small_tmpfs, "state")
    os.makedirs(state)
    r = reserve.setup(state)
    assert not r.full and os.path.getsize(r.path) == r.size
    record = os.path.join(state, "intent.json")
    replace_file(record, b"{}")  # there before: its rewrite takes no more room than it frees
    fill(small_tmpfs)
    reserve.guarded(record, lambda: replace_file(record, b"{ }"))
    assert r.full and not os.path.exists(r.path)
    assert r.refresh() is True and not os.path.exists(r.path)
    reserve.guarded(record, lambda: replace_file(record, b"{}"))  # a later write: still full
    assert r.full and not os.path.exists(r.path)
    os.unlink(os.path.join(small_tmpfs, "filler"))
    assert r.refresh() is False and os.path.getsize(r.path) == r.size


def test_a_root_daemon_s_reserve_comes_back_in_the_blocks_kept_for_root(small_ext4):
    """ext4 keeps blocks for root: a root daemon's writes, the reserve's included, use them, so free
    space is what root may take (f_bfree), not what an unprivileged writer may (f_bavail, 0 until
    more than the kept blocks is freed). Space freed, the reserve comes back at once."""
    state = os.path.join(small_ext4, "state")
    os.makedirs(state)
    r = reserve.setup(state)
    assert not r.full
    record, freed = os.path.join(state, "intent.json"), os.path.join(small_ext4, "freed")
    replace_file(record, b"{}")
    with open(freed, "wb") as f:
        f.write(b"\0" * (4 * r.size))
        os.fsync(f.fileno())
    fill(small_ext4)  # as root: the kept blocks too
    for i in range(64):  # and what a new small file may still take
        try:
            replace_file(os.path.join(small_ext4, f"small{i}"), b"x" * 1024)
        except OSError:
            break
    reserve.guarded(record, lambda: replace_file(record, b"{ }"))
    assert r.full and not os.path.exists(r.path)
    assert r.refresh() is True and not os.path.exists(r.path)  # not from its own room
    os.unlink(freed)
    st = os.statvfs(small_ext4)
    assert st.f_bavail * st.f_frsize < 2 * r.size <= st.f_bfree * st.f_frsize, st  # the case
    assert r.refresh() is False and os.path.getsize(r.path) == r.size


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


def test_a_reserve_that_cannot_be_made_for_another_reason_does_not_say_the_disk_is_full(small_tmpfs):
    """A directory where the reserve goes (or no fallocate on that file system): no reserve can be
    made, for want of nothing but a file. The disk is not called full for it; a write that meets
    ENOSPC makes it full until statvfs shows room again, then it is not."""
    state = os.path.join(small_tmpfs, "state")
    os.makedirs(os.path.join(state, reserve.NAME))
    r = reserve.setup(state)
    assert not r.full and "Is a directory" in r.unavailable, (r.full, r.unavailable)
    assert r.refresh() is False  # and stays so: the disk has room
    record = os.path.join(state, "intent.json")
    replace_file(record, b"{}")
    fill(small_tmpfs)
    with pytest.raises(OSError):  # no reserve to spend: the write fails as the disk is full
        reserve.guarded(record, lambda: replace_file(record, b"{ " + b" " * 8192 + b"}"))
    assert r.full and r.refresh() is True
    os.unlink(os.path.join(small_tmpfs, "filler"))
    assert r.refresh() is False and os.path.isdir(r.path)
    reserve.guarded(record, lambda: replace_file(record, b"{ }"))  # and writes go through
    assert not r.full


async def test_status_names_a_reserve_that_cannot_be_made() -> None:
    """A daemon whose state dir has a directory where the reserve goes serves, says why it has no
    reserve, and does not call the disk full."""
    import shutil
    import tempfile

    d = tempfile.mkdtemp(prefix="krex-state-", dir="/tmp")
    os.makedirs(os.path.join(d, reserve.NAME))
    try:
        async with run_daemon("--isolation", "signal", "--state-dir", d) as dm:
            async with await dm.client() as c:
                st = await c.status()
    finally:
        shutil.rmtree(d, ignore_errors=True)
    assert st["state_disk_full"] is False, st["state_disk_full"]
    assert "Is a directory" in st["state_disk_reserve_unavailable"], st["state_disk_reserve_unavailable"]
    assert "no reserve for region records" in render(st)
