"""A region's life under the daemon: queue, isolate, grant, hold, release (README.md, The region API).

Each region runs as one task, `Regions.run()`, whose `finally` undoes every isolation step it took, so
no path out of a region (release, owner death, expiry, shutdown, a failed freeze, a cancelled task)
leaves a process frozen or a core fenced. This module keeps the regions and runs that task, and
tells the owner and the log how it went; the isolation steps and their undoing are entry.py's,
commands that meet a region under way joins.py's, siblings' exits waited for exits.py's.
Steps and their cost:

    wait     queued behind other regions on the device (FIFO); its turn come, for siblings owed
             their share of the device, running meanwhile (share.py); then for siblings still
             exiting (exits.py)
    quiesce  ask frozen siblings' in-command runtimes to stop at a bytecode boundary and synchronise
             (drain.py)
    hold     lock the siblings' CUDA processes through the driver (--hold lock) and freeze the rest
             (every other command on the device, or those holding a GPU file: policy.py), and the
             owner's other processes; a sibling that cannot be frozen is left running, fenced, and
             the region tainted
    cores    give the owner's process its region cores; fence every other running command off them
             (fence.py)
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
from krex_async.daemon.model import events as E
from krex_async.daemon.model.command import Command, CommandState
from krex_async.daemon.model.core import Core, Outcome, Region, Send
from krex_async.daemon.regions.clock import Clock
from krex_async.daemon.regions.drain import Drain
from krex_async.daemon.regions.entry import Entry
from krex_async.daemon.regions.exits import Exits
from krex_async.daemon.regions.fence import CoreFence
from krex_async.daemon.regions.joins import Joins
from krex_async.daemon.regions.policy import HoldPolicy
from krex_async.daemon.regions.share import IDLE_PROBE_S, IdleProbes, Share, cpu_by_pid
from krex_async.isolation.base import IsolationError
from krex_async.probes.hold import HOLD

if TYPE_CHECKING:
    from krex_async.probes.base import ProbeEvent

log = logs.get("krex.region")


class Regions:
    def __init__(self, core: Core) -> None:
        self.core = core
        self.active: dict[str, Region] = {}  # every region from request to release
        self.cores = CoreFence(core, self.active)  # the owners' region cores, the others fenced off
        self.drain = Drain(core, self.active)  # quiesce, and the drain check once frozen
        self.clock = Clock(core)  # clock settle and warm-up before the grant
        cfg = core.config
        self.hold = HoldPolicy(cfg.hold, cfg.freeze, cfg.state_dir, cfg.lock_timeout, cfg.lock_wait)
        self.exits = Exits(core)  # processes exiting with a GPU file: the next region waits
        self.entry = Entry(core, self.hold, self.cores, self.drain, self.clock, self.exits)
        self.joins = Joins(core, self.hold, self.holder_on, self.exits)  # commands meeting a region under way
        self.share = Share(cfg.hold_share, cfg.share_window)  # siblings' share of the device
        self.share_wake: dict[str, asyncio.Future[None]] = {}  # device -> its region's share wait
        # a re-run is a new run: the time others' regions held the failed one is owed to no one (on
        # the H100 a region waited 3.6 s for a guarded re-run owed its failed run's share)
        core.events.subscribe(E.CommandRequeued, lambda e: self.share.forget(e.cmd.id))

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
        wake = self.share_wake.get(r.device)  # a sibling asks for its region: owed no time now
        if wake is not None and not wake.done():
            wake.set_result(None)
        r.task = loop.create_task(self.run(r), name=f"region-{rid}")
        self.core.track(r.task)
        return r

    def of_command(self, cmd: Command) -> bool:
        """Whether `cmd` holds a region or waits for one."""
        return any(r.command is cmd for r in self.active.values())

    def by_owner_pid(self, cmd: Command, pid: int) -> Region | None:
        return next((r for r in self.active.values() if r.command is cmd and r.pid == pid), None)

    def holder_on(self, device: str) -> Region | None:
        rid = self.core.scheduler.holder(device)
        return self.active.get(rid) if rid else None

    def holding(self, cmd: Command) -> tuple[str, Region | None] | None:
        """("frozen" or "locked", the region that holds it) while a region holds `cmd`, else None:
        a held command acts on no signal but SIGKILL until that region ends. A region's owner is
        not held: the process in its region runs (its other processes are frozen, keep/ aside).
        One whose own region waits its turn is held by the region that froze it. A releasing
        region holds only what it has not yet thawed or unlocked. One frozen as it starts is held
        only while a region it can join is current: Joins.join thaws one whose region ended."""
        for r in self.active.values():
            held = r.held
            if cmd.id in held.locked_ids and not (held.releasing and not held.locked_pids):
                return "locked", r
            thawed = held.releasing and cmd.group is not None and not cmd.group.frozen
            if cmd.id in held.frozen_ids and not thawed:
                return "frozen", r
        if any(r.command is cmd for r in self.active.values()):
            return None
        if cmd.group is not None and cmd.group.frozen and cmd.device_key is not None:
            current = self.joins.current_on(cmd.device_key)  # frozen at its start, or joining one
            if current is not None:
                return "frozen", current
        return None

    # ------------------------------------------- what the dispatcher, the commands and pools ask

    def get(self, rid: str) -> Region | None:
        return self.active.get(rid)

    def choosing(self) -> list[Region]:
        """The regions entering that have chosen whom to hold: a GPU open since freezes its sibling."""
        return [r for r in self.active.values() if r.outcome is Outcome.OPEN and r.select_ns]

    def freeze_late(self, r: Region, ev: ProbeEvent) -> None:
        self.joins.freeze_late(r, ev)

    def exit(self, r: Region, req: P.RegionExit) -> None:
        """Its owner exits the region (RegionExit, its rights checked): released, with its drain."""
        r.exit_id = req.id
        if req.drain:
            r.report.drain = req.drain
            r.report.drain_s = req.drain_s
            r.report.drain_window_s = self.core.config.drain_window
        r.report.warm_s = req.warm_s
        r.end(Outcome.RELEASED)

    def exit_held(self, req: P.ExitHeld, pid: int, send: Send) -> None:
        """A command's process holding a GPU file is exiting; its runtime waits for a Resume. Locked
        by `req.region`: that region's release resumes it (told Held). Else Joins.exit_held."""
        if req.region:  # its Resume comes with that region's release (or came: it is over)
            r = self.active.get(req.region)
            if r is not None and r.held.defer_exit(pid):
                self.exits.note_exiting(pid, r.device)
            return
        self.joins.exit_held(pid, send)

    def ack(self, req: P.QuiesceAck, pid: int) -> None:
        if (r := self.active.get(req.region)) is not None:
            self.drain.ack(r.command, pid, req)

    def end_owned_by(self, send: Send) -> None:
        """Its owner's connection closed: every region it held or awaited ends."""
        for r in list(self.active.values()):
            if r.send == send:
                r.end(Outcome.OWNER_DIED)

    async def end_of(self, cmd: Command) -> None:
        """`cmd` ended (or re-runs): its regions end, their release awaited (up to 10 s)."""
        rids = self.core.scheduler.regions_of(cmd.id)
        await self._end(
            [r for rid in rids if (r := self.active.get(rid)) is not None], Outcome.OWNER_DIED, 10
        )

    async def end_all(self) -> None:
        """Shutdown: every region ends, thawing what it held (awaited up to 5 s)."""
        await self._end(list(self.active.values()), Outcome.SHUTDOWN, 5)

    @staticmethod
    async def _end(regions: list[Region], outcome: Outcome, timeout: float) -> None:
        for r in regions:
            r.end(outcome)
        tasks = [r.task for r in regions if r.task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=timeout)

    def ended_held(self, cmd: Command) -> None:
        """`cmd` ended while a region held it: that region's report says so."""
        for r in self.active.values():
            if r.outcome is Outcome.HELD:
                r.held.ended_held(cmd.id)

    def admit_frozen(self, cmd: Command) -> Region | None:
        return self.joins.admit_frozen(cmd)

    async def join(self, cmd: Command, admitted: Region | None) -> None:
        await self.joins.join(cmd, admitted)

    def cores_for_new(self) -> frozenset[int] | None:
        return self.cores.for_new()

    def holds_starts(self, device: str, cmd: Command) -> bool:
        return self.joins.holds_starts(device, cmd)

    async def hold_arrival(self, cmd: Command, worker: int) -> None:
        await self.joins.hold_arrival(cmd, worker)

    def worker_joined(self, cmd: Command, worker: int) -> None:
        self.joins.worker_joined(cmd, worker)

    def close(self) -> None:
        self.hold.close()

    # ------------------------------------------------------------------------------ lifecycle

    async def run(self, r: Region) -> None:
        sched = self.core.scheduler
        rep = r.report
        assert r.turn is not None and r.ended is not None
        log_ = log.bind(region=r.id, command=r.command.id, device=r.device)
        granted = False
        t_entry = 0.0  # when its entry began: the siblings it holds are held from then
        try:
            if sched.request_region(r.id, r.command.id, r.device):
                r.turn.set_result(None)
            else:
                self.core.events.emit(E.RegionQueued(r))
            waiters: list[asyncio.Future[object]] = [r.turn, r.ended]  # type: ignore[list-item]
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
            if r.ended.done():  # withdrawn while queued (owner died, shutdown)
                r.outcome = r.ended.result()
                return
            t_turn = time.perf_counter()
            rep.wait_s = t_turn - r.t_request
            if not await self._share_wait(r):  # withdrawn while its siblings ran
                r.outcome = r.ended.result()
                return
            t_entry = time.monotonic()
            # The probes' threads hold off from the turn to the grant (probes/hold.py): each of
            # their GIL hand-offs would cost the entry more than their work.
            with HOLD.held() if self.core.attributor is not None else contextlib.nullcontext():
                if sched.isolates():
                    await self.entry.isolate(r)
                rep.enter_s = time.perf_counter() - r.t_request
                r.outcome = Outcome.HELD
                granted = True
                self.core.events.emit(E.RegionGranted(r, len(r.frozen_ids), len(r.locked_ids)))
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
            # after the grant, off its path: the locked siblings' CPU from here is credited
            self.share.begin(r.id, r.held.held_ids(), t_entry, self._locked_cpu(r))
            self.core.events.emit(E.RegionRunning(r))
            timer = asyncio.get_running_loop().call_later(
                self.core.config.region_timeout, r.end, Outcome.EXPIRED
            )
            try:
                reason = await asyncio.shield(r.ended)
            finally:
                timer.cancel()
            rep.held_s = time.perf_counter() - t_held
            r.outcome = reason
        except (IsolationError, OSError) as e:
            # FreezeError, and the backend's other documented failures while isolating (a cgroup
            # or cpuset write refused, the intent record unwritable): the owner must get its
            # answer, not wait forever on a region whose task died
            if granted:
                raise
            r.outcome = Outcome.REFUSED
            rep.error = str(e)
            log_.warning("region_refused", error=str(e))
        except Exception as e:  # a bug while isolating: released below, and the owner told so
            if granted:
                raise
            r.outcome = Outcome.REFUSED
            rep.error = f"internal error while isolating: {e!r}"
            log_.exception("region_entry_failed")
        except asyncio.CancelledError:
            if r.outcome in (Outcome.OPEN, Outcome.HELD):
                r.outcome = Outcome.SHUTDOWN
            raise
        finally:
            t_exit = time.perf_counter()
            self.core.events.emit(E.RegionReleasing(r))  # the probes close their window: nothing thawed yet
            await asyncio.shield(self.entry.release(r))
            rep.exit_s = time.perf_counter() - t_exit
            t_thawed = time.monotonic()
            self.active.pop(r.id, None)
            nxt = sched.release_region(r.id)
            if nxt and nxt in self.active:
                turn = self.active[nxt].turn
                if turn is not None and not turn.done():
                    turn.set_result(None)
            self.core.events.emit(E.RegionReleased(r, granted, tuple(r.held.held_ids())))
            self._tell_owner(r, granted)
            self.core.events.emit(E.RegionAnswered(r))
            if granted:  # after the owner's answer, before the next region's turn runs (no await)
                self._share_end(r, t_entry, t_thawed)
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

    # -------------------------------------------------------------------------- the share

    def _share_end(self, r: Region, since: float, now: float) -> None:
        """Its siblings were held from its entry to their thaw (`now`), each charged for what it
        could not run before it asked for a region of its own here (share.py); the commands ended
        since are forgotten."""
        held, shift = r.held.held_ids(), time.monotonic() - time.perf_counter()  # t_request's clock
        mine = [x for x in reversed(self.active.values()) if x.device == r.device]  # (r has left it)
        asked = {x.command.id: x.t_request + shift for x in mine}  # (its first request last: it wins)
        charged = self.share.end(r.id, held, since, now, self._locked_cpu(r), asked)
        for cid in held:
            self.core.events.emit(E.SiblingHeld(r.device, cid, charged[cid]))
        for cid in [c for c in self.share.total if not self._running(c)]:
            self.share.drop(cid)
            self.core.events.emit(E.SiblingForgotten(cid))

    def _running(self, cid: str) -> bool:
        cmd = self.core.commands.get(cid)
        return cmd is not None and cmd.state is CommandState.RUNNING and cmd.group is not None

    def owed(self, r: Region) -> dict[str, float]:
        """The siblings r would hold that are owed their share now: {command: seconds owed}. Not
        one whose own region is requested (it waits for that, not to run), nor one leaving with
        no process holding a GPU file (Command.leaving)."""
        now = time.monotonic()
        out = {}
        for cid in list(self.share.over):
            cmd = self.core.commands.get(cid)
            if cmd is None or cmd is r.command or cmd.device_key != r.device or not self._running(cid):
                continue
            owed = self.share.owed_s(cid, now)
            leaving = cmd.leaving(now) and not self.drain.gpu_pids(cmd)  # (no GPU file: /proc read)
            if owed > 0 and not self.core.scheduler.regions_of(cid) and not leaving:
                out[cid] = owed
        return out

    def _locked_cpu(self, r: Region) -> dict[str, dict[int, int]]:
        """The CPU ns of each process of r's siblings held by the lock alone (their CPU threads
        run); one frozen as well (a late freeze) is charged as frozen for the whole span."""
        frozen, out = set(r.held.frozen_ids), {}
        for cid in dict.fromkeys(r.held.locked_ids):
            cmd = self.core.commands.get(cid)
            if cid not in frozen and cmd is not None and cmd.group is not None:
                out[cid] = cpu_by_pid(self.core.backend.pids(cmd.group))
        return out

    def _pids(self, cid: str) -> list[int]:
        cmd = self.core.commands.get(cid)
        return self.core.backend.pids(cmd.group) if cmd is not None and cmd.group else []

    async def _share_wait(self, r: Region) -> bool:
        """With its turn, before its entry: wait while siblings it would hold are owed their share
        (share.py), none of them held, so they run. A sibling that does not use the time
        (share.IdleProbes) is not waited for. False when the region ended meanwhile."""
        if not (self.share.over and self.core.scheduler.isolates()):  # the common path
            return True
        due = self.owed(r)
        if not due:
            return True
        assert r.ended is not None
        rep = r.report
        r.sharing = True
        t0 = time.perf_counter()
        self.core.events.emit(E.ShareWaiting(r, dict(due)))
        probes = IdleProbes()
        try:
            while due:
                rep.share_for = sorted(set(rep.share_for) | set(due))
                for cid in due:
                    probes.start(cid, self._pids(cid))
                wake = self.share_wake[r.device] = asyncio.get_running_loop().create_future()
                either: list[asyncio.Future[Any]] = [r.ended, wake]
                await asyncio.wait(either, timeout=min(min(due.values()), IDLE_PROBE_S))
                if r.ended.done():
                    return False
                for cid in [c for c in probes.started() if c in due and c not in rep.share_idle]:
                    if probes.idle(cid, self._pids(cid)):
                        self.share.forget(cid)  # it was given the device and did not use it
                        rep.share_idle.append(cid)
                due = self.owed(r)
            return True
        finally:
            r.sharing = False
            self.share_wake.pop(r.device, None)
            rep.share_wait_s = time.perf_counter() - t0
            self.core.events.emit(E.ShareWaited(r, rep.share_wait_s))
            log.info(
                "region_share_wait",
                region=r.id,
                waited_s=round(rep.share_wait_s, 3),
                owed=rep.share_for,
                idle=rep.share_idle,
            )

    def _tell_owner(self, r: Region, granted: bool) -> None:
        rep, outcome = r.report, r.outcome
        if outcome is Outcome.REFUSED:
            r.send(P.Error(id=r.req_id, code="region_refused", message=rep.error))
        elif outcome is Outcome.EXPIRED:
            r.send(P.RegionRevoked(id=r.req_id, report=rep))
        elif outcome is Outcome.RELEASED:
            r.send(P.RegionReleased(id=r.exit_id if r.exit_id is not None else r.req_id, report=rep))
        elif not granted and outcome is Outcome.SHUTDOWN:
            r.send(P.Error(id=r.req_id, code="shutdown", message="the daemon is shutting down"))
        elif granted:
            r.send(P.RegionRevoked(id=r.req_id, report=rep))

    def hold_status(self) -> dict[str, object]:
        """For `krex status`: the hold, and per device how and whom a region there would hold now."""
        return self.hold.status_on(self.core)
