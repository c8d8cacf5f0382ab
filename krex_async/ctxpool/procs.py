"""The pool's view of its worker processes: who they run as, their memory, ending them and what a
command left behind in them, and latency summaries for status."""

from __future__ import annotations

import collections
import os
import re
from typing import Any

from krex_async import logs
from krex_async.linux import procfs
from krex_async.linux.procfs import memory as _rss_pss

log = logs.get("krex.pool")


def identity(uid: int | None, gid: int | None, groups: list[int] | None) -> tuple[int, int, list[int]]:
    """Who a process started with these spawn() arguments runs as (None: the daemon's own)."""
    return (
        os.getuid() if uid is None else uid,
        os.getgid() if gid is None else gid,
        sorted(os.getgroups() if groups is None else groups),
    )


def kill(pid: int) -> None:
    try:
        os.kill(pid, 9)
    except ProcessLookupError:
        pass


def kill_leftovers(pid: int) -> None:
    """SIGKILL what a command left behind in worker `pid`: its descendants and the members of its
    session (the worker is the command's session leader), never the worker itself. The daemon's
    kill of a command's tree would take the worker too, so it spares a worker that lives on."""
    parent: dict[int, int] = {}
    victims = set()
    for p in procfs.pids():
        if p != pid and (st := procfs.stat(p)) is not None:
            parent[p] = st.ppid
            if st.session == pid:
                victims.add(p)
    for p in parent:
        q, seen = p, 0
        while q in parent and seen < 512:
            q, seen = parent[q], seen + 1
            if q == pid:
                victims.add(p)
                break
    for p in victims:
        kill(p)


def memory(pid: int) -> dict[str, int | None]:
    got = _rss_pss(pid)
    return {"rss_bytes": got[0] if got else None, "pss_bytes": got[1] if got else None}


def summary(values: Any) -> dict[str, Any]:
    v = sorted(values)
    if not v:
        return {"n": 0, "p50": None, "p95": None}
    return {"n": len(v), "p50": v[(len(v) - 1) // 2], "p95": v[min(len(v) - 1, int(0.95 * len(v)))]}


def home_by_pool() -> bool:
    """Whether the pool moves a reused worker back to its own cgroups after a command, rather than
    the worker itself: a root daemon can, and a worker of another user cannot leave the command's
    cgroups (their common ancestor's cgroup.procs is root's). Only once the command is over, from
    cgroups read before any command ran in the worker: a request of the worker's own is never taken,
    as a command's code could make it to leave its command's cgroups."""
    return os.geteuid() == 0


def retire_class(reason: str) -> str:
    """A worker's reason to retire without its particulars (paths, pids, byte counts): a count's key."""
    return re.sub(r"'[^']*'|/\S*|\d+", "…", reason.split(":")[0]).strip()[:80]


class Retirements(collections.Counter[str]):
    """Workers retired, counted by reason class (retire_class); the last full reason of each class
    kept (`last`: which module, which path) and logged, so a count can be traced to its cause."""

    def __init__(self, device: str) -> None:
        super().__init__()
        self.device, self.last = device, dict[str, str]()

    ROUTINE = ("used up (--pool-max-uses)", "surplus")  # by design: counted, not logged

    def add(self, reason: str) -> None:
        key = retire_class(reason)
        self[key] += 1
        self.last[key] = reason[:500]
        if key not in self.ROUTINE:
            log.info("pool_worker_retired", device=self.device, reason=reason[:500])
