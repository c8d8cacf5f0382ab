"""How a region holds its siblings, and whom: the `--hold` and `--freeze` options made concrete.

`--freeze` chooses who is held: `all` (every other command on the device), `device-holders` (those
with a GPU device file open; the others keep running, fenced off the region cores, and are held the
moment they open one), or `auto`: device-holders where the hold can lock and the probes can see a
GPU open, all otherwise. `--hold` chooses how a held sibling is held:

- `freeze`: the cgroup freezer stops every thread of the command.
- `lock`: its processes that hold a GPU device file are locked through the CUDA driver
  (isolation/cudalock.py): their CUDA calls block, their other threads and processes run on. A
  command that cannot be locked is frozen instead and the region says why (no driver lock, a lock
  that failed or timed out, a GPU holder that is not a CUDA process, an AMD device). A held command
  with no GPU file has nothing to lock: it is frozen.
- `auto` (default): `lock` where the driver lock is available, `freeze` elsewhere.

A process that answers the lock CUDA_ERROR_NOT_READY is creating its context: it is not frozen and
not waited for; `retry_late` locks it behind the grant once the context exists (report: lock_late).

    split(targets) ──► to_lock {command: GPU-holding pids}   ──► LockPool.lock_many ─► locked
                   └─► to_freeze [commands without GPU files] ──► freeze      failed ─► frozen (why)
                                                                        NOT_READY ─► retry_late ─► locked
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from krex_async import logs
from krex_async.isolation.base import Backend, Freeze, FreezeError, Group
from krex_async.isolation.cudalock import Driver, LockPool, LockResult, open_driver, release_left, start_time
from krex_async.protocol import LateLock

if TYPE_CHECKING:
    from krex_async.daemon.commands import Command
    from krex_async.daemon.core import Region

log = logs.get("krex.hold")


@dataclass
class Plan:
    """One region's hold: `how` ("lock" or "freeze") and, for a freeze where a lock was asked for,
    why not; the commands to lock (with their GPU-holding pids) and those to freeze."""

    how: str
    why: str = ""
    to_lock: dict[str, list[int]] = field(default_factory=dict)  # command id -> pids
    to_freeze: list[str] = field(default_factory=list)


class Hold:
    """The daemon's hold: the mode, and the lock pool where the driver lock is available."""

    def __init__(
        self,
        mode: str,
        freeze: str,
        state_dir: str,
        timeout: float,
        opener: Callable[[], tuple[Driver | None, str]] = open_driver,
    ) -> None:
        self.mode = mode
        self.freeze = freeze
        self.timeout = timeout
        self.pool: LockPool | None = None
        self.reason = "--hold freeze" if mode == "freeze" else ""
        self.library = ""
        self.version = 0
        # the start-up sweep: locks a dead daemon left (its watchdog may have died with it)
        for line in release_left(state_dir):
            log.info("reconciled", action=line)
        if mode != "freeze" and not state_dir:
            self.reason = "no state dir: a lock that outlived the daemon could not be undone"
        elif mode != "freeze":
            drv, why = opener()
            if drv is None:
                self.reason = why
            else:
                self.pool = LockPool(drv, state_dir)
                self.library, self.version = drv.path, drv.version
                self.reason = f"cuCheckpointProcessLock in {drv.path} (driver API {drv.version})"

    def how(self, vendor: str) -> tuple[str, str]:
        """("lock", "") or ("freeze", why a lock cannot serve here: "" when freeze was chosen)."""
        if self.mode == "freeze":
            return "freeze", ""
        if vendor == "amd":
            return "freeze", "AMD device: the CUDA driver lock does not apply"
        if self.pool is None:
            return "freeze", f"no driver lock: {self.reason}"
        if self.pool.stuck >= 8:
            return "freeze", f"{self.pool.stuck} lock calls never returned from the driver"
        return "lock", ""

    def who(self, vendor: str, probes: bool) -> str:
        """`all` or `device-holders` for a region on a device of `vendor` (`probes`: they run and
        can see a sibling open a GPU device during the region)."""
        if self.freeze != "auto":
            return self.freeze
        return "device-holders" if probes and self.how(vendor)[0] == "lock" else "all"

    def plan(self, vendor: str, targets: dict[str, list[int]]) -> Plan:
        """Split the held commands ({id: their GPU-holding pids}) into those to lock and to freeze."""
        how, why = self.how(vendor)
        p = Plan(how, why)
        for cid, gpu in targets.items():
            if how == "lock" and gpu:
                p.to_lock[cid] = gpu
            else:
                p.to_freeze.append(cid)
        return p

    def status(self) -> dict[str, Any]:
        """For `krex status`: the mode, whether the driver lock can serve, and why (not)."""
        return {
            "mode": self.mode,
            "freeze": self.freeze,
            "lock_available": self.pool is not None,
            "reason": self.reason,
            "library": self.library,
            "driver_version": self.version,
            "lock_timeout_s": self.timeout,
            "stuck_calls": self.pool.stuck if self.pool is not None else 0,
        }

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()


