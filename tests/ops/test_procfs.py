"""procfs: the one reader of the mount table and /proc/<pid>/cgroup, checked against a crafted
mountinfo and against the kernel's own files for this process."""

from __future__ import annotations

import os
import subprocess

from krex_async.isolation.cgroupfs import cgroup_mounts, own_cgroups
from krex_async.linux import procfs

MOUNTINFO = (
    "25 30 0:22 / /sys/fs/cgroup/unified rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"
    "26 30 0:23 / /sys/fs/cgroup/cpuset rw - cgroup cgroup rw,cpuset\n"
    "27 30 0:24 /sub /mnt/with\\040space rw - cgroup cgroup rw,freezer\n"
    "28 30 0:25 / /sys/kernel/tracing rw - tracefs tracefs rw\n"
    "garbage\n"
)


def test_mounts_parse_filter_and_unescape(tmp_path):
    mi = tmp_path / "mountinfo"
    mi.write_text(MOUNTINFO)
    ms = procfs.mounts(mountinfo=str(mi))
    assert [m.fstype for m in ms] == ["cgroup2", "cgroup", "cgroup", "tracefs"]
    cg = procfs.mounts("cgroup", mountinfo=str(mi))
    assert [(m.point, m.root, m.options) for m in cg] == [
        ("/sys/fs/cgroup/cpuset", "/", ("rw", "cpuset")),
        ("/mnt/with space", "/sub", ("rw", "freezer")),
    ]
    assert cgroup_mounts(str(mi)) == ("/sys/fs/cgroup/unified", "/sys/fs/cgroup/cpuset")
    assert procfs.mounts(mountinfo=str(tmp_path / "missing")) == []


def test_mounts_match_the_kernel_table():
    with open("/proc/self/mounts") as f:
        want = [line.split()[1] for line in f if line.split()[2] == "cgroup2"]
    assert [m.point for m in procfs.mounts("cgroup2")] == want


def test_cgroups_of_a_process_and_of_a_gone_one():
    with open("/proc/self/cgroup") as f:
        want = [tuple(line.rstrip("\n").split(":", 2)) for line in f]
    assert procfs.cgroups() == want == procfs.cgroups(os.getpid())
    p = subprocess.Popen(["true"])
    p.wait()
    assert procfs.cgroups(p.pid) is None  # reaped: its /proc entry is gone
    v2 = [path for hid, ctrls, path in want if hid == "0" and not ctrls]
    assert own_cgroups().get("") == (v2[0] if v2 else None)


def test_exiting_in_kernel_tells_a_process_past_user_space() -> None:
    """A live process (sleeping, or running its Python exit hooks) is not past user space; a
    zombie is (its kernel exit is done); a pid that is gone is not (nothing left to wait for)."""
    script = "import atexit, sys, time; atexit.register(time.sleep, 30); print('up', flush=True); sys.exit(0)"
    p = subprocess.Popen(["/usr/bin/python3", "-c", script], stdout=subprocess.PIPE)
    try:
        assert p.stdout is not None and p.stdout.readline() == b"up\n"
        assert not procfs.exiting_in_kernel(p.pid)  # inside its exit hooks: still user space
        p.kill()
        os.waitid(os.P_PID, p.pid, os.WEXITED | os.WNOWAIT)  # a zombie, not reaped yet
        assert procfs.exiting_in_kernel(p.pid)
    finally:
        p.kill()
        p.wait()
    assert not procfs.exiting_in_kernel(p.pid)  # gone: nothing to wait for, and False


def test_exiting_in_kernel_reads_the_flags_field(tmp_path) -> None:
    """The flags field (proc(5) field 9) with PF_EXITING set is a process in the kernel's exit, even
    while its state still reads running; other flags are not."""

    def stat(pid: int, state: str, flags: int) -> None:
        (tmp_path / str(pid)).mkdir()
        rest = " ".join(["1", "1", "1", "0", "-1", str(flags)] + ["0"] * 15)
        (tmp_path / str(pid) / "stat").write_text(f"{pid} (a (b) c) {state} {rest}\n")

    stat(10, "R", 0x404)  # PF_EXITING | PF_FORKNOEXEC
    stat(11, "R", 0x400040)  # PF_FORKNOEXEC | PF_RANDOMIZE
    stat(12, "D", 0x4)
    assert procfs.exiting_in_kernel(10, proc=str(tmp_path))
    assert not procfs.exiting_in_kernel(11, proc=str(tmp_path))
    assert procfs.exiting_in_kernel(12, proc=str(tmp_path))
    assert procfs.stat_fields(11, proc=str(tmp_path))[6] == str(0x400040).encode()


def test_thread_files_reads_every_thread_and_skips_the_gone() -> None:
    import threading

    from krex_async.linux import procfs

    stop = threading.Event()
    t = threading.Thread(target=stop.wait)
    t.start()
    try:
        seen = {tid for pid, tid, text in procfs.thread_files([os.getpid(), 2**22 + 7], "stat") if text}
        assert str(threading.get_native_id()) in seen and str(t.native_id) in seen, seen
        assert procfs.uninterruptible([os.getpid()]) == []  # running and sleeping, none in D
    finally:
        stop.set()
        t.join()
