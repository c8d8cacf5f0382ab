"""The region cores: a region's owner gets up to --region-cores cores near its device to itself, and
every other running command is fenced off them (its cpuset) until the region releases.

So are the warm pools' workers in no command (warming: a worker importing torch is seconds of CPU;
idle; retiring), which no command's cpuset reaches: their threads' affinity is narrowed off the
reserved cores, and given back once they are in a command (its cpuset fences them then) or no core
is reserved. Unfenced, the scheduler put them on the region cores first: the fence leaves those the
only idle ones."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Mapping

from krex_async import logs
from krex_async.daemon.model.command import CommandState
from krex_async.daemon.model.core import Core, Region
from krex_async.isolation.base import IsolationError
from krex_async.linux.procfs import start_time

log = logs.get("krex.region")


class CoreFence:
    def __init__(self, core: Core, active: Mapping[str, Region]) -> None:
        self.core = core
        # Regions.active: the regions whose groups are about to be frozen, and the owners of cores
        self.active = active
        self.reserved: dict[str, frozenset[int]] = {}  # region id -> its cores
        # pool workers fenced: pid -> (its start time, its affinity before)
        self.workers: dict[int, tuple[int | None, set[int]]] = {}

    def taken(self) -> frozenset[int]:
        return frozenset().union(*self.reserved.values()) if self.reserved else frozenset()

    def spare(self, r: Region) -> frozenset[int]:
        """Up to --region-cores cores near the device, never leaving the rest of the node none."""
        want = self.core.config.region_cores
        all_cpus = self.core.all_cpus
        taken = self.taken()
        near = sorted((self.core.device(r.device).cpus or all_cpus) - taken, reverse=True)
        chosen: list[int] = []
        for c in near:
            if len(chosen) == want:
                break
            if len(all_cpus - taken - frozenset(chosen) - {c}) >= 1:
                chosen.append(c)
        return frozenset(chosen)

    async def reserve(self, r: Region) -> None:
        """Give the owner's process its region cores and fence the other running commands off
        them; the time it took goes in the report (cores_s) whether or not it succeeded."""
        t = time.perf_counter()
        try:
            await self._reserve(r)
        finally:
            r.report.cores_s = time.perf_counter() - t

    async def _reserve(self, r: Region) -> None:
        cores = self.spare(r)
        if not cores:
            return
        r.cores = cores
        self.reserved[r.id] = cores
        r.report.cores = sorted(cores)
        assert r.command.group is not None
        await self.core.backend.set_cores(r.command.group, cores, pids=[r.pid], exclusive=True)
        await self.refence()

    async def refence(self, best_effort: bool = False) -> None:
        """Fence every running command that is not frozen off all reserved cores (or lift it).

        A failure raises (a region being entered is then refused), or with `best_effort` (a
        release lifting fences) is logged and the other commands are still done."""
        taken = self.taken()
        allowed = None if not taken else self.core.all_cpus - taken
        self.fence_workers(allowed)
        # groups a region is about to freeze (fenced meanwhile they would be written for nothing)
        freezing = {id(g) for x in self.active.values() for g in x.frozen}
        for cmd in self.core.commands.values():
            g = cmd.group
            if (
                cmd.state != CommandState.RUNNING
                or g is None
                or g.frozen
                or g.cores == allowed
                or id(g) in freezing
            ):
                continue
            owner = next((x for x in self.active.values() if x.command is cmd and x.cores), None)
            try:
                pids = [p for p in self.core.backend.pids(g) if owner is None or p != owner.pid]
                await self.core.backend.set_cores(g, allowed, pids=pids)
            except (IsolationError, OSError) as e:
                if not best_effort:
                    raise
                log.error("refence_failed", command=cmd.id, error=repr(e))
                continue
            g.cores = allowed

    def fence_workers(self, allowed: frozenset[int] | None) -> None:
        """Narrow the affinity of every thread of the pools' workers in no command to `allowed`
        (within what each had before); give it back to those now in a command or gone, and to
        all when `allowed` is None. A worker that refuses (gone, another user's under a daemon
        without the right) is left as it is."""
        free = (
            set() if allowed is None else {p for pool in self.core.pools.values() for p in pool.free_pids()}
        )
        for pid in [p for p in self.workers if p not in free]:
            start, before = self.workers.pop(pid)
            if start_time(pid) == start:  # not a process that took the pid of one gone since
                _set_affinity(pid, before)
        if allowed is None:
            return
        for pid in free:
            if pid not in self.workers:
                try:
                    self.workers[pid] = (start_time(pid), os.sched_getaffinity(pid))
                except OSError:
                    continue
            _set_affinity(pid, (self.workers[pid][1] & allowed) or set(allowed))

    def for_new(self) -> frozenset[int] | None:
        """The cores a command starting now may use: all but the reserved ones (None: no fence)."""
        taken = self.taken()
        return self.core.all_cpus - taken if taken else None

    async def restore(self, r: Region) -> None:
        """At release: the owner's process gets its cpuset back and the fences are lifted, each
        step on its own so one failure does not leave the rest fenced."""
        if self.reserved.pop(r.id, None) is None:
            return
        try:
            if r.command.group is not None and r.command.state == CommandState.RUNNING:
                await self.core.backend.set_cores(r.command.group, None, pids=[r.pid])
        except Exception as e:
            log.error("cores_restore_failed", region=r.id, error=repr(e))
        try:  # each other command on its own: one failure must not leave the rest fenced
            await self.refence(best_effort=True)
        except Exception as e:
            log.error("refence_failed", region=r.id, error=repr(e))


def _set_affinity(pid: int, cpus: set[int] | frozenset[int]) -> None:
    """Every thread of `pid` onto `cpus` (threads started later inherit it from their creator);
    one gone or refusing is skipped."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return
    for tid in tids:
        with contextlib.suppress(OSError, ValueError):
            os.sched_setaffinity(int(tid), cpus)
