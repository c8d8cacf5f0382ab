"""Events attributed to commands through the process tree and the cgroup v2 id; strays."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from krex_async.probes.attribution import EventMapper, cgroup2_root, cgroup_id, parent_pid
from krex_async.probes.base import ProbeEvent
from krex_async.probes.bpf_ioctl import IoctlProbe

from .conftest import CHILD, Collector, WaitingChild, need_bcc


async def test_process_tree_and_strays(devdir: str, tmp_path: Path) -> None:
    need_bcc()
    probe = IoctlProbe([devdir + "/"])
    col = Collector(probe)
    col.start()
    # command c1: a shell whose grandchild makes the ioctls; c2: a direct child; and an outsider.
    (tmp_path / "child.py").write_text(CHILD)  # not under the prefix: open() would ioctl (isatty)
    inner = f"{sys.executable} {tmp_path}/child.py {devdir}/null0 3 0 2"
    c1 = subprocess.Popen(
        ["sh", "-c", f"sh -c '{inner}'; true"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    c2 = WaitingChild(f"{devdir}/null0", 2, 0, linger=True)
    outsider = WaitingChild(f"{devdir}/null0", 1, 0, linger=True)
    att = EventMapper()
    att.add("c1", c1.pid)
    att.add("c2", c2.proc.pid)
    try:
        assert c1.stdout is not None and c1.stdin is not None
        c1.stdout.readline()  # ready
        c1.stdin.write("go\n")
        c1.stdin.flush()
        pid1 = json.loads(c1.stdout.readline())["pid"]
        pid2, pid3 = c2.go()["pid"], outsider.go()["pid"]
        assert await col.wait_for(lambda: len({e.tgid for e in col.events}) >= 3)
        seen = {e.tgid: att.command_of(e) for e in col.events}  # all three still alive
    finally:
        c1.communicate("bye\n", timeout=30)
        c2.kill()
        outsider.kill()
        probe.stop()
    assert seen == {pid1: "c1", pid2: "c2", pid3: None}
    assert pid1 not in (c1.pid, c2.proc.pid)  # a grandchild, found through its parents
    ev_c1 = next(e for e in col.events if e.tgid == pid1)
    ev_out = next(e for e in col.events if e.tgid == pid3)
    assert att.is_stray(ev_out, owner="c2") and att.is_stray(ev_c1, owner="c2")
    assert not att.is_stray(ev_c1, owner="c1") and not att.is_stray(ev_out, owner=None)


async def test_cgroup_id_attributes_after_exit(devdir: str) -> None:
    need_bcc()
    root = cgroup2_root()
    if root is None:
        pytest.skip("no cgroup v2 hierarchy mounted")
    cg = f"{root}/krex-probe-test-{os.getpid()}"
    try:
        os.mkdir(cg)
    except OSError as e:
        pytest.skip(f"cannot create a cgroup v2 directory: {e}")
    probe = IoctlProbe([devdir + "/"])
    col = Collector(probe)
    cg_id = cgroup_id(cg)
    try:
        child = WaitingChild(f"{devdir}/null0", 3, 0)
        with open(f"{cg}/cgroup.procs", "w") as f:
            f.write(str(child.proc.pid))
        col.start()
        res = child.go()
        child.proc.wait(timeout=30)
        assert await col.wait_for(lambda: len(col.of(res["pid"])) >= 3)
        assert probe.cgroup_counts()[cg_id] == 3  # kernel-side, per cgroup
        probe._prune_cgroups()
        assert cg_id in {k.value for k in probe._bpf[b"cg_counts"].keys()}, "a live cgroup was pruned"
        os.rmdir(cg)  # empty again: the child has exited
        probe._prune_cgroups()  # what the upkeep does every rescan
        assert cg_id not in {k.value for k in probe._bpf[b"cg_counts"].keys()}, (
            "a removed cgroup still takes a slot of the kernel-side map"
        )
        assert probe.cgroup_counts()[cg_id] == 3, "a removed cgroup's count was lost"
    finally:
        probe.stop()
        if os.path.isdir(cg):
            os.rmdir(cg)
    evs = col.of(res["pid"])
    assert {getattr(e, "cgroup", None) for e in evs} == {cg_id}
    att = EventMapper()
    att.add("c9", 999999999)  # root pid unknown: only the cgroup can tell
    att._cgroups[cg_id] = "c9"  # the directory is gone; register the id it had
    assert all(att.command_of(e) == "c9" for e in evs)  # the process is gone by now
    assert parent_pid(res["pid"]) is None
    # The lossless counts are per tgid: asked by tgid alone after the exit (the region's count
    # reconciliation at release), the answer its events gave still holds, not "outside krex".
    assert att.command_of(ProbeEvent(0, res["pid"], res["pid"], "count")) == "c9"


def test_parent_pid_reads_proc() -> None:
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(5)"])
    try:
        assert parent_pid(p.pid) == os.getpid()
    finally:
        p.kill()
        p.wait()


PARENT = """
import os, subprocess, sys
kids = {}
for line in sys.stdin:
    cmd, arg = line.split()
    if cmd == "spawn":  # a child, at pid `arg` when it is free and nothing forks in between
        if arg != "0":
            with open("/proc/sys/kernel/ns_last_pid", "w") as f:
                f.write(str(int(arg) - 1))
        p = subprocess.Popen(["sleep", "60"])
        kids[p.pid] = p
        print(p.pid, flush=True)
    else:  # "kill PID": gone and reaped, so the pid is free
        p = kids.pop(int(arg))
        p.kill()
        p.wait()
        print("ok", flush=True)
