"""A region's entry and its undoing: whom it holds and how, overlapped where that is safe (the
lock, the freeze, the quiesce, the fence, the settle: `Entry.isolate`), and the release that takes
each of those steps back (`Entry.release`). `Regions.run` (engine.py) calls the one at the region's
turn and the other in its `finally`; the steps' mechanisms live in policy.py, drain.py, fence.py and
clock.py, the exits a region waits for in exits.py.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

from krex_async import logs
from krex_async import protocol as P
from krex_async.daemon.model.command import Command, CommandState
from krex_async.daemon.model.core import Core, Region
from krex_async.daemon.regions.clock import Clock
from krex_async.daemon.regions.drain import Drain
from krex_async.daemon.regions.exits import Exits
from krex_async.daemon.regions.fence import CoreFence
from krex_async.daemon.regions.policy import HoldPolicy, Plan, d_state
from krex_async.isolation.base import Freeze, Group
from krex_async.runtime.quiesce import holds_gpu_file

log = logs.get("krex.region")


async def _undo(
    waits: Sequence[asyncio.Future[Any] | None], locks: Sequence[asyncio.Future[Any] | None]
) -> None:
    """An entry failed: `waits` cancelled, and every lock in flight landed (in the held set, or
    undone) before release runs, through any cancellation that comes meanwhile (re-raised after;
    LockPool.lock_many is bounded)."""
    cancelled = False
    for lock in locks:
        while lock is not None and not lock.done():
            try:
                await asyncio.shield(lock)
            except asyncio.CancelledError:
                cancelled = True
            except Exception:  # noqa: BLE001 (its own failure is the held set's to report)
                break
    for w in waits:
        if w is not None and not w.done():
            w.cancel()
    await asyncio.gather(*(w for w in waits if w is not None), return_exceptions=True)
    if cancelled:
        raise asyncio.CancelledError


class Entry:
    def __init__(
        self, core: Core, hold: HoldPolicy, cores: CoreFence, drain: Drain, clock: Clock, exits: Exits
    ) -> None:
        self.core = core
        self.hold = hold  # whom a region holds, and how: lock or freeze
        self.cores = cores  # the owners' region cores, the others fenced off
        self.drain = drain  # quiesce, and the drain check once frozen
        self.clock = clock  # clock settle before the grant
        self.exits = exits  # siblings exiting on the device: waited for first, given back at the release
        self.hung: dict[str, float] = {}  # commands a freeze failed on: id -> when

    def _targets(self, r: Region) -> list[Command]:
        """The commands held for this region: every other command on its device (or, with
        --freeze device-holders, those of them that hold a GPU device file)."""
        out = []
        holders_only = self.hold.who_on(self.core, r.device) == "device-holders"
        for cid in self.core.scheduler.siblings(r.device, r.command.id):
            cmd = self.core.commands.get(cid)
            if cmd is None or cmd.state != CommandState.RUNNING or cmd.group is None:
                continue
            if holders_only and not any(holds_gpu_file(p) for p in self.core.backend.pids(cmd.group)):
                continue
            out.append(cmd)
        return out

    async def isolate(self, r: Region) -> None:
        """Quiesce, freeze and fence, overlapped where that is safe:

        t0: Quiesce sent to the runtimes that have device work to synchronise (`_to_quiesce`);
            every other target frozen at once; the owner's cores reserved and the running
            commands fenced off them (unless the owner's own children must be frozen first:
            then after).
        t1: acks in (or --quiesce-timeout): the quiesced targets frozen, then the owner's children.
        t2: all frozen: the fencing finished, the drain check (the frozen processes read for GPU
            files, on the loop), then the clock settle (NVML, on a worker thread).
        Nothing runs on a worker thread while the loop freezes: a /proc reading or a settle on a
        thread beside the freeze makes the entry slower than the same work done on the loop
        afterwards (GIL hand-offs at each of the loop's syscalls; bench/RESULTS.md).
        Every task started here has finished before this returns or raises, so `release` never
        races a freeze still in flight.
        """
        rep = r.report
        backend = self.core.backend
        timeout = self.core.config.freeze_timeout
        pool = self.core.pools.get(r.device)
        quiet: asyncio.Future[float] | None = None
        if pool is not None:
            # No context creation on the device while it is held: none starts from now, and one
            # in flight (at most one per node) ends before the grant, waited for beside the freeze.
            quiet = asyncio.ensure_future(pool.quiesce())
            r.paused_pool = True
        held = r.held
        noted = self.exits.take(r)
        ahead = Plan("")  # the siblings locked while the exits are waited for
        ahead_workers: list[int] = []
        first: asyncio.Future[list[Command]] | None = None
        if noted:
            # Their locks are tried while the exits are waited for: one inside a CUDA call is waited
            # for (--lock-wait) beside the exits, not after them. Nothing is frozen, nor an open
            # acted on (select_ns), before that wait ends, or an exit it could let end would stop
            # where it is; the commands with a process among the exits are planned after it.
            exits = asyncio.ensure_future(self.exits.wait(r, noted))
            try:
                cmds = [
                    c
                    for c in self._targets(r)
                    if c.group is not None and noted.keys().isdisjoint(backend.pids(c.group))
                ]
                ahead = self._plan(r, cmds, set())
                ahead_workers = self._pool_workers(r, ahead.how, ahead.to_lock)
                if ahead.to_lock or ahead_workers:
                    locking = [c for c in cmds if c.id in ahead.to_lock]
                    first = asyncio.ensure_future(self._lock(r, locking, ahead.to_lock, ahead_workers))
                await exits
            except BaseException:
                if exits.cancelled() or not exits.done() or exits.exception() is not None:
                    r.exits_left = dict(noted)  # the exits not seen to end: the next region's (give_back)
                await _undo((exits, quiet), (first,))
                raise
        try:
            t_select = time.perf_counter()
            r.select_ns = time.monotonic_ns()  # before the reading: an open after it is caught
            targets = self._targets(r)
            r.targets = {c.id for c in targets}
            # A sibling still exiting after the wait is frozen, not locked: a lock does not stop an
            # exit, and the driver would free its GPU memory beside the timing; frozen, it ends after.
            unfinished = set(rep.exits_unfinished)
            exiting = {
                c.id
                for c in targets
                if unfinished and c.group is not None and unfinished & set(backend.pids(c.group))
            }
            plan = self._plan(r, targets, exiting)
            if plan.how == "lock":
                held.fallback(
                    {
                        cid: "still exiting after the wait for exits (--exit-wait): frozen, so that its exit "
                        "frees its GPU memory after"
                        for cid in exiting
                    }
                )
            locking = [c for c in targets if c.id in plan.to_lock]
            # (one locked while the exits were waited for stays locked, even with no GPU file left)
            freezing = [c for c in targets if c.id not in plan.to_lock and c.id not in ahead.to_lock]
            workers = self._pool_workers(r, plan.how, plan.to_lock)
            lock = first
            if first is None and (locking or workers):
                lock = asyncio.ensure_future(self._lock(r, locking, plan.to_lock, workers))
            elif first is not None:  # the GPU processes and workers found since, locked after the first
                # (not a worker adopted during the wait: locked twice, the driver refuses the second)
                covered = {p for pids in ahead.to_lock.values() for p in pids}
                covered |= {*ahead_workers, *held.locked_pids, *held.late}
                extra = {cid: [p for p in pids if p not in covered] for cid, pids in plan.to_lock.items()}
                extra = {cid: pids for cid, pids in extra.items() if pids}
                extra_workers = [p for p in workers if p not in covered]
                if extra or extra_workers:
                    cmds = [c for c in locking if c.id in extra]
                    lock = asyncio.ensure_future(self._lock_after(r, first, cmds, extra, extra_workers))
        except BaseException:
            await _undo((quiet,), (first,))
            raise
        # A locked sibling starts no GPU work and its queued work is verified by the owner: asking
        # its runtime to stop as well would only take its CPU (and wait on it, often in vain).
        asked = self.drain.to_ask(r, freezing)
        rep.select_s = time.perf_counter() - t_select
        rep.hold, rep.hold_why = (plan.how, plan.why) if targets else ("", "")
        if plan.why and self.hold.mode == "lock":  # asked for by name: each sibling says why not
            held.fallback({c.id: plan.why for c in freezing if self.drain.gpu_pids(c)})
        quiesced_cmds = {id(c) for c, _, _ in asked}
        todo = [c for c in freezing if c.group is not None and not c.group.frozen]
        held.mark_frozen((c.group for c in todo if c.group is not None), (c.id for c in freezing))
        todo = self._still_hung(r, todo)
        now = [c.group for c in todo if id(c) not in quiesced_cmds and c.group is not None]
        later = [c.group for c in todo if id(c) in quiesced_cmds and c.group is not None]
        own = r.command.group if r.request.freeze_own_children else None
        # An adopting interpreter only waits for its worker's status: freezing it for that would
        # move the worker (the owner, dozens of threads) into keep/, 20-100 ms on the H200.
        idle = r.command.adopters
        own_first = own is not None and any(p != r.pid and p not in idle for p in backend.pids(own))
        t0 = time.perf_counter()
        self.drain.send(r, asked)
        early = asyncio.ensure_future(self._freeze_some(r, now)) if now else None
        cores = None if own_first else asyncio.ensure_future(self.cores.reserve(r))
        lock2: asyncio.Future[list[Command]] | None = None
        try:
            if asked:
                pending = [f for f in r.acks.values() if not f.done()]
                if pending:
                    await asyncio.wait(pending, timeout=self.core.config.quiesce_timeout)
                self.drain.note_silent(r, asked)
            t1 = time.perf_counter()
            rep.quiesce_s = t1 - t0
            results = await self._freeze_some(r, later) if later else []
            if early is not None:
                results += await early
            if lock is not None:
                fallback = await asyncio.shield(lock)  # a lock in flight is never abandoned
                if fallback:  # frozen after all: no quiesce, the owner verifies the drain
                    groups = [c.group for c in fallback if c.group is not None and not c.group.frozen]
                    held.mark_frozen(groups, (c.id for c in fallback))
                    results += await self._freeze_some(r, groups)
            if own_first and own is not None:
                results.append(await backend.freeze(own, keep=frozenset({r.pid}), timeout=timeout))
                held.add_own(own)
            t2 = time.perf_counter()
            rep.freeze_s = t2 - t1
            held.publish_frozen()
            rep.frozen_pids = sum(x.pids for x in results)
            self.core.trace(
                "freeze",
                r,
                seconds=rep.freeze_s,
                groups=len(held.frozen),
                pids=rep.frozen_pids,
                locked=len(held.locked_pids),
            )
            if cores is None:
                cores = asyncio.ensure_future(self.cores.reserve(r))
            await cores
            if rep.unheld:  # fence the siblings that could not be held, now that they are known
                await self.cores.refence()
            if r.joins:  # commands that began running while the targets were being frozen
                await asyncio.gather(*r.joins, return_exceptions=True)
            rep.fenced = [
                cid
                for cid in self.core.scheduler.siblings(r.device, r.command.id)
                if not held.holds(cid)
                and (c := self.core.commands.get(cid)) is not None
                and c.state == CommandState.RUNNING
            ]
            rep.drain = self.drain.check(r, targets, results)
            await self.clock.settle(r)  # its NVML reads on a worker thread, while the loop idles
            if quiet is not None and pool is not None:
                # up to CONTEXT_TIMEOUT_S for a creation in flight: not for an owner already gone
                assert r.ended is not None
                either: list[asyncio.Future[Any]] = [quiet, r.ended]
                await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
                if not quiet.done():
                    quiet.cancel()
                    await asyncio.gather(quiet, return_exceptions=True)
                    return  # released at once: run() finds r.ended set
                rep.pool_wait_s = quiet.result()
                creator = pool.creator_pid()
                if creator is not None:  # a creation that outlived the wait: neither waited for nor held
                    held.unheld_worker(
                        creator, f"its context creation still in flight after {rep.pool_wait_s:.1f} s"
                    )
                # a context creation that was in flight has ended: that worker is held too
                more = [p for p in self._pool_workers(r, plan.how, plan.to_lock) if p not in workers]
                if more:
                    workers += more
                    lock2 = asyncio.ensure_future(self._lock(r, [], {}, more))
                    await asyncio.shield(lock2)
            await self._late_in_entry(r)
        except BaseException:
            tasks = [t for t in (early, cores, quiet) if t is not None]
            for task in tasks:
                if not task.done():
                    task.cancel()
            await _undo(tasks, (first, lock, lock2))
            raise

    def _plan(self, r: Region, cmds: list[Command], exiting: set[str]) -> Plan:
        """How `cmds` are held: by the lock (their GPU-holding processes), else frozen, as are
        those in `exiting` (a lock does not stop an exit)."""
        vendor = self.core.device(r.device).vendor
        lock = self.hold.how(vendor)[0] == "lock"
        return self.hold.plan(
            vendor, {c.id: self.drain.gpu_pids(c) if lock and c.id not in exiting else [] for c in cmds}
        )

    async def _late_in_entry(self, r: Region) -> None:
        """Siblings the probes saw open a GPU device during the entry (--freeze device-holders
        held only those holding one when the targets were chosen) are frozen before the grant; as
        they may have queued work before the freeze, the owner verifies the drain."""
        held = r.held
        if held.freezes:
            await asyncio.gather(*held.freezes)
        if not held.entry_late:
            return
        rep = r.report
        held.publish_frozen()
        rep.fenced = [cid for cid in rep.fenced if cid not in held.frozen_ids]
        if rep.drain in ("not-needed", "synced") and self.core.device(r.device).vendor != "cpu":
            rep.drain = "pending"

    def _pool_workers(self, r: Region, how: str, to_lock: dict[str, list[int]]) -> list[int]:
        """Under the lock: the device's pool workers in no command that hold a GPU device file
        (a context: idle, or retired and tearing it down), less any already locked."""
        pool = self.core.pools.get(r.device)
        if pool is None or how != "lock":
            return []
        taken = {p for pids in to_lock.values() for p in pids} | set(r.held.locked_pids) | set(r.held.late)
        # a warm worker's context is known: no /proc reading of its many fds on the entry path
        return [p for p, ctx in pool.outside() if p not in taken and (ctx or holds_gpu_file(p))]

    async def _lock(
        self, r: Region, cmds: list[Command], pids: dict[str, list[int]], workers: list[int] | None = None
    ) -> list[Command]:
        held = r.held
        assert self.hold.pool is not None
        fallback = await held.lock(
            self.hold.pool, self.hold.timeout, self.hold.wait, cmds, pids, workers or ()
        )
        # Their runtimes defer an exit to the release: a context torn down frees GPU memory
        # through the driver, which the lock does not stop (protocol.ExitHeld).
        locked = set(held.locked_pids)
        for c in cmds:
            for pid in pids[c.id]:
                send = c.runtimes.get(pid)
                if pid in locked and send is not None and send(P.Held(id=0, region=r.id)):
                    held.told_held(send)
        self.core.trace(
            "lock",
            r,
            seconds=r.report.lock_s,
            pids=len(held.locked_pids),
            fallback=len(fallback),
            late=len(held.late),
        )
        return fallback

    async def _lock_after(
        self,
        r: Region,
        first: asyncio.Future[list[Command]],
        cmds: list[Command],
        pids: dict[str, list[int]],
        workers: list[int],
    ) -> list[Command]:
        """The lock begun while the exits were waited for (`first`), then the processes and workers
        found to lock after that wait: both fallbacks."""
        fallback = await asyncio.shield(first)
        return fallback + await self._lock(r, cmds, pids, workers)

    async def _freeze_some(self, r: Region, groups: list[Group]) -> list[Freeze]:
        out = await r.held.freeze(self.core.backend, groups, self.core.config.freeze_timeout)
        for cid in r.report.unheld:
            self.hung[cid] = time.monotonic()
        return out

    def _still_hung(self, r: Region, todo: list[Command]) -> list[Command]:
        """`todo` less the commands a region could not freeze before and that still have a thread
        in uninterruptible sleep: each would cost this region a whole --freeze-timeout for the
        same answer. They are left unheld at once, the region tainted."""
        self.hung = {
            cid: t
            for cid, t in self.hung.items()
            if (c := self.core.commands.get(cid)) is not None and c.state == CommandState.RUNNING
        }
        out = []
        for c in todo:
            stuck = (
                d_state(self.core.backend.pids(c.group)) if c.id in self.hung and c.group is not None else []
            )
            if stuck and c.group is not None:
                r.held.drop(
                    c.group,
                    f"still in uninterruptible sleep, as when a freeze last failed "
                    f"(not tried again): {', '.join(stuck)}",
                )
            else:
                out.append(c)
        return out

    async def release(self, r: Region) -> None:
        """Undo every step, each in its own try so one failure does not skip the others."""
        held = r.held
        held.begin_release()
        await held.settle(self.core.config.freeze_timeout + 1.0)  # each undoes its own freeze
        if r.paused_pool and r.device in self.core.pools:
            self.core.pools[r.device].resume()
            r.paused_pool = False
        thawed = await held.thaw(self.core.backend)
        if thawed:
            self.core.trace("thaw", r, groups=thawed)
        # After the thaw: a process both locked and frozen (it opened a GPU during the region)
        # may need to run for the driver to unlock it.
        unlocked = await held.unlock(self.hold.pool)
        if unlocked:
            self.core.trace("unlock", r, seconds=r.report.unlock_s, pids=unlocked)
        self.exits.begin(r.report.exit_deferred)  # resumed now: their exits start here
        # the exit waiters' exits go now: the next region waits for them
        held.resume(lambda pid: self.exits.note_exiting(pid, r.device))
        self.exits.give_back(r)
        self.drain.refresh(r)
        await self.cores.restore(r)
