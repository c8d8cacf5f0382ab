"""What one region holds, and the only code that changes it: the `HoldSet` on each `Region`.

A region holds its siblings frozen (their cgroup stopped) or locked (their CUDA processes locked
through the driver), tells their runtimes to stop (quiesced) or that they are held (Held), keeps the
exits deferred to its end (exit waiters), and says in its report whom it held and why not. Every one
of those lists and report fields is written here and nowhere else; entry.py, joins.py and the
dispatcher call these methods. The mechanisms (the backend's freezer, the driver's LockPool) are
passed in, so that a fake of either drives it in process (tests/daemon/).

    mark_frozen / add_frozen / add_own ─► freeze (tolerant) ─► drop (unheld: tainted, fenced)
    lock (LockPool, NOT_READY waited for) ─► locked pids / commands; fallback ─► frozen
    quiesced / told_held / wait_exit ─► resume (at the release)
    begin_release ─► settle ─► thaw ─► unlock ─► resume
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence, Set
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from krex_async import logs
from krex_async import protocol as P
from krex_async.isolation.base import Backend, Freeze, FreezeError, Group
from krex_async.isolation.cudalock import LockPool, LockResult, start_time
from krex_async.linux import procfs

if TYPE_CHECKING:
    from krex_async.daemon.model.command import Command

log = logs.get("krex.hold")

Send = Callable[[P.Msg], bool]


class HoldSet:
    """One region's held processes and its report's hold fields (frozen, locked, locked_pids,
    lock_late, hold_fallback, pool_locked, pool_unheld, unheld and its taint, exit_deferred,
    held_exited, unlock_s). Readers get read-only views; every change is a method here."""

    def __init__(self, region: str, report: P.RegionReport) -> None:
        self.region = region
        self.report = report
        self._frozen: list[Group] = []  # groups to thaw at the release
        self._frozen_ids: list[str] = []  # commands frozen for it (marked before their freeze)
        self._locked_pids: list[int] = []  # locked through the driver: unlocked at the release
        self._locked_ids: list[str] = []  # commands held by the lock alone
        # processes that answered the lock NOT_READY (inside a CUDA call), waited for at entry
        self._late: dict[int, P.LateLock] = {}
        self._quiesced: list[Send] = []  # told Quiesce: Resume at the release
        self._held_runtimes: list[Send] = []  # told Held: Resume at the release
        # processes whose exit waits for this region's end (Regions.exit_held): pid -> their runtime
        self._exit_waiters: dict[int, Send] = {}
        self._freezing: set[str] = set()  # commands a late freeze is under way for
        # late, join and adoption freezes (Joins._freeze_into) in flight: the release waits for
        # them, so that none lands, or is undone, after the next region took the device
        self._freezes: set[asyncio.Future[None]] = set()
        self._entry_late: list[str] = []  # commands frozen late before the grant
        self._releasing = False  # the release has begun: nothing may join the frozen set any more

    # ------------------------------------------------------------------------------ read-only

    @property
    def frozen(self) -> Sequence[Group]:
        return self._frozen

    @property
    def frozen_ids(self) -> Sequence[str]:
        return self._frozen_ids

    @property
    def locked_pids(self) -> Sequence[int]:
        return self._locked_pids

    @property
    def locked_ids(self) -> Sequence[str]:
        return self._locked_ids

    @property
    def late(self) -> Mapping[int, P.LateLock]:
        return self._late

    @property
    def entry_late(self) -> Sequence[str]:
        return self._entry_late

    @property
    def freezes(self) -> Set[asyncio.Future[None]]:
        return self._freezes

    @property
    def releasing(self) -> bool:
        return self._releasing

    def holds(self, cid: str) -> bool:
        """Whether command `cid` is frozen or locked for the region."""
        return cid in self._frozen_ids or cid in self._locked_ids

    def held_ids(self) -> list[str]:
        """The commands held, frozen or locked, each once, in the order they were held."""
        return list(dict.fromkeys([*self._frozen_ids, *self._locked_ids]))

    # -------------------------------------------------------------------------------- freezing

    def mark_frozen(self, groups: Iterable[Group], ids: Iterable[str]) -> None:
        """Mark before freezing: a failure part-way still thaws every one of them at the release."""
        self._frozen.extend(groups)
        self._frozen_ids.extend(ids)

    def add_own(self, group: Group) -> None:
        """The owner's command (its other processes) frozen: thawed at the release, not named."""
        self._frozen.append(group)

    def add_frozen(self, group: Group, cid: str, *, in_entry: bool = False) -> None:
        """A command frozen into the region after it chose its targets (a join, a late GPU open, an
        adoption); `in_entry`: before the grant (the owner verifies the drain)."""
        self._frozen.append(group)
        self._frozen_ids.append(cid)
        self.report.frozen.append(cid)
        if in_entry:
            self._entry_late.append(cid)

    def publish_frozen(self) -> None:
        """The report names the commands frozen so far."""
        self.report.frozen = list(self._frozen_ids)

    async def freeze(self, backend: Backend, groups: list[Group], timeout: float) -> list[Freeze]:
        """Freeze `groups` together. A group the freezer cannot stop within `timeout` (a thread in
        uninterruptible sleep: a hung FUSE or NFS read) is not a reason to refuse the region, which
        would refuse every region on the device for as long as it hangs: that sibling is dropped
        (left running, fenced off the region cores by the caller, the region tainted). The others
        are frozen again without it (each culprit costs one timeout)."""
        groups = list(groups)
        while groups:
            try:
                return await backend.freeze_many(groups, timeout=timeout)
            except FreezeError as e:  # the batch was undone; which group held it up is named
                bad = next((g for g in groups if g.name == e.group), None)
                if bad is None and len(groups) > 1:  # named by its pids (the signal backend)
                    return await self._freeze_one_by_one(backend, groups, timeout)
                bad = bad or groups[0]
                groups.remove(bad)
                self.drop(bad, e.reason)
        return []

    async def _freeze_one_by_one(self, backend: Backend, groups: list[Group], timeout: float) -> list[Freeze]:
        out: list[Freeze] = []
        for g in groups:
            try:
                out += await backend.freeze_many([g], timeout=timeout)
            except FreezeError as e:
                self.drop(g, e.reason)
        return out

    def drop(self, g: Group, why: str) -> None:
        """Take `g` out of the frozen set and say why in the report, tainting the region."""
        rep = self.report
        if g in self._frozen:
            self._frozen.remove(g)
        if g.command_id in self._frozen_ids:
            self._frozen_ids.remove(g.command_id)
        rep.unheld[g.command_id] = why
        rep.tainted = True
        rep.taint.append(
            f"command {g.command_id} could not be held ({why.split('; its threads')[0]}):"
            " it ran on, fenced off the region cores"
        )
        log.warning("sibling_unheld", region=self.region, command=g.command_id, error=why)

    @asynccontextmanager
    async def late_freeze(self, cid: str) -> AsyncIterator[bool]:
        """One freeze after the targets were chosen (Joins._freeze_into), in flight: yields False
        when there is none to do (under way already, frozen, or the release has begun); the release
        waits for it to end (`settle`)."""
        if cid in self._freezing or cid in self._frozen_ids or self._releasing:
            yield False
            return
        self._freezing.add(cid)
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._freezes.add(done)
        try:
            yield True
        finally:
            self._freezing.discard(cid)
            self._freezes.discard(done)
            done.set_result(None)

    def freeze_tried(self, cid: str) -> None:
        """The late freeze of `cid` has been tried: another may start for it (once undone)."""
        self._freezing.discard(cid)

    async def settle(self, timeout: float | None = None) -> None:
        """Wait for the late freezes in flight (each bounded by --freeze-timeout)."""
        if self._freezes:
            await asyncio.wait(list(self._freezes), timeout=timeout)

    # --------------------------------------------------------------------------------- locking

    def fallback(self, why: Mapping[str, str]) -> None:
        """Commands frozen rather than locked: command -> why (the report's hold_fallback)."""
        self.report.hold_fallback.update(why)

    async def lock(
        self,
        pool: LockPool,
        timeout: float,
        wait: float,
        cmds: Sequence[Command],
        pids: Mapping[str, list[int]],
        workers: Sequence[int] = (),
    ) -> list[Command]:
        """Lock the GPU-holding processes of `cmds`, and the pool `workers` outside any command,
        through the driver, in parallel; returns the commands to freeze instead, each with its
        reason in hold_fallback (one of its processes was not locked). A worker that cannot be
        locked is named in pool_unheld: it has no cgroup to freeze, and an adoption while it is
        unlocked freezes the adopting command instead.

        A process inside a CUDA call (the driver answers CUDA_ERROR_NOT_READY once `timeout`
        passes) is waited for, up to `wait` (--lock-wait), before the grant: the driver locks it as
        the call ends. Granting without it let it run on its next calls until a retry caught it
        between two (0.1-0.85 s, up to 377 stray driver calls, one timing's p95 +61% on the H200);
        a freeze would wait for the same call to end and stop its CPU work too. Still busy after
        the wait: frozen."""
        rep = self.report
        t0 = time.perf_counter()
        owner = {p: c.id for c in cmds for p in pids[c.id]} | {p: "" for p in workers}
        try:
            res = await pool.lock_many(list(owner), timeout)
        except OSError as e:  # the lock record could not be written: nothing was locked
            rep.hold_fallback.update({c.id: f"lock record unwritable: {e}" for c in cmds})
            rep.pool_unheld.update({p: f"lock record unwritable: {e}" for p in workers})
            return list(cmds)
        # Into the region at once, so that its release unlocks them whatever happens next.
        self._locked_pids.extend(p for p, x in res.items() if x.ok)
        busy = [p for p, x in res.items() if x.not_ready]
        if busy:
            await self._wait_busy(pool, wait, busy, owner, res)
        rep.lock_s += time.perf_counter() - t0  # a second call: the pool worker that warmed meanwhile
        rep.lock_max_s = max([rep.lock_max_s, *(x.seconds for x in res.values())])
        rep.locked_pids = list(self._locked_pids)
        rep.lock_late = list(self._late.values())
        exited = {p for p, e in self._late.items() if e.outcome == "exited"}  # nothing left to hold
        for p in workers:
            if res[p].ok:
                rep.pool_locked.append(p)
            elif p not in exited:
                rep.pool_unheld[p] = res[p].error
        fallback = []
        for c in cmds:
            bad = [res[p] for p in pids[c.id] if not res[p].ok and p not in exited]
            if bad:
                x = bad[0]
                rep.hold_fallback[c.id] = f"pid {x.pid} holds a GPU device file but was not locked: {x.error}"
                fallback.append(c)
            elif any(res[p].ok for p in pids[c.id]) and c.id not in self._locked_ids:
                self._locked_ids.append(c.id)  # (a second call: more of a command locked already)
            # else every GPU process of it exited meanwhile: nothing of it to hold (fenced)
        rep.locked = list(self._locked_ids)
        return fallback

    async def _wait_busy(
        self, pool: LockPool, wait: float, busy: list[int], owner: dict[int, str], res: dict[int, LockResult]
    ) -> None:
        """Lock `busy` (they answered NOT_READY: inside a CUDA call) again, bounded by `wait`, into
        `res` and the late locks; the driver locks each as its call ends."""
        for p in busy:
            self._late[p] = P.LateLock(pid=p, command=owner[p], attempts=1, state=res[p].state)
        starts = {p: start_time(p) for p in busy}
        try:
            again = await pool.lock_many(busy, wait)
        except OSError as err:  # the record could not be written: none of these was locked
            again = {p: LockResult(p, False, 0.0, f"lock record unwritable: {err}") for p in busy}
        self._locked_pids.extend(p for p in busy if again[p].ok)
        for p in busy:
            e, x = self._late[p], again[p]
            e.attempts, e.after_s = 2, res[p].seconds + x.seconds
            if x.ok:
                e.outcome = "locked"
            elif _gone(p, starts[p]):
                e.outcome = "exited"
            else:
                e.outcome = "unheld" if not owner[p] else "frozen"
            why = f"inside a CUDA call for over --lock-wait {wait:g}s ({x.error})" if x.not_ready else x.error
            res[p] = LockResult(p, x.ok, e.after_s, why)

    def unheld_worker(self, pid: int, why: str) -> None:
        """A pool worker outside any command that holds a GPU file and is not held (pool_unheld)."""
        self.report.pool_unheld[pid] = why

    def add_locked(self, cid: str) -> None:
        """A command held by a process already locked (a warm worker locked at the entry joined it)."""
        self._locked_ids.append(cid)
        self.report.locked = list(self._locked_ids)

    # ------------------------------------------------------------------- runtimes, exits, ends

    def quiesced(self, send: Send) -> None:
        """A runtime told Quiesce: it is told Resume at the release."""
        self._quiesced.append(send)

    def told_held(self, send: Send) -> None:
        """A locked process's runtime told Held (its exit deferred to the release): Resume then."""
        self._held_runtimes.append(send)

    def defer_exit(self, pid: int) -> bool:
        """A locked process's exit waits for the release (ExitHeld naming this region); False when
        it is not locked by it, or was deferred already."""
        if pid not in self._locked_pids or pid in self.report.exit_deferred:
            return False
        self.report.exit_deferred.append(pid)
        return True

    def wait_exit(self, pid: int, send: Send) -> None:
        """A sibling's exit waits for the region's end: resumed, and noted exiting, at the release."""
        self._exit_waiters[pid] = send
        self.report.exit_deferred.append(pid)

    def ended_held(self, cid: str) -> None:
        """A command held (locked) by the region ended all the same: its memory was freed beside the
        timing."""
        if cid in self._locked_ids and cid not in self.report.held_exited:
            self.report.held_exited.append(cid)

    # ------------------------------------------------------------------------------- releasing

    def begin_release(self) -> None:
        self._releasing = True

    async def thaw(self, backend: Backend) -> int:
        """Thaw every frozen group, each on its own (a vanished group thaws as a no-op, a failure is
        logged and the others go on); returns how many there were."""
        n = len(self._frozen)
        for g in self._frozen:
            try:
                await backend.thaw(g)
            except Exception as e:
                log.error("thaw_failed", region=self.region, group=g.name, error=repr(e))
        self._frozen.clear()
        return n

    async def unlock(self, pool: LockPool | None) -> int:
        """Unlock every locked process (after the thaw: one both locked and frozen may need to run
        for the driver to unlock it); returns how many were (unlock_s in the report), 0 when the
        call failed."""
        n = len(self._locked_pids)
        if not n or pool is None:
            return 0
        try:
            self.report.unlock_s, errors = await pool.unlock_many(list(self._locked_pids))
            for pid, err in errors.items():  # a locked process that died meanwhile among them
                log.info("unlock_refused", region=self.region, pid=pid, error=err)
        except Exception as e:
            log.error("unlock_failed", region=self.region, error=repr(e))
            n = 0  # nothing to say it unlocked
        self._locked_pids.clear()
        return n

    def resume(self, exiting: Callable[[int], None]) -> None:
        """Tell the quiesced and Held runtimes to resume, then the exit waiters: each is noted
        `exiting` first (the next region waits for it), then let go."""
        for send in (*self._quiesced, *self._held_runtimes):
            send(P.Resume(id=0, region=self.region))
        self._quiesced.clear()
        self._held_runtimes.clear()
        for pid, send in self._exit_waiters.items():
            exiting(pid)
            send(P.Resume(id=0, region=""))
        self._exit_waiters.clear()


def _gone(pid: int, started: int | None) -> bool:
    """Whether `pid` (started at `started`) has exited: no such process, another one, or a zombie."""
    st = procfs.stat(pid)
    return started is None or st is None or st.start != started or st.state == "Z"