"""


class Parent:
    """A process that forks children on request, at a chosen pid (ns_last_pid, root)."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", PARENT], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )

    def ask(self, line: str) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def spawn_at(self, pid: int) -> int:
        """A child at `pid`; skips the test when other forks keep taking it first. It starts at
        least one clock tick (10 ms) after the pid's previous process: start times, the identity
        the attributor checks, have that resolution (a real reuse takes a wrap of the pid space)."""
        time.sleep(0.03)
        for _ in range(20):
            got = int(self.ask(f"spawn {pid}"))
            if got == pid:
                return got
            self.ask(f"kill {got}")
        pytest.skip(f"could not get pid {pid} back (a busy machine forks in between)")

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


def test_a_reused_pid_is_attributed_to_its_new_process() -> None:
    if os.geteuid() != 0 or not os.path.exists("/proc/sys/kernel/ns_last_pid"):
        pytest.skip("needs root and /proc/sys/kernel/ns_last_pid to reuse a pid on purpose")
    cmd, outside = Parent(), Parent()
    att = EventMapper(revalidate_s=0)  # the default (0.5 s) would need sleeps between the steps
    att.add("c1", cmd.proc.pid)
    ev = lambda pid: ProbeEvent(ts_ns=0, tgid=pid, tid=pid, kind="ioctl")  # noqa: E731
    try:
        pid = int(cmd.ask("spawn 0"))
        assert att.command_of(ev(pid)) == "c1"
        cmd.ask(f"kill {pid}")
        outside.spawn_at(pid)  # the command's child is gone; an outsider has its pid now
        assert att.command_of(ev(pid)) is None, "an outsider taken for the command: missed strays"
        outside.ask(f"kill {pid}")
        cmd.spawn_at(pid)  # and the other way round
        assert att.command_of(ev(pid)) == "c1", "the owner's own child taken for a stray"
    finally:
        cmd.close()
        outside.close()


def test_an_exited_process_of_another_command_stays_attributed_after_the_commands_change() -> None:
    """A region's release looks its counts up by tgid, after short-lived processes exited: one of
    command B that ended during A's region must still be B's once B is removed and another command
    starts (it was called A's stray), while an outsider's cached "none" is asked again when a new
    command starts (it may be that command's)."""
    b = subprocess.Popen(["sleep", "60"])
    other = subprocess.Popen(["sleep", "60"])
    att = EventMapper()
    ev = lambda pid: ProbeEvent(ts_ns=0, tgid=pid, tid=pid, kind="ioctl")  # noqa: E731
    try:
        att.add("B", b.pid)
        assert att.command_of(ev(b.pid)) == "B"
        assert att.command_of(ev(other.pid)) is None  # cached: no command's
        b.kill()
        b.wait()
        att.remove("B")
        att.add("C", other.pid)  # another command starts; its root was cached as nobody's
        assert att.command_of(ev(b.pid)) == "B", "an ended command's exited process became a stray"
        assert att.command_of(ev(other.pid)) == "C"
        assert att.is_stray(ev(b.pid), owner="B") is False
    finally:
        for p in (b, other):
            p.kill()
            p.wait()


def test_a_pool_worker_that_served_an_ended_command_is_no_longer_its() -> None:
    """A warm pool worker taken by a command is the command's while it serves it; once the command
    ended (removed with the pool's workers to forget) the worker, alive and back in its pool, is
    no command's: its next command's add() or none, never the old one's for KEEP_S."""
    worker = subprocess.Popen(["sleep", "60"])
    gone = subprocess.Popen(["sleep", "60"])
    att = EventMapper()
    ev = lambda pid: ProbeEvent(ts_ns=0, tgid=pid, tid=pid, kind="ioctl")  # noqa: E731
    try:
        att.add("A", worker.pid)
        att.add("A", gone.pid)
        assert att.command_of(ev(worker.pid)) == "A" and att.command_of(ev(gone.pid)) == "A"
        att.remove("A", forget=[worker.pid])
        assert att.command_of(ev(worker.pid)) is None, "the idle worker still counted as A's"
        assert att.command_of(ev(gone.pid)) == "A", "the command's other processes stay A's"
    finally:
        for p in (worker, gone):
            p.kill()
            p.wait()
