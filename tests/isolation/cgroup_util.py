"""Helpers for the cgroup tests: a private test root in the real hierarchies, real processes."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from krex_async.isolation.cgroupfs import CgroupFS, cgroup_mounts
from krex_async.isolation.intent import sweep

from ..testcgroups import new_name

SPIN = ["/bin/sh", "-c", "while :; do :; done"]


def need_cgroups() -> tuple[str, str | None]:
    """(v2 mount, v1 cpuset mount or None); skips with the reason when the test cannot run."""
    if os.geteuid() != 0:
        pytest.skip("cgroup tests need root (they create cgroups)")
    v2, v1 = cgroup_mounts()
    if v2 is None:
        pytest.skip("no cgroup2 mount on this host")
    if not os.path.exists(os.path.join(v2, "cgroup.procs")):
        pytest.skip(f"{v2} is not a cgroup2 root")
    return v2, v1


class CgRoot:
    """krex-test-<id>/ under the v2 root (and the v1 cpuset root): the backend's delegated subtree."""

    def __init__(self) -> None:
        v2_mount, v1_mount = need_cgroups()
        name = new_name()
        self.v2 = os.path.join(v2_mount, name)
        os.mkdir(self.v2)
        if "cpuset" in open(os.path.join(v2_mount, "cgroup.subtree_control")).read().split():
            with open(os.path.join(self.v2, "cgroup.subtree_control"), "w") as f:
                f.write("+cpuset")
        self.v1: str | None = None
        if v1_mount and os.path.exists(os.path.join(v1_mount, "cpuset.cpus")):
            self.v1 = os.path.join(v1_mount, name)
            os.mkdir(self.v1)
            for f in ("cpuset.cpus", "cpuset.mems"):
                with open(os.path.join(v1_mount, f)) as src, open(os.path.join(self.v1, f), "w") as dst:
                    dst.write(src.read().strip())

    def cleanup(self) -> None:
        for root in (self.v2, self.v1):
            if not root:
                continue
            fs = CgroupFS(root)
            for rel in reversed(fs.walk("")):
                for pid in fs.procs(rel):
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
        sweep(CgroupFS(self.v2), CgroupFS(self.v1) if self.v1 else None, "none", None)
        for root in (self.v2, self.v1):
            if not root:
                continue
            deadline = time.monotonic() + 3
            for rel in reversed(CgroupFS(root).walk("")):
                while True:
                    try:
                        os.rmdir(os.path.join(root, rel))
                        break
                    except FileNotFoundError:
                        break
                    except OSError:
                        if time.monotonic() > deadline:
                            raise
                        time.sleep(0.01)


def cpu_ticks(pid: int) -> int:
    """utime + stime of a process, in clock ticks."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def allowed(pid: int) -> set[str]:
    """Cpus_allowed_list of every thread of `pid`."""
    out = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/status") as f:
            out.add(f.read().split("Cpus_allowed_list:")[1].split()[0])
    return out


def wait_for(pred, timeout: float = 2.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.01)
    return pred()


def v1_freezer() -> str | None:
    v2, _ = cgroup_mounts()
    for line in open("/proc/self/mountinfo"):
        left, _, right = line.partition(" - ")
        r = right.split()
        if r and r[0] == "cgroup" and "freezer" in r[-1].split(","):
            return left.split()[4]
    return None


def reap(p: subprocess.Popen[bytes]) -> None:
    if p.poll() is None:
        p.kill()
    p.wait(timeout=5)


__all__ = ["SPIN", "CgRoot", "cpu_ticks", "state", "allowed", "wait_for", "v1_freezer", "reap"]
