"""Launch uprobes counted exactly, on a shared library this test builds (no libcuda here)."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from krex_async.probes.launches import LaunchProbe, find_libraries

from .conftest import Collector, need_bcc

FAKE = r"""
int cuLaunchKernel(void *f, unsigned gx) { return (int)gx; }
int cuLaunchKernel_ptsz(void *f, unsigned gx) { return (int)gx + 1; }
int cuGraphLaunch(void *g, void *s) { return 0; }
/* An alias: the same address under a second launch name must be probed (and counted) once. */
int cuLaunchKernelEx(void *f, unsigned gx) __attribute__((alias("cuLaunchKernel")));
int not_a_launch(void) { return 7; }
"""

CALLER = """
import ctypes, os, sys
lib = ctypes.CDLL(sys.argv[1])
for i in range(int(sys.argv[2])): lib.cuLaunchKernel(None, i)
for i in range(int(sys.argv[3])): lib.cuLaunchKernel_ptsz(None, i)
for i in range(int(sys.argv[4])): lib.cuGraphLaunch(None, None)
for i in range(int(sys.argv[5])): lib.cuLaunchKernelEx(None, i)
for i in range(50): lib.not_a_launch()
print(os.getpid())
"""


@pytest.fixture(scope="module")
def fake_libcuda(tmp_path_factory: pytest.TempPathFactory) -> str:
    if shutil.which("gcc") is None:
        pytest.skip("gcc missing: cannot build the test library")
    d = tmp_path_factory.mktemp("fakecuda")
    (d / "fake.c").write_text(FAKE)
    subprocess.run(
        ["gcc", "-O2", "-shared", "-fPIC", "-o", str(d / "libcuda.so.1"), str(d / "fake.c")], check=True
    )
    return str(d / "libcuda.so.1")


def call(lib: str, k: int, ptsz: int, graph: int, ex: int) -> int:
    out = subprocess.run(
        [sys.executable, "-c", CALLER, lib, str(k), str(ptsz), str(graph), str(ex)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return int(out)


async def test_launches_counted_exactly(fake_libcuda: str) -> None:
    need_bcc()
    probe = LaunchProbe([fake_libcuda], search=False)
    col = Collector(probe)
    col.start()
    try:
        assert sorted(probe.attached[fake_libcuda]) == [
            "cuGraphLaunch",
            "cuLaunchKernel",
            "cuLaunchKernel_ptsz",
        ]  # Ex aliases Kernel
        pid = call(fake_libcuda, 10007, 3, 5, 11)
        other = call(fake_libcuda, 2, 0, 0, 0)
        by_sym = probe.by_symbol()
    finally:
        probe.stop()
    assert by_sym[(pid, "cuLaunchKernel")] == 10007 + 11
    assert by_sym[(pid, "cuLaunchKernel_ptsz")] == 3
    assert by_sym[(pid, "cuGraphLaunch")] == 5
    assert probe.counts() == {pid: 10007 + 11 + 3 + 5, other: 2}
    assert col.events == []  # stream off by default
    assert probe.by_symbol() == by_sym  # still answers after stop


async def test_launch_events_streamed(fake_libcuda: str) -> None:
    need_bcc()
    probe = LaunchProbe([fake_libcuda], search=False, stream=True)
    col = Collector(probe)
    col.start()
    try:
        pid = call(fake_libcuda, 300, 0, 2, 0)
        assert await col.wait_for(lambda: len(col.of(pid)) >= 302)
    finally:
        probe.stop()
    names = [e.name for e in col.of(pid)]
    assert names == ["cuLaunchKernel"] * 300 + ["cuGraphLaunch"] * 2
    assert {e.kind for e in col.of(pid)} == {"launch"} and probe.lost() == 0


def test_find_libraries_dedupes_by_inode(fake_libcuda: str, tmp_path: Path) -> None:
    link = tmp_path / "libcuda.so"
    link.symlink_to(fake_libcuda)
    assert find_libraries([str(link), fake_libcuda], search=False) == [fake_libcuda]
    assert find_libraries([str(tmp_path / "missing.so")], search=False) == []


async def test_no_library_is_unavailable(tmp_path: Path) -> None:
    import asyncio

    from krex_async.probes.base import ProbeUnavailable

    probe = LaunchProbe([str(tmp_path / "nothing.so")], search=False)
    with pytest.raises(ProbeUnavailable, match="no libcuda"):
        probe.start(asyncio.get_running_loop(), lambda b: None)


async def test_library_loaded_after_start_is_probed(fake_libcuda: str) -> None:
    """With search on, a libcuda first seen in a process's /proc/<pid>/maps gets probed."""
    need_bcc()
    import asyncio

    probe = LaunchProbe(search=True, rescan_s=0.1)
    probe.start(asyncio.get_running_loop(), lambda b: None)
    holder = subprocess.Popen(
        [sys.executable, "-c", f"import ctypes, sys; ctypes.CDLL({fake_libcuda!r}); sys.stdin.readline()"],
        stdin=subprocess.PIPE,
        text=True,
    )
    try:
        for _ in range(100):
            if fake_libcuda in probe.attached:
                break
            await asyncio.sleep(0.05)
        assert fake_libcuda in probe.attached
        pid = call(fake_libcuda, 40, 0, 0, 0)
        assert probe.by_symbol()[(pid, "cuLaunchKernel")] == 40
    finally:
        holder.communicate("x\n")
        probe.stop()