# ------------------------------------------------------------------------- a region's hold steps


async def lock_commands(
    hold: Hold, r: Region, cmds: list[Command], pids: dict[str, list[int]], workers: Sequence[int] = ()
) -> list[Command]:
    """Lock the GPU-holding processes of `cmds`, and the pool `workers` outside any command, through
    the driver, in parallel, into `r` (locked_pids, locked_ids, pool_locked, the report); returns
    the commands to freeze instead, each with its reason in the report's hold_fallback (one of its
    processes was not locked). A worker that cannot be locked is named in pool_unheld: it has no
    cgroup to freeze, and an adoption while it is unlocked freezes the adopting command instead."""
    rep = r.report
    assert hold.pool is not None
    t0 = time.perf_counter()
    r.t_lock = r.t_lock or t0
    try:
        res = await hold.pool.lock_many([p for c in cmds for p in pids[c.id]] + list(workers), hold.timeout)
    except OSError as e:  # the lock record could not be written: nothing was locked
        rep.hold_fallback.update({c.id: f"lock record unwritable: {e}" for c in cmds})
        rep.pool_unheld.update({p: f"lock record unwritable: {e}" for p in workers})
        return list(cmds)
    for p in workers:
        x = res[p]
        if x.ok:
            rep.pool_locked.append(p)
        elif x.not_ready:
            r.late[p] = LateLock(pid=p, command="", attempts=1, state=x.state)
        else:
            rep.pool_unheld[p] = x.error
    rep.lock_s += time.perf_counter() - t0  # a second call: the pool worker that warmed meanwhile
    rep.lock_max_s = max((x.seconds for x in res.values()), default=rep.lock_max_s)
    r.locked_pids.extend(p for p, x in res.items() if x.ok)
    rep.locked_pids = list(r.locked_pids)
    fallback = []
    for c in cmds:
        bad = [res[p] for p in pids[c.id] if not res[p].ok]
        if any(not x.not_ready for x in bad):
            x = next(x for x in bad if not x.not_ready)
            rep.hold_fallback[c.id] = f"pid {x.pid} holds a GPU device file but was not locked: {x.error}"
            fallback.append(c)
            continue
        # Only NOT_READY: a context being created has nothing on the device, and a freeze would
        # wait for that driver call and stop the CPU work the lock spares. Locked once it exists.
        # Not a taint: no kernel of it can run; its creation's driver calls in the region are
        # strays the probes report (lock_late[].strays), which is the evidence either way.
        for x in bad:
            r.late[x.pid] = LateLock(pid=x.pid, command=c.id, attempts=1, state=x.state)
        r.locked_ids.append(c.id)
    rep.locked = list(r.locked_ids)
    rep.lock_late = list(r.late.values())
    return fallback


# Waits between lock retries of a NOT_READY process: context creation takes 0.3 s alone and
# seconds when several run at once (node-wide serialised), so the backoff grows to RETRY_MAX_S.
RETRY_S = (0.001, 0.002, 0.004, 0.008, 0.016)
RETRY_MAX_S = 0.02


