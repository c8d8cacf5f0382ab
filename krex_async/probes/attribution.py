"""Which command a probe event belongs to, and whether it is a stray during a region.

Two ways, tried in order:
1. cgroup: bcc events carry the cgroup v2 id of the calling task (BccEvent.cgroup, the inode number
   of its cgroup directory). A command whose cgroup was registered matches even after the process
   exited, and wherever its processes were reparented.
2. process tree: the event's tgid, then its parents (/proc/<pid>/stat), up to a registered command
   root pid. Needs the process alive when the event is attributed (events arrive within ~10 ms); the
   answer is cached per tgid. A new command drops the cached "no command" answers (a process it
   started before its root was known); an ended command's answers are kept KEEP_S, so that a
   region's release still attributes the counts of its processes that have exited.

A cached answer is for one process, and pids are reused: each entry keeps its process's start time
(/proc/<pid>/stat), and an entry older than `revalidate_s` is checked against the pid's current
start time before it is used (one /proc read per tgid per revalidate_s). A different start time is
another process: the entry is dropped and the new one attributed afresh. A gone process keeps its
entry (late events and the per-tgid count reconciliation still need it) until a new process shows
up at that pid. (Reusing a pid takes a wrap of the whole pid space, far longer than revalidate_s,
unless something sets ns_last_pid.)

    a = EventMapper(); a.add("c1", root_pid, cgroup_dir="/sys/fs/cgroup/krex/c1")
    cmd = a.command_of(ev)               # "c1" or None (not a command's process)
    a.is_stray(ev, owner="c2")           # True: during c2's region, anything not from c2
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable

from krex_async.linux import procfs
from krex_async.linux.procfs import start_time  # the one reading (importers name it here too)
from krex_async.probes.base import ProbeEvent


def parent_pid(pid: int, proc: str = procfs.PROC) -> int | None:
    """The parent of `pid` from /proc/<pid>/stat, or None when it is gone or unreadable."""
    st = procfs.stat(pid, proc)
    return None if st is None else st.ppid


def cgroup_id(cgroup_dir: str) -> int:
    """The cgroup v2 id of a cgroup directory (what bpf_get_current_cgroup_id returns)."""
    return os.stat(cgroup_dir).st_ino


def cgroup2_root() -> str | None:
    """Where the cgroup v2 hierarchy is mounted (/sys/fs/cgroup, or /sys/fs/cgroup/unified on
    hybrid hosts), or None."""
    return next((m.point for m in procfs.mounts("cgroup2")), None)


class EventMapper:
    """Maps events to command ids; see the module docstring. Pure bookkeeping over /proc reads:
    nothing raises for processes that vanished (they attribute to None)."""

    MAX_DEPTH = 64
    REVALIDATE_S = 0.5
    KEEP_S = 600.0  # an ended command's cached answers: longer than any region it ended during

    def __init__(self, proc: str = procfs.PROC, revalidate_s: float = REVALIDATE_S) -> None:
        self.proc = proc
        self.revalidate_ns = int(revalidate_s * 1e9)
        self._roots: dict[int, str] = {}
        self._cgroups: dict[int, str] = {}
        # tgid -> (command or None, its start time or None when unknown, when last checked)
        self._cache: dict[int, tuple[str | None, int | None, int]] = {}
        self._ended: dict[str, float] = {}  # command -> when it was removed (time.monotonic)

    def _remember(self, tgid: int, command: str | None, start: int | None = None) -> None:
        if start is None:
            start = start_time(tgid, self.proc)
        self._cache[tgid] = (command, start, time.monotonic_ns())

    def _cached(self, tgid: int) -> tuple[bool, str | None]:
        """(hit, command) from the cache, dropping an entry whose pid now names another process."""
        entry = self._cache.get(tgid)
        if entry is None:
            return False, None
        command, start, checked = entry
        now = time.monotonic_ns()
        if now - checked < self.revalidate_ns:
            return True, command
        cur = start_time(tgid, self.proc)
        if cur is not None and cur != start:
            del self._cache[tgid]  # the pid was reused (or the entry was made for a gone one)
            return False, None
        self._cache[tgid] = (command, start, now)
        return True, command

    def add(self, command: str, pid: int, cgroup_dir: str | None = None) -> None:
        """Register a command by its root pid and, when it has one, its cgroup directory."""
        self._roots[pid] = command
        if cgroup_dir:
            try:
                self._cgroups[cgroup_id(cgroup_dir)] = command
            except OSError:
                pass
        # A process cached as no command's may be this one's (started before its root was known);
        # every other answer stands: clearing them made a release call the exited processes of
        # other commands strays (their counts are looked up by tgid, after they are gone).
        self._cache = {t: e for t, e in self._cache.items() if e[0] is not None and t != pid}

    def remove(self, command: str, forget: Iterable[int] = ()) -> None:
        """Forget a command's root and cgroup; its processes' cached answers stay KEEP_S, less
        those of `forget` (processes that live on in no command: warm pool workers)."""
        for tgid in forget:
            if (entry := self._cache.get(tgid)) is not None and entry[0] == command:
                del self._cache[tgid]
        self._roots = {p: c for p, c in self._roots.items() if c != command}
        self._cgroups = {g: c for g, c in self._cgroups.items() if c != command}
        now = time.monotonic()
        self._ended[command] = now
        old = {c for c, t in self._ended.items() if now - t > self.KEEP_S}
        if old:
            self._cache = {t: e for t, e in self._cache.items() if e[0] not in old}
            for c in old:
                del self._ended[c]

    def command_of(self, ev: ProbeEvent) -> str | None:
        cg = getattr(ev, "cgroup", 0)
        if cg and cg in self._cgroups:
            # Kept per tgid too: the lossless counts are per tgid, and a region's reconciliation
            # asks by tgid alone, often after a short-lived child has exited.
            owner = self._cgroups[cg]
            entry = self._cache.get(ev.tgid)
            if entry is None or entry[0] != owner:
                self._remember(ev.tgid, owner)
            return owner
        hit, cached = self._cached(ev.tgid)
        if hit:
            return cached
        found = None
        pid: int | None = ev.tgid
        for _ in range(self.MAX_DEPTH):
            if pid is None or pid <= 1:
                break
            if pid in self._roots:
                found = self._roots[pid]
                break
            pid = parent_pid(pid, self.proc)
        start = start_time(ev.tgid, self.proc)
        if found is not None or start is not None:
            self._remember(ev.tgid, found, start)  # a gone outsider is not cached
        return found

    def is_stray(self, ev: ProbeEvent, owner: str | None) -> bool:
        """True when a region is held (`owner` is its command) and the event is not the owner's."""
        return owner is not None and self.command_of(ev) != owner
