"""GpuHolders: what the region path believes about who holds a GPU device file, on real processes.

The GPU prefixes are pointed at a temporary directory; a child opens a file there on request.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import pytest

from krex_async.daemon.regions.gpuholders import GpuHolders, read_holders
from krex_async.runtime import quiesce

CHILD = r"""
import sys
held = []
for line in sys.stdin:
    held.append(open(line.strip(), "w"))
    print("opened", flush=True)
"""


@pytest.fixture
def device_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(quiesce, "GPU_PREFIXES", (str(tmp_path) + "/",))
    return tmp_path


@pytest.fixture
def child():
    p = subprocess.Popen(
        [sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    yield p
    p.kill()
    p.wait()


def open_in(p: subprocess.Popen[str], path: str) -> None:
    assert p.stdin is not None and p.stdout is not None
    p.stdin.write(path + "\n")
    p.stdin.flush()
    assert p.stdout.readline().strip() == "opened"


def test_a_recent_none_is_believed_until_it_is_stale_and_a_holder_stays_one(device_dir, child):
    h = GpuHolders(fresh_s=0.3)
    assert not h.holds(child.pid, "conn")
    open_in(child, str(device_dir / "nvidia0"))
    assert not h.holds(child.pid, "conn"), "a fresh 'none' was read again"
    assert read_holders([child.pid]) == [child.pid], "the direct reading must see the open"
    assert h.holds(child.pid, "other-conn"), "a new runtime connection must be read afresh"
    time.sleep(0.35)
    assert h.holds(child.pid, "conn")
    assert h.holds(child.pid, "conn")  # remembered: no reading needed for a holder


def test_refresh_reads_the_stale_ones_on_a_thread(device_dir, child):
    async def go() -> None:
        h = GpuHolders(fresh_s=10.0)
        assert not h.holds(child.pid, "c")
        open_in(child, str(device_dir / "renderD128"))
        h.refresh([(child.pid, "c")])  # fresh (younger than fresh_s / 2): not read again
        assert h._refreshing is None
        h.note(child.pid, "c", False, at=time.monotonic() - 6.0)  # now past fresh_s / 2
        h.refresh([(child.pid, "c")])
        assert h._refreshing is not None
        await h._refreshing
        await asyncio.sleep(0)  # the done callback
        assert h.holds(child.pid, "c")
        assert h.stale([(child.pid, "c")]) == []

    asyncio.run(go())


def test_a_reading_that_finds_none_never_undoes_a_holder(device_dir, child):
    h = GpuHolders()
    h.note(child.pid, "c", True)
    h.note(child.pid, "c", False, at=time.monotonic())
    assert h.holds(child.pid, "c")


def test_read_holders_skips_processes_that_are_gone(device_dir):
    p = subprocess.Popen(["true"])
    p.wait()
    assert read_holders([p.pid]) == []


def test_reading_names_exactly_the_processes_that_hold_a_device_file(device_dir, child):
    other = subprocess.Popen(
        [sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        open_in(child, str(device_dir / "nvidia0"))
        assert read_holders([child.pid, other.pid]) == [child.pid]
        open_in(other, str(device_dir / "renderD128"))
        assert read_holders([other.pid, child.pid]) == [other.pid, child.pid]
    finally:
        other.kill()
        other.wait()