def test_a_mapping_with_a_name_that_is_not_utf8_does_not_stop_the_library_search(tmp_path) -> None:
    """/proc/*/maps shows file names as they are: a process mapping a file whose name is not
    UTF-8 (any user can make one) killed the daemon at start-up (`--probes launches`)."""
    from krex_async.probes.launches import _maps_libs

    odd = os.fsencode(str(tmp_path)) + b"/libcuda-\xff.so"
    with open(odd, "wb") as f:
        f.write(b"\0" * 4096)
    code = (
        "import mmap, sys, time\nf = open(sys.argv[1], 'rb')\n"
        "m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)\nprint('up', flush=True)\ntime.sleep(30)\n"
    )
    p = subprocess.Popen([sys.executable, "-c", code, odd], stdout=subprocess.PIPE)
    try:
        assert p.stdout is not None and p.stdout.readline() == b"up\n"
        found = _maps_libs(["libcuda"])
        assert os.fsdecode(odd) in found, found  # named as the file system names it
    finally:
        p.kill()
        p.wait()


async def test_counts_of_exited_processes_leave_the_map_and_are_kept(fake_libcuda: str) -> None:
    """The BPF map holds 65536 (process, symbol) pairs and the kernel never empties it: the counts
    of exited processes move to Python at each upkeep, so a long-lived daemon keeps counting new
    processes, and by_symbol() still answers for the exited ones."""
    need_bcc()
    probe = LaunchProbe([fake_libcuda], search=False, rescan_s=0.1)
    col = Collector(probe)
    col.start()
    try:
        first = call(fake_libcuda, 7, 0, 1, 0)
        second = call(fake_libcuda, 3, 2, 0, 0)
        table = probe._bpf[b"counts"]
        deadline = time.monotonic() + 10
        while {k.tgid for k in table.keys()} & {first, second}:
            assert time.monotonic() < deadline, "the exited processes' counts stayed in the map"
            await asyncio.sleep(0.05)
        by_sym = probe.by_symbol()
    finally:
        probe.stop()
    assert by_sym[(first, "cuLaunchKernel")] == 7 and by_sym[(first, "cuGraphLaunch")] == 1
    assert by_sym[(second, "cuLaunchKernel")] == 3 and by_sym[(second, "cuLaunchKernel_ptsz")] == 2
    assert probe.counts() == {first: 8, second: 5}
