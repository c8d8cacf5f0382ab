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

A process that answers the lock CUDA_ERROR_NOT_READY is inside a CUDA call (its context's creation,
an allocation, a copy, a module load, a synchronise): the region waits up to --lock-wait for the
driver to lock it as that call ends, before the grant, and freezes its command if it is still busy
(report: lock_late).

    split(targets) ──► to_lock {command: GPU-holding pids}   ──► LockPool.lock_many ─► locked
                   └─► to_freeze [commands without GPU files] ──► freeze      failed ─► frozen (why)
                                                                        NOT_READY ─► wait ─► locked
                                                                                            └─► frozen
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from krex_async import logs
from krex_async.isolation.base import Backend, Freeze, FreezeError, Group
from krex_async.isolation.cudalock import Driver, LockPool, LockResult, open_driver, release_left, start_time
from krex_async.linux import procfs
from krex_async.linux.procfs import stat_fields
from krex_async.protocol import LateLock

if TYPE_CHECKING:
    from krex_async.daemon.commands import Command
    from krex_async.daemon.core import Core, Region

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
        wait: float = 0.5,
        opener: Callable[[], tuple[Driver | None, str]] = open_driver,
    ) -> None:
        self.mode = mode
        self.freeze = freeze
        self.timeout = timeout
        self.wait = wait  # for a sibling inside a CUDA call: lock_commands
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

    def who_on(self, core: Core, device: str) -> str:
        """`who` for a region on `device` now (the probes may start after the daemon)."""
        return self.who(core.device(device).vendor, core.attributor is not None)

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
            "lock_wait_s": self.wait,
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
    cgroup to freeze, and an adoption while it is unlocked freezes the adopting command instead.

    A process inside a CUDA call (the driver answers CUDA_ERROR_NOT_READY once --lock-timeout
    passes) is waited for, up to --lock-wait, before the grant: the driver locks it as the call
    ends. Granting without it let it run on its next calls until a retry caught it between two
    (0.1-0.85 s, up to 377 stray driver calls, one timing's p95 +61% on the H200); a freeze would
    wait for the same call to end and stop its CPU work too. Still busy after the wait: frozen."""
    rep = r.report
    assert hold.pool is not None
    t0 = time.perf_counter()
    owner = {p: c.id for c in cmds for p in pids[c.id]} | {p: "" for p in workers}
    try:
        res = await hold.pool.lock_many(list(owner), hold.timeout)
    except OSError as e:  # the lock record could not be written: nothing was locked
        rep.hold_fallback.update({c.id: f"lock record unwritable: {e}" for c in cmds})
        rep.pool_unheld.update({p: f"lock record unwritable: {e}" for p in workers})
        return list(cmds)
    # Into the region at once, so that its release unlocks them whatever happens next.
    r.locked_pids.extend(p for p, x in res.items() if x.ok)
    busy = [p for p, x in res.items() if x.not_ready]
    if busy:
        await _wait_busy(hold, r, busy, owner, res)
    rep.lock_s += time.perf_counter() - t0  # a second call: the pool worker that warmed meanwhile
    rep.lock_max_s = max([rep.lock_max_s, *(x.seconds for x in res.values())])
    rep.locked_pids = list(r.locked_pids)
    rep.lock_late = list(r.late.values())
    exited = {p for p, e in r.late.items() if e.outcome == "exited"}  # nothing left to hold
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
        elif any(res[p].ok for p in pids[c.id]):
            r.locked_ids.append(c.id)
        # else every GPU process of it exited meanwhile: nothing of it to hold (fenced)
    rep.locked = list(r.locked_ids)
    return fallback


async def _wait_busy(
    hold: Hold, r: Region, busy: list[int], owner: dict[int, str], res: dict[int, LockResult]
) -> None:
    """Lock `busy` (they answered NOT_READY: inside a CUDA call) again, bounded by --lock-wait, into
    `res` and r.late; the driver locks each as its call ends."""
    assert hold.pool is not None
    for p in busy:
        r.late[p] = LateLock(pid=p, command=owner[p], attempts=1, state=res[p].state)
    starts = {p: start_time(p) for p in busy}
    try:
        again = await hold.pool.lock_many(busy, hold.wait)
    except OSError as err:  # the record could not be written: none of these was locked
        again = {p: LockResult(p, False, 0.0, f"lock record unwritable: {err}") for p in busy}
    r.locked_pids.extend(p for p in busy if again[p].ok)
    for p in busy:
        e, x = r.late[p], again[p]
        e.attempts, e.after_s = 2, res[p].seconds + x.seconds
        if x.ok:
            e.outcome = "locked"
        elif _gone(p, starts[p]):
            e.outcome = "exited"
        else:
            e.outcome = "unheld" if not owner[p] else "frozen"
        why = (
            f"inside a CUDA call for over --lock-wait {hold.wait:g}s ({x.error})" if x.not_ready else x.error
        )
        res[p] = LockResult(p, x.ok, e.after_s, why)


def _gone(pid: int, started: int | None) -> bool:
    """Whether `pid` (started at `started`) has exited: no such process, another one, or a zombie."""
    fields = stat_fields(pid)
    return started is None or fields is None or int(fields[19]) != started or fields[0] == b"Z"


def _settle(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


async def wait_exits(pids: Sequence[int], timeout: float) -> list[int]:
    """Wait, up to `timeout`, for `pids` to exit (pidfd readable: their files, GPU ones included,
    are closed by then); returns those that did, the ones already gone among them."""
    loop = asyncio.get_running_loop()
    gone: list[int] = []
    futs: dict[int, asyncio.Future[None]] = {}
    fds: list[int] = []
    try:
        for pid in pids:
            try:
                fd = os.pidfd_open(pid)
            except OSError:  # gone already
                gone.append(pid)
                continue
            fds.append(fd)
            fut: asyncio.Future[None] = loop.create_future()
            loop.add_reader(fd, _settle, fut)
            futs[pid] = fut
        if futs:
            await asyncio.wait(futs.values(), timeout=timeout)
    finally:
        for fd in fds:
            loop.remove_reader(fd)
            os.close(fd)
    return gone + [p for p, f in futs.items() if f.done()]


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
    """The threads of `pids` in uninterruptible sleep, as "tid(wchan)"."""
    return procfs.uninterruptible(pids)
