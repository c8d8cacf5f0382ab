"""Which command a probe event belongs to, and whether it is a stray during a region.

Two ways, tried in order:
1. cgroup: bcc events carry the cgroup v2 id of the calling task (BccEvent.cgroup, the inode number
   of its cgroup directory). A command whose cgroup was registered matches even after the process
   exited, and wherever its processes were reparented.
2. process tree: the event's tgid, then its parents (/proc/<pid>/stat), up to a registered command
   root pid. Needs the process alive when the event is attributed (events arrive within ~10 ms); the
   answer is cached per tgid, and forgotten when the commands change.

    a = Attributor(); a.add("c1", root_pid, cgroup_dir="/sys/fs/cgroup/krex/c1")
    cmd = a.command_of(ev)               # "c1" or None (not a command's process)
    a.is_stray(ev, owner="c2")           # True: during c2's region, anything not from c2
"""

from __future__ import annotations

import os

from .base import ProbeEvent
from ..procfs import stat_fields


def parent_pid(pid: int, proc: str = "/proc") -> int | None:
    """The parent of `pid` from /proc/<pid>/stat, or None when it is gone or unreadable."""
    fields = stat_fields(pid, proc)
    return None if fields is None else int(fields[1])


def cgroup_id(cgroup_dir: str) -> int:
    """The cgroup v2 id of a cgroup directory (what bpf_get_current_cgroup_id returns)."""
    return os.stat(cgroup_dir).st_ino


def cgroup2_root() -> str | None:
    """Where the cgroup v2 hierarchy is mounted (/sys/fs/cgroup, or /sys/fs/cgroup/unified on
    hybrid hosts), or None."""
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) > 2 and parts[2] == "cgroup2":
                    return parts[1]
    except OSError:
        pass
    return None


class Attributor:
    """Maps events to command ids; see the module docstring. Pure bookkeeping over /proc reads:
    nothing raises for processes that vanished (they attribute to None)."""

    MAX_DEPTH = 64

    def __init__(self, proc: str = "/proc") -> None:
        self.proc = proc
        self._roots: dict[int, str] = {}
        self._cgroups: dict[int, str] = {}
        self._cache: dict[int, str | None] = {}

    def add(self, command: str, pid: int, cgroup_dir: str | None = None) -> None:
        """Register a command by its root pid and, when it has one, its cgroup directory."""
        self._roots[pid] = command
        if cgroup_dir:
            try:
                self._cgroups[cgroup_id(cgroup_dir)] = command
            except OSError:
                pass
        self._cache.clear()

    def remove(self, command: str) -> None:
        self._roots = {p: c for p, c in self._roots.items() if c != command}
        self._cgroups = {g: c for g, c in self._cgroups.items() if c != command}
        self._cache.clear()

    def command_of(self, ev: ProbeEvent) -> str | None:
        cg = getattr(ev, "cgroup", 0)
        if cg and cg in self._cgroups:
            # Kept per tgid too: the lossless counts are per tgid, and a region's reconciliation
            # asks by tgid alone, often after a short-lived child has exited.
            self._cache[ev.tgid] = self._cgroups[cg]
            return self._cgroups[cg]
        if ev.tgid in self._cache:
            return self._cache[ev.tgid]
        found = None
        pid: int | None = ev.tgid
        for _ in range(self.MAX_DEPTH):
            if pid is None or pid <= 1:
                break
            if pid in self._roots:
                found = self._roots[pid]
                break
            pid = parent_pid(pid, self.proc)
        if found is not None or os.path.exists(f"{self.proc}/{ev.tgid}"):
            self._cache[ev.tgid] = found  # a gone process is not cached: its pid may be reused
        return found

    def is_stray(self, ev: ProbeEvent, owner: str | None) -> bool:
        """True when a region is held (`owner` is its command) and the event is not the owner's."""
        return owner is not None and self.command_of(ev) != owner
