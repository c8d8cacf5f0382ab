"""A region's life under the daemon: queue, isolate, grant, hold, release (README.md, The region API).

Each region runs as one task, `Regions.run()`, whose `finally` undoes every isolation step it took, so
no path out of a region (release, owner death, expiry, shutdown, a failed freeze, a cancelled task)
leaves a process frozen or a core fenced. Steps and their cost:

    wait     queued behind other regions on the device (FIFO)
    quiesce  ask frozen siblings' in-command runtimes to stop at a bytecode boundary and synchronise
             (drain.py)
    hold     lock the siblings' CUDA processes through the driver (--hold lock) and freeze the rest
             (every other command on the device, or those holding a GPU file: hold.py), and the
             owner's other processes; a sibling that cannot be frozen is left running, fenced, and
             the region tainted
    cores    give the owner's process its region cores; fence every other running command off them
             (cores.py)
    settle   the drain check, and wait for a clock held down by the power cap (clock.py)
    grant    the owner runs its timed loop
    exit     thaw, restore cpusets, resume quiesced runtimes, promote the next region
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from krex_async import logs
from krex_async import protocol as P
from krex_async.daemon.clock import Clock
from krex_async.daemon.commands import Command, CommandState
from krex_async.daemon.core import Core, Region
from krex_async.daemon.cores import Cores
from krex_async.daemon.drain import Drain
from krex_async.daemon.hold import (
    Hold,
    d_state,
    freeze_tolerant,
    lock_commands,
    unheld,
    wait_exits,
)
from krex_async.isolation.base import Freeze, Group, IsolationError
from krex_async.isolation.cudalock import start_time
from krex_async.linux.procfs import exiting_in_kernel
from krex_async.probes.hold import HOLD
from krex_async.runtime.quiesce import holds_gpu_file

if TYPE_CHECKING:
    from krex_async.probes.base import ProbeEvent

log = logs.get("krex.region")
EXITING_KEPT_S = 60.0  # an exiting process no region waited for (or whose exit never ends) is forgotten


class Regions:
    def __init__(self, core: Core) -> None:
        self.core = core
        self.active: dict[str, Region] = {}  # every region from request to release
        self.cores = Cores(core, self.active)  # the owners' region cores, the others fenced off
        self.drain = Drain(core, self.active)  # quiesce, and the drain check once frozen
        self.clock = Clock(core)  # clock settle and warm-up before the grant
        cfg = core.config
        self.hold = Hold(cfg.hold, cfg.freeze, cfg.state_dir, cfg.lock_timeout, cfg.lock_wait)
        self.hung: dict[str, float] = {}  # commands a freeze failed on: id -> when
        # processes exiting with a GPU file (ExitHeld: at once, or at the release of the region
        # their exit waited for): the next region on that device waits for them to be gone, or
        # they would be locked mid-exit and tear their context down beside its timing
        self.exiting: dict[int, tuple[str, float, int | None]] = {}  # pid -> (device, when, start)

    def create(
        self,
        cmd: Command,
        req: P.RegionEnter,
        pid: int,
        send: Callable[[P.Msg], bool],
    ) -> Region:
        rid = f"{cmd.id}.{len(cmd.regions) + 1}"
        report = P.RegionReport(
            region=rid,
            name=req.name,
            device=cmd.device_key or "none",
            pid=pid,
            policy=self.core.scheduler.policy.value,
            requested_at=time.time(),
        )
        cmd.regions.append(report)
        loop = asyncio.get_running_loop()
        r = Region(
            id=rid,
            command=cmd,
            device=cmd.device_key or "none",
            pid=pid,
            send=send,
            req_id=req.id,
            request=req,
            report=report,
            turn=loop.create_future(),
            ended=loop.create_future(),
        )
        self.active[rid] = r
        r.task = loop.create_task(self.run(r), name=f"region-{rid}")
        self.core.track(r.task)
        return r

    def by_owner_pid(self, cmd: Command, pid: int) -> Region | None:
        return next((r for r in self.active.values() if r.command is cmd and r.pid == pid), None)

    def holder_on(self, device: str) -> Region | None:
        rid = self.core.scheduler.holder(device)
        return self.active.get(rid) if rid else None

    # ------------------------------------------------------------------------------ lifecycle

    async def run(self, r: Region) -> None:
        sched = self.core.scheduler
        rep = r.report
        assert r.turn is not None and r.ended is not None
        log_ = log.bind(region=r.id, command=r.command.id, device=r.device)
        granted = False
        try:
            if sched.request_region(r.id, r.command.id, r.device):
                r.turn.set_result(None)
            else:
                self.core.trace("region_queued", r)
            waiters: list[asyncio.Future[object]] = [r.turn, r.ended]  # type: ignore[list-item]
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
            if r.ended.done():  # withdrawn while queued (owner died, shutdown)
                rep.outcome = r.ended.result()
                return
            t_turn = time.perf_counter()
            rep.wait_s = t_turn - r.t_request
            # The probes' threads hold off from the turn to the grant (probes/hold.py): each of
            # their GIL hand-offs would cost the entry more than their work.
            with HOLD.held() if self.core.attributor is not None else contextlib.nullcontext():
                if sched.isolates():
                    await self._isolate(r)
                rep.enter_s = time.perf_counter() - r.t_request
                rep.outcome = "held"
                granted = True
                if self.core.attributor is not None:
                    self.core.attributor.region_granted(r)
                self.core.metrics.region_entered(
                    r.device, rep.enter_s, rep.freeze_s, rep.cores_s, rep.quiesce_s
                )
                t_held = time.perf_counter()
                r.send(
                    P.RegionGranted(
                        id=r.req_id,
                        report=rep,
                        drain_timeout=self.core.config.drain_timeout,
                        drain_window=self.core.config.drain_window,
                        warm_ms=self.clock.warm_ms(r),
                    )
                )
            if self.core.attributor is not None:
                self.core.attributor.counts_snapshot(r)
            self.core.trace(
                "region_grant", r, enter_s=rep.enter_s, frozen=rep.frozen, pool_wait_s=rep.pool_wait_s
            )
            timer = asyncio.get_running_loop().call_later(self.core.config.region_timeout, r.end, "expired")
            try:
                reason = await asyncio.shield(r.ended)
            finally:
                timer.cancel()
            rep.held_s = time.perf_counter() - t_held
            rep.outcome = reason
        except (IsolationError, OSError) as e:
            # FreezeError, and the backend's other documented failures while isolating (a cgroup
            # or cpuset write refused, the intent record unwritable): the owner must get its
            # answer, not wait forever on a region whose task died
            if granted:
                raise
            rep.outcome = "refused"
            rep.error = str(e)
            log_.warning("region_refused", error=str(e))
        except Exception as e:  # a bug while isolating: released below, and the owner told so
            if granted:
                raise
            rep.outcome = "refused"
            rep.error = f"internal error while isolating: {e!r}"
            log_.exception("region_entry_failed")
        except asyncio.CancelledError:
            rep.outcome = rep.outcome if rep.outcome not in ("open", "held") else "shutdown"
            raise
        finally:
            t_exit = time.perf_counter()
            if self.core.attributor is not None:
                # Close the stray window before anything thaws: driver calls of the siblings after
                # the release are theirs to make. Late stream events are covered by the counts.
                try:
                    self.core.attributor.region_released(r)
                except Exception as e:  # the probes' reading failed: what they saw is unknown
                    rep.tainted = True
                    rep.taint.append(f"probe reading failed at the release: {e!r}")
                    log_.exception("region_probe_release_failed")
            await asyncio.shield(self._release(r))
            rep.exit_s = time.perf_counter() - t_exit
            self.active.pop(r.id, None)
            nxt = sched.release_region(r.id)
            if nxt and nxt in self.active:
                turn = self.active[nxt].turn
                if turn is not None and not turn.done():
                    turn.set_result(None)
            self.core.metrics.region_released(r.device, rep.held_s, rep.outcome, rep.drain, granted=granted)
            self.core.metrics.strays(r.device, rep.strays)
            self._tell_owner(r, granted)
            self.core.trace("region_release", r, outcome=rep.outcome, held_s=rep.held_s)
            log_.info(
                "region",
                name=rep.name,
                outcome=rep.outcome,
                wait_s=round(rep.wait_s, 6),
                quiesce_s=round(rep.quiesce_s, 6),
                freeze_s=round(rep.freeze_s, 6),
                cores_s=round(rep.cores_s, 6),
                enter_s=round(rep.enter_s, 6),
                held_s=round(rep.held_s, 6),
                exit_s=round(rep.exit_s, 6),
                frozen=len(rep.frozen),
                cores=rep.cores,
                drain=rep.drain,
            )

    def _tell_owner(self, r: Region, granted: bool) -> None:
        rep = r.report
        if rep.outcome == "refused":
            r.send(P.Error(id=r.req_id, code="region_refused", message=rep.error))
        elif rep.outcome == "expired":
            r.send(P.RegionRevoked(id=r.req_id, report=rep))
        elif rep.outcome == "released":
            r.send(P.RegionReleased(id=r.exit_id if r.exit_id is not None else r.req_id, report=rep))
        elif not granted and rep.outcome == "shutdown":
            r.send(P.Error(id=r.req_id, code="shutdown", message="the daemon is shutting down"))
        elif granted:
            r.send(P.RegionRevoked(id=r.req_id, report=rep))

    # ------------------------------------------------------------------------------ isolation

    def _targets(self, r: Region) -> list[Command]:
        """The commands held for this region: every other command on its device (or, with
        --freeze device-holders, those of them that hold a GPU device file)."""
        out = []
        holders_only = self._who(r) == "device-holders"
        for cid in self.core.scheduler.siblings(r.device, r.command.id):
            cmd = self.core.commands.get(cid)
            if cmd is None or cmd.state != CommandState.RUNNING or cmd.group is None:
                continue
            if holders_only and not any(holds_gpu_file(p) for p in self.core.backend.pids(cmd.group)):
                continue
            out.append(cmd)
        return out

    def hold_status(self) -> dict[str, object]:
        """For `krex status`: the hold's mode and lock availability, and per device how and whom
        a region there would hold now (and why not by the lock)."""
        st: dict[str, object] = dict(self.hold.status())
        probes = self.core.attributor is not None
        st["devices"] = {
            d.key: {
                "hold": (how := self.hold.how(d.vendor))[0],
                "why": how[1],
                "freeze": self.hold.who(d.vendor, probes),
            }
            for d in self.core.devices
        }
        return st

    def _who(self, r: Region) -> str:
        return self.hold.who(self.core.device(r.device).vendor, self.core.attributor is not None)

    async def _isolate(self, r: Region) -> None:
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
        Every task started here has finished before this returns or raises, so `_release` never
        races a freeze still in flight.
        """
        rep = r.report
        backend = self.core.backend
        timeout = self.core.config.freeze_timeout
        await self._exits(r)
        pool = self.core.pools.get(r.device)
        quiet: asyncio.Future[float] | None = None
        if pool is not None:
            # No context creation on the device while it is held: none starts from now, and one
            # in flight (at most one per node) ends before the grant, waited for beside the freeze.
            quiet = asyncio.ensure_future(pool.quiesce())
            r.paused_pool = True
        t_select = time.perf_counter()
        r.select_ns = time.monotonic_ns()  # before the reading: an open after it is caught
        targets = self._targets(r)
        r.targets = {c.id for c in targets}
        # A sibling still exiting after --lock-wait is frozen, not locked: a lock does not stop an
        # exit, and the driver would free its GPU memory beside the timing; frozen, it ends after.
        unfinished = set(rep.exits_unfinished)
        exiting = {
            c.id
            for c in targets
            if unfinished and c.group is not None and unfinished & set(backend.pids(c.group))
        }
        plan = self.hold.plan(
            self.core.device(r.device).vendor,
            {c.id: [] if c.id in exiting else self.drain.gpu_pids(c) for c in targets}
            if self.hold.how(self.core.device(r.device).vendor)[0] == "lock"
            else {c.id: [] for c in targets},
        )
        if plan.how == "lock":
            rep.hold_fallback.update(
                {
                    cid: "exiting for over --lock-wait: frozen, so that its exit frees its GPU memory after"
                    for cid in exiting
                }
            )
        locking = [c for c in targets if c.id in plan.to_lock]
        freezing = [c for c in targets if c.id not in plan.to_lock]
        workers = self._pool_workers(r, plan.how, plan.to_lock)
        # A locked sibling starts no GPU work and its queued work is verified by the owner: asking
        # its runtime to stop as well would only take its CPU (and wait on it, often in vain).
        asked = self.drain.to_ask(r, freezing)
        rep.select_s = time.perf_counter() - t_select
        rep.hold, rep.hold_why = (plan.how, plan.why) if targets else ("", "")
        if plan.why and self.hold.mode == "lock":  # asked for by name: each sibling says why not
            rep.hold_fallback.update({c.id: plan.why for c in freezing if self.drain.gpu_pids(c)})
        quiesced_cmds = {id(c) for c, _, _ in asked}
        todo = [c for c in freezing if c.group is not None and not c.group.frozen]
        # Mark before freezing: a failure part-way still thaws every one of them in _release.
        r.frozen.extend(c.group for c in todo if c.group is not None)
        r.frozen_ids.extend(c.id for c in freezing)
        todo = self._still_hung(r, todo)
        now = [c.group for c in todo if id(c) not in quiesced_cmds and c.group is not None]
        later = [c.group for c in todo if id(c) in quiesced_cmds and c.group is not None]
        own = r.command.group if r.request.freeze_own_children else None
        # An adopting interpreter only waits for its worker's status: freezing it for that would
        # move the worker (the owner, dozens of threads) into keep/, 20-100 ms on the H200.
        idle = r.command.adopters
        own_first = own is not None and any(p != r.pid and p not in idle for p in backend.pids(own))
        t0 = time.perf_counter()
        lock = (
            asyncio.ensure_future(self._lock(r, locking, plan.to_lock, workers))
            if locking or workers
            else None
        )
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
                    r.frozen.extend(groups)
                    r.frozen_ids.extend(c.id for c in fallback)
                    results += await self._freeze_some(r, groups)
            if own_first and own is not None:
                results.append(await backend.freeze(own, keep=frozenset({r.pid}), timeout=timeout))
                r.frozen.append(own)
            t2 = time.perf_counter()
            rep.freeze_s = t2 - t1
            rep.frozen = list(r.frozen_ids)
            rep.frozen_pids = sum(x.pids for x in results)
            self.core.trace(
                "freeze",
                r,
                seconds=rep.freeze_s,
                groups=len(r.frozen),
                pids=rep.frozen_pids,
                locked=len(r.locked_pids),
            )
            if cores is None:
                cores = asyncio.ensure_future(self.cores.reserve(r))
            await cores
            if rep.unheld:  # fence the siblings that could not be held, now that they are known
                await self.cores.refence()
            if r.joins:  # commands that began running while the targets were being frozen
                await asyncio.gather(*r.joins, return_exceptions=True)
            held = set(r.frozen_ids) | set(r.locked_ids)
            rep.fenced = [
                cid
                for cid in self.core.scheduler.siblings(r.device, r.command.id)
                if cid not in held
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
                    rep.pool_unheld[creator] = (
                        f"its context creation still in flight after {rep.pool_wait_s:.1f} s"
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
            # never cancelled: a lock in flight must land in r.locked_pids, or be undone, before
            # _release runs (LockPool.lock_many is bounded)
            await asyncio.gather(*tasks, *(x for x in (lock, lock2) if x is not None), return_exceptions=True)
            raise

    async def _late_in_entry(self, r: Region) -> None:
        """Siblings the probes saw open a GPU device during the entry (--freeze device-holders
        held only those holding one when the targets were chosen) are frozen before the grant; as
        they may have queued work before the freeze, the owner verifies the drain."""
        if r.freezes:
            await asyncio.gather(*r.freezes)
        if not r.entry_late:
            return
        rep = r.report
        rep.frozen = list(r.frozen_ids)
        rep.fenced = [cid for cid in rep.fenced if cid not in r.frozen_ids]
        if rep.drain in ("not-needed", "synced") and self.core.device(r.device).vendor != "cpu":
            rep.drain = "pending"

    def note_exiting(self, pid: int, device: str) -> None:
        """`pid` is exiting on `device` now: the next region there waits for it (_exits). Entries
        no region consumed within EXITING_KEPT_S are dropped."""
        now = time.monotonic()
        self.exiting = {p: v for p, v in self.exiting.items() if now - v[1] < EXITING_KEPT_S}
        self.exiting[pid] = (device, now, start_time(pid))

    @staticmethod
    def _still_exiting(pid: int, entry: tuple[str, float, int | None], now: float) -> bool:
        """An `exiting` entry still stands: noted less than EXITING_KEPT_S ago, and the pid is
        the same process (its start time), not a reused one."""
        return now - entry[1] < EXITING_KEPT_S and start_time(pid) == entry[2]

    async def _exits(self, r: Region) -> None:
        """Wait (--exit-wait, default --lock-wait) for the siblings on r's device that are exiting
        (Daemon.exit_held): their exit was deferred to an earlier region's end, or began with none
        on the device; they are tearing their GPU state down now. Those still in user space after
        that are left unfinished (frozen for the region, _isolate); one already in the kernel's exit
        cannot be frozen, so it is waited for up to the longer of --exit-wait and --lock-wait."""
        now = time.monotonic()
        mine = [p for p, e in self.exiting.items() if e[0] == r.device and self._still_exiting(p, e, now)]
        noted = {p: self.exiting[p] for p in mine}
        self.exiting = {
            p: v for p, v in self.exiting.items() if v[0] != r.device and now - v[1] < EXITING_KEPT_S
        }
        if mine:
            cfg = self.core.config
            limit = cfg.lock_wait if cfg.exit_wait < 0 else cfg.exit_wait
            t0 = time.perf_counter()
            done = await wait_exits(mine, limit)
            past = [p for p in mine if p not in done and exiting_in_kernel(p)]
            if past:
                left = max(limit, cfg.lock_wait) - (time.perf_counter() - t0)
                done += await wait_exits(past, max(0.0, left))
            r.report.exits_wait_s = time.perf_counter() - t0
            r.report.exits_waited = done
            r.report.exits_unfinished = [p for p in mine if p not in done]
            r.exits_left = {p: noted[p] for p in r.report.exits_unfinished}

    def _pool_workers(self, r: Region, how: str, to_lock: dict[str, list[int]]) -> list[int]:
        """Under the lock: the device's pool workers in no command that hold a GPU device file
        (a context: idle, or retired and tearing it down), less any already locked."""
        pool = self.core.pools.get(r.device)
        if pool is None or how != "lock":
            return []
        taken = {p for pids in to_lock.values() for p in pids} | set(r.locked_pids) | set(r.late)
        # a warm worker's context is known: no /proc reading of its many fds on the entry path
        return [p for p, ctx in pool.outside() if p not in taken and (ctx or holds_gpu_file(p))]

    async def _lock(
        self, r: Region, cmds: list[Command], pids: dict[str, list[int]], workers: list[int] | None = None
    ) -> list[Command]:
        fallback = await lock_commands(self.hold, r, cmds, pids, workers or ())
        # Their runtimes defer an exit to the release: a context torn down frees GPU memory
        # through the driver, which the lock does not stop (protocol.ExitHeld).
        locked = set(r.locked_pids)
        for c in cmds:
            for pid in pids[c.id]:
                send = c.runtimes.get(pid)
                if pid in locked and send is not None and send(P.Held(id=0, region=r.id)):
                    r.held_runtimes.append(send)
        self.core.trace(
            "lock",
            r,
            seconds=r.report.lock_s,
            pids=len(r.locked_pids),
            fallback=len(fallback),
            late=len(r.late),
        )
        return fallback

    async def _freeze_some(self, r: Region, groups: list[Group]) -> list[Freeze]:
        out = await freeze_tolerant(self.core.backend, r, groups, self.core.config.freeze_timeout)
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
                unheld(
                    r,
                    c.group,
                    f"still in uninterruptible sleep, as when a freeze last failed "
                    f"(not tried again): {', '.join(stuck)}",
                )
            else:
                out.append(c)
        return out

    async def _release(self, r: Region) -> None:
        """Undo every step, each in its own try so one failure does not skip the others."""
        backend = self.core.backend
        r.releasing = True
        if r.freezes:  # each bounded by --freeze-timeout; releasing, each undoes its own freeze
            await asyncio.wait(r.freezes, timeout=self.core.config.freeze_timeout + 1.0)
        if r.paused_pool and r.device in self.core.pools:
            self.core.pools[r.device].resume()
            r.paused_pool = False
        for g in r.frozen:
            try:
                await backend.thaw(g)
            except Exception as e:  # a vanished group thaws as a no-op; anything else is logged
                log.error("thaw_failed", region=r.id, group=g.name, error=repr(e))
        if r.frozen:
            self.core.trace("thaw", r, groups=len(r.frozen))
        r.frozen.clear()
        # After the thaw: a process both locked and frozen (it opened a GPU during the region)
        # may need to run for the driver to unlock it.
        if r.locked_pids and self.hold.pool is not None:
            try:
                r.report.unlock_s, errors = await self.hold.pool.unlock_many(list(r.locked_pids))
                self.core.trace("unlock", r, seconds=r.report.unlock_s, pids=len(r.locked_pids))
                for pid, err in errors.items():  # a locked process that died meanwhile among them
                    log.info("unlock_refused", region=r.id, pid=pid, error=err)
            except Exception as e:
                log.error("unlock_failed", region=r.id, error=repr(e))
            r.locked_pids.clear()
        for send in (*r.quiesced, *r.held_runtimes):
            send(P.Resume(id=0, region=r.id))
        r.quiesced.clear()
        r.held_runtimes.clear()
        for pid, send in r.exit_waiters.items():  # their exits go now: the next region waits for them
            self.note_exiting(pid, r.device)
            send(P.Resume(id=0, region=""))
        r.exit_waiters.clear()
        # Frozen mid-exit, they go on exiting: the next region finds them so, as first noted (an
        # exit that never ends is dropped EXITING_KEPT_S after; a pid reused meanwhile is not one).
        now = time.monotonic()
        self.exiting.update({p: e for p, e in r.exits_left.items() if self._still_exiting(p, e, now)})
        r.exits_left.clear()
        self.drain.refresh(r)
        await self.cores.restore(r)

    def freeze_late(self, r: Region, ev: ProbeEvent) -> None:
        """--freeze device-holders, or a sibling held by the lock: a sibling process that opened a
        GPU device since the region chose whom to hold (its entry included) is frozen with its
        command as soon as the probes see the open (an open during the region is a stray)."""
        if r.report.outcome not in ("open", "held") or r.select_ns is None or ev.ts_ns < r.select_ns:
            return
        assert self.core.attributor is not None
        cmd = self.core.attributor.command_of(ev)
        if (
            cmd is None
            or cmd is r.command
            or cmd.device_key != r.device
            or cmd.group is None
            or cmd.group.frozen
        ):
            return
        if r.report.outcome == "open" and cmd.id in r.targets:
            return  # the entry holds it already (frozen, or its lock under way)
        if self._who(r) != "device-holders" and cmd.id not in r.locked_ids:
            return
        late = r.late.get(ev.tgid)
        if late is not None and late.outcome == "locked":
            return  # locked as its CUDA call ended: that call's driver calls are its last
        self.core.track(asyncio.get_running_loop().create_task(self._freeze_into(r, cmd, cmd.group, "late")))

    def current_on(self, device: str) -> Region | None:
        """The region isolating or held on `device` that a command may still join."""
        r = self.holder_on(device)
        if r is None or r.releasing or r.report.outcome not in ("open", "held"):
            return None
        return r

    async def join(self, cmd: Command, admitted: Region | None) -> None:
        """Reconcile a command that has just begun running with the region now on its device.

        Spawning awaits (the group is created, cores set), and a region may begin or end meanwhile:
        a command started frozen for a region that has since released is thawed here, and one that
        started unfrozen after a region took its targets is frozen into it before the grant (or at
        once, if the region is already held). Either way no command stays frozen without a region
        to thaw it, and none runs through a region it should be frozen for."""
        group = cmd.group
        if group is None or cmd.device_key is None:
            return
        current = self.current_on(cmd.device_key)
        if admitted is not None and admitted is current:
            self._add_frozen(current, cmd, group)
            return
        if admitted is not None:
            await self.core.backend.thaw(group)
        if current is None or cmd.id in current.frozen_ids or not self._freezes_starts(current.device):
            return
        task = asyncio.get_running_loop().create_task(self._freeze_into(current, cmd, group, "join"))
        current.joins.append(task)
        await task

    def _add_frozen(self, r: Region, cmd: Command, group: Group) -> None:
        r.frozen.append(group)
        r.frozen_ids.append(cmd.id)
        r.report.frozen.append(cmd.id)

    async def _freeze_into(self, r: Region, cmd: Command, group: Group, why: str) -> None:
        """Freeze a command after the region froze its targets (`why`: "join", a command that
        began running meanwhile; "late", a device holder the probes saw): into the region while
        it is still current, else undone at once."""
        # a burst of GPU opens (a CUDA initialisation opens several files) freezes it once
        if cmd.id in r.freezing or cmd.id in r.frozen_ids or r.releasing:
            return
        r.freezing.add(cmd.id)
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        r.freezes.add(done)
        try:
            try:
                await self.core.backend.freeze(group, timeout=self.core.config.freeze_timeout)
            except (IsolationError, OSError) as e:  # FreezeError included: the backend undid it
                log.warning(f"{why}_freeze_failed", region=r.id, command=cmd.id, error=str(e))
                return
            finally:
                r.freezing.discard(cmd.id)
            if self.current_on(r.device) is r:
                self._add_frozen(r, cmd, group)
                if r.report.outcome == "open" and why == "late":
                    r.entry_late.append(cmd.id)
                self.core.trace("freeze", r, command=cmd.id, late=True)
                return
            try:  # the region began releasing while this one froze (and waits for it): undo now
                await self.core.backend.thaw(group)
            except Exception as e:  # noqa: BLE001 - logged: nothing else would thaw it
                log.error("thaw_failed", region=r.id, group=group.name, error=repr(e))
        finally:
            r.freezes.discard(done)
            done.set_result(None)

    async def hold_arrival(self, cmd: Command, worker: int) -> None:
        """A command about to gain the warm pool worker `worker` (reserved for it) mid-region (an
        adoption: the worker brings a context, with no open the probes could see) while the
        region does not hold the command already (device-holders left it running, or the lock
        held only its other processes). Nothing to do when that worker is locked into the region
        (it runs on until its first CUDA call); else the command is frozen into the region first,
        as an open of a GPU device would have it, and the adoption waits for the region's end."""
        if cmd.group is None or cmd.device_key is None:
            return
        r = self.current_on(cmd.device_key)
        if r is None or r.command is cmd or cmd.group.frozen or cmd.id in r.frozen_ids:
            return
        if self._who(r) != "device-holders" and cmd.id not in r.locked_ids:
            return  # --freeze all: a running command is frozen, or locked, as a target already
        if worker in r.locked_pids:
            return
        await self._freeze_into(r, cmd, cmd.group, "adopt")

    def workers_held(self, r: Region) -> bool:
        """Whether every idle warm worker of the region's device is locked into it (so one taken
        mid-region by a command the region does not hold starts no GPU work); with none idle,
        nothing can be handed over (adopt() and launch() take only an idle one, at once)."""
        pool = self.core.pools.get(r.device)
        return pool is None or set(pool.idle_pids()) <= set(r.locked_pids)

    def holds_starts(self, device: str, cmd: Command) -> bool:
        """Whether a warm worker may not be handed a command starting now on `device`: a region
        there holds GPU holders only (device-holders) and would not hold the worker's context."""
        r = self.current_on(device)
        return (
            r is not None
            and r.command is not cmd
            and self._who(r) == "device-holders"
            and not self.workers_held(r)
        )

    def admit_frozen(self, cmd: Command) -> Region | None:
        """A command starting on a device whose region is held lands frozen: the region it joins.
        Under --freeze device-holders it holds no GPU file yet, so it starts (fenced off the
        region cores) and is frozen if it opens one during the region."""
        if cmd.device is None or not self._freezes_starts(cmd.device.key):
            return None
        return self.current_on(cmd.device.key)

    def _freezes_starts(self, device: str) -> bool:
        """Whether commands that start during a region are frozen into it (not under the shared
        or command policies, nor --freeze device-holders, which freezes on a GPU open instead)."""
        if not self.core.scheduler.isolates():
            return False
        return (
            self.hold.who(self.core.device(device).vendor, self.core.attributor is not None)
            != "device-holders"
        )
