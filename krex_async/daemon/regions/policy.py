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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from krex_async import logs
from krex_async.isolation.cudalock import Driver, LockPool, open_driver, release_left
from krex_async.linux import procfs

if TYPE_CHECKING:
    from krex_async.daemon.model.core import Core

log = logs.get("krex.hold")


@dataclass
class Plan:
    """One region's hold: `how` ("lock" or "freeze") and, for a freeze where a lock was asked for,
    why not; the commands to lock (with their GPU-holding pids) and those to freeze."""

    how: str
    why: str = ""
    to_lock: dict[str, list[int]] = field(default_factory=dict)  # command id -> pids
    to_freeze: list[str] = field(default_factory=list)


class HoldPolicy:
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
        self.wait = wait  # for a sibling inside a CUDA call: HoldSet.lock
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

    def status_on(self, core: Core) -> dict[str, object]:
        """`status`, the exit waits, and per device how and whom a region there would hold now
        (and why not by the lock)."""
        st: dict[str, object] = dict(self.status())
        st["exit_wait_s"] = core.config.exit_wait  # 0: an exit in user space is frozen
        st["exit_starve_s"] = core.config.exit_starve  # ... until it began this long ago
        st["exit_kernel_wait_s"] = core.config.exit_kernel_wait  # the longest wait for one in the kernel
        probes = core.attributor is not None
        st["devices"] = {
            d.key: {
                "hold": (how := self.how(d.vendor))[0],
                "why": how[1],
                "freeze": self.who(d.vendor, probes),
            }
            for d in core.devices
        }
        return st

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()


# ------------------------------------------------------------------------- exits and stuck threads


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


def d_state(pids: list[int]) -> list[str]:
    """The threads of `pids` in uninterruptible sleep, as "tid(wchan)"."""
    return procfs.uninterruptible(pids)
