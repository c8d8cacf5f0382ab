"""The region cores: a region's owner gets up to --region-cores cores near its device to itself, and
every other running command is fenced off them (its cpuset) until the region releases.

So are the warm pools' workers in no command that are not idle (warming: a worker importing torch is
seconds of CPU; resetting after a command; retired and tearing down), which no command's cpuset
reaches: each of their threads is kept off the reserved cores, from the entry or from when the pool
starts, retires or takes one back (Pool.on_unsettled), and given the daemon's CPUs back (those a
worker starts with) at the release that leaves no core reserved; one that became a region's owner
meanwhile is left to its region cores. The fence leaves the region cores the only idle ones, where
the scheduler would otherwise put such a worker."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

from krex_async import logs
from krex_async.ctxpool.pool import Pool
from krex_async.daemon.model.command import CommandState
from krex_async.daemon.model.core import Core, Region
from krex_async.isolation.base import IsolationError
from krex_async.isolation.signal import set_affinity
from krex_async.linux.procfs import start_time

log = logs.get("krex.region")


@dataclass
class Fenced:
    """A pool worker whose threads the fence keeps off the reserved cores."""

    start: int | None  # its start time: a reused pid is not it
    applied: frozenset[int] | None = None  # what its threads were set to last


class CoreFence:
    def __init__(self, core: Core, active: Mapping[str, Region]) -> None:
        self.core = core
        # Regions.active: the regions whose groups are about to be frozen, and the owners of cores
        self.active = active
        self.reserved: dict[str, frozenset[int]] = {}  # region id -> its cores
        self.workers: dict[int, Fenced] = {}  # pool workers fenced off the reserved cores

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
        """Put the threads of the pools' unsettled workers (_unsettled), and of every worker fenced
        before (now idle, or in a command: fenced as it is), on `allowed`, less a region's owner
        (its region cores are its own); with `allowed` None, give each the daemon's CPUs back,
        those a worker starts with (what it had in a command may have been that command's fence)."""
        if allowed is None:
            for pid, w in self.workers.items():
                if start_time(pid) == w.start:  # not a pid reused since
                    _set_affinity(pid, self.core.all_cpus)
            self.workers.clear()
            return
        owners = {x.pid for x in self.active.values() if x.id in self.reserved}
        unsettled = {p for pool in self.core.pools.values() for p in _unsettled(pool)}
        for pid in unsettled | set(self.workers):
            if pid not in owners:
                self._narrow(pid, allowed)

    def fence_worker(self, pid: int) -> None:
        """Pool.on_unsettled: a worker started, retired or back from a command while cores are
        reserved is fenced off them at once (refence would not see it before the next region),
        set again even if fenced before (its command may have changed its affinity). Never raises
        into the pool."""
        try:
            if taken := self.taken():
                if (w := self.workers.get(pid)) is not None:
                    w.applied = None
                self._narrow(pid, self.core.all_cpus - taken)
        except Exception:
            log.exception("worker_fence_failed", pid=pid)

    def _narrow(self, pid: int, allowed: frozenset[int]) -> None:
        w = self.workers.get(pid)
        if w is not None and start_time(pid) != w.start:  # gone, and its pid taken since
            del self.workers[pid]
            return
        if w is None:
            if (start := start_time(pid)) is None:
                return  # gone
            w = self.workers[pid] = Fenced(start)
        if w.applied != allowed:
            _set_affinity(pid, allowed)
            w.applied = allowed

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


def _unsettled(pool: Pool) -> set[int]:
    """A pool's workers in no command and not idle: warming (importing, creating a context),
    resetting after a command, or retired and not yet gone. An idle one sleeps."""
    creator = pool.creator_pid()
    return {p for p, _ in pool.outside()} - set(pool.idle_pids()) | ({creator} if creator else set())


def _set_affinity(pid: int, cpus: frozenset[int]) -> None:
    """A worker's threads onto `cpus`; those that refuse are skipped, and logged."""
    if skipped := set_affinity(pid, cpus):
        log.info("worker_affinity_skipped", pid=pid, threads=skipped[:4], n=len(skipped))