async def retry_late(hold: Hold, r: Region, freeze: Callable[[str], Awaitable[None]]) -> None:
    """Retry the lock on `r.late`'s pending processes until each is locked (into r.locked_pids,
    unlocked with the rest at release), has exited, or `r.late_stop` is set (the region ends).
    A retry that fails other than NOT_READY freezes that process's command into the region
    (`freeze`, by command id), as a failed lock at entry would have. Never raises for a
    process; each lock call is bounded (LockPool.lock_many), so stopping takes at most one bound."""
    assert hold.pool is not None and r.late_stop is not None
    stop = r.late_stop
    starts: dict[int, int | None] = {}
    for i in itertools.count():
        pending = [e for e in r.late.values() if e.outcome == "pending"]
        if not pending:
            return
        for e in pending:  # entries may be added while this runs (a pool worker warmed meanwhile)
            if e.pid not in starts:
                starts[e.pid] = start_time(e.pid)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), RETRY_S[i] if i < len(RETRY_S) else RETRY_MAX_S)
        if stop.is_set():
            for e in pending:
                e.outcome = "region-ended"
            return
        live = []
        for e in pending:
            if starts[e.pid] is None or start_time(e.pid) != starts[e.pid]:
                e.outcome = "exited"
            else:
                live.append(e)
        try:
            res = await hold.pool.lock_many([e.pid for e in live], hold.timeout)
        except OSError as err:  # the lock record could not be written: nothing was locked
            res = {x.pid: LockResult(x.pid, False, 0.0, f"lock record unwritable: {err}") for x in live}
        for e in live:
            x = res[e.pid]
            e.attempts += 1
            if x.ok:
                e.outcome, e.after_s = "locked", time.perf_counter() - r.t_lock
                r.locked_pids.append(e.pid)
                r.report.locked_pids.append(e.pid)
                log.info(
                    "late_locked", region=r.id, pid=e.pid, after_s=round(e.after_s, 4), attempts=e.attempts
                )
            elif x.not_ready:
                continue
            elif start_time(e.pid) != starts[e.pid]:
                e.outcome = "exited"
            elif not e.command:  # a pool worker: no cgroup of its own to freeze
                e.outcome = "unheld"
                r.report.pool_unheld[e.pid] = f"answered CUDA_ERROR_NOT_READY, then: {x.error}"
            else:
                e.outcome = "frozen"
                r.report.hold_fallback[e.command] = (
                    f"pid {e.pid} answered CUDA_ERROR_NOT_READY, then was not locked: {x.error}"
                )
                await freeze(e.command)
            if x.ok and not e.command:
                r.report.pool_locked.append(e.pid)


async def stop_late(r: Region) -> None:
    """End `r`'s lock retries and wait for the one in flight to land (before the unlock step)."""
    if r.late_task is None:
        return
    assert r.late_stop is not None
    r.late_stop.set()
    try:
        await asyncio.shield(r.late_task)
    except Exception as err:  # a bug in the retry must not stop the release
        log.error("late_lock_failed", region=r.id, error=repr(err))
    for e in r.late.values():
        if e.outcome == "pending":
            e.outcome = "region-ended"


async def freeze_tolerant(backend: Backend, r: Region, groups: list[Group], timeout: float) -> list[Freeze]:
    """Freeze `groups` together. A group the freezer cannot stop within `timeout` (a thread in
    uninterruptible sleep: a hung FUSE or NFS read) is not a reason to refuse the region, which
    would refuse every region on the device for as long as it hangs: that sibling is left running
    (fenced off the region cores by the caller), named in `unheld`, and the region is tainted. The
    others are frozen again without it (each culprit costs one timeout)."""
    groups = list(groups)
    while groups:
        try:
            return await backend.freeze_many(groups, timeout=timeout)
        except FreezeError as e:  # the batch was undone; which group held it up is named
            bad = next((g for g in groups if g.name == e.group), None)
            if bad is None and len(groups) > 1:  # named by its pids (the signal backend)
                return await _freeze_one_by_one(backend, r, groups, timeout)
            bad = bad or groups[0]
            groups.remove(bad)
            unheld(r, bad, e.reason)
    return []


async def _freeze_one_by_one(
    backend: Backend, r: Region, groups: list[Group], timeout: float
) -> list[Freeze]:
    out: list[Freeze] = []
    for g in groups:
        try:
            out += await backend.freeze_many([g], timeout=timeout)
        except FreezeError as e:
            unheld(r, g, e.reason)
    return out


def unheld(r: Region, g: Group, why: str) -> None:
    """Take `g` out of the region's frozen set and say why in its report, tainting the region."""
    rep = r.report
    if g in r.frozen:
        r.frozen.remove(g)
    if g.command_id in r.frozen_ids:
        r.frozen_ids.remove(g.command_id)
    rep.unheld[g.command_id] = why
    rep.tainted = True
    rep.taint.append(
        f"command {g.command_id} could not be held ({why.split('; its threads')[0]}):"
        " it ran on, fenced off the region cores"
    )
    log.warning("sibling_unheld", region=r.id, command=g.command_id, error=why)


def d_state(pids: list[int]) -> list[str]:
    """The threads of `pids` in uninterruptible sleep, as "tid(wchan)" (from /proc)."""
    out = []
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
                    state = f.read().rsplit(b")", 1)[1].split()[0]
                if state != b"D":
                    continue
                with open(f"/proc/{pid}/task/{tid}/wchan") as f:
                    out.append(f"{tid}({f.read().strip() or '-'})")
            except (OSError, IndexError):
                continue
    return out
