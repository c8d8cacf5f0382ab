"""Commands that meet a region already under way on their device: one that begins running during
it (started frozen into it, or joined to it), a sibling the probes see open a GPU device, a command
about to gain a warm pool worker mid-region. None stays frozen without a region to thaw it, and
none runs through a region it should be held for.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING

from krex_async import logs
from krex_async import protocol as P
from krex_async.daemon.model.command import Command
from krex_async.daemon.model.core import Core, Outcome, Region, Send
from krex_async.daemon.regions.exits import Exits
from krex_async.daemon.regions.policy import HoldPolicy
from krex_async.isolation.base import Group, IsolationError

if TYPE_CHECKING:
    from krex_async.probes.base import ProbeEvent

log = logs.get("krex.region")

LIVE = (Outcome.OPEN, Outcome.HELD)  # entering or held: a region a command may still meet


class Joins:
    def __init__(
        self, core: Core, hold: HoldPolicy, holder_on: Callable[[str], Region | None], exits: Exits
    ) -> None:
        self.core = core
        self.hold = hold  # whom a region holds: all, or the device holders alone
        self.holder_on = holder_on  # Regions.holder_on: the region that holds a device now
        self.exits = exits  # an exit that need not wait for a region's end is noted there at once

    def freeze_late(self, r: Region, ev: ProbeEvent) -> None:
        """--freeze device-holders, or a sibling held by the lock: a sibling process that opened a
        GPU device since the region chose whom to hold (its entry included) is frozen with its
        command as soon as the probes see the open (an open during the region is a stray)."""
        if r.outcome not in LIVE or r.select_ns is None or ev.ts_ns < r.select_ns:
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
        if r.outcome is Outcome.OPEN and cmd.id in r.targets:
            return  # the entry holds it already (frozen, or its lock under way)
        if self.hold.who_on(self.core, r.device) != "device-holders" and cmd.id not in r.held.locked_ids:
            return
        late = r.held.late.get(ev.tgid)
        if late is not None and late.outcome == "locked":
            return  # locked as its CUDA call ended: that call's driver calls are its last
        self.core.track(asyncio.get_running_loop().create_task(self._freeze_into(r, cmd, cmd.group, "late")))

    def current_on(self, device: str) -> Region | None:
        """The region isolating or held on `device` that a command may still join (not one that
        waits, its turn come, for its siblings' share: they run meanwhile)."""
        r = self.holder_on(device)
        if r is None or r.sharing or r.held.releasing or r.outcome not in LIVE:
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
            current.held.add_frozen(group, cmd.id)
            return
        if admitted is not None:
            await self.core.backend.thaw(group)
        if current is None or cmd.id in current.held.frozen_ids or not self._freezes_starts(current.device):
            return
        task = asyncio.get_running_loop().create_task(self._freeze_into(current, cmd, group, "join"))
        current.joins.append(task)
        await task

    async def _freeze_into(self, r: Region, cmd: Command, group: Group, why: str) -> None:
        """Freeze a command after the region froze its targets (`why`: "join", a command that
        began running meanwhile; "late", a device holder the probes saw): into the region while
        it is still current, else undone at once."""
        # a burst of GPU opens (a CUDA initialisation opens several files) freezes it once
        async with r.held.late_freeze(cmd.id) as todo:
            if not todo:
                return
            try:
                await self.core.backend.freeze(group, timeout=self.core.config.freeze_timeout)
            except (IsolationError, OSError) as e:  # FreezeError included: the backend undid it
                log.warning(f"{why}_freeze_failed", region=r.id, command=cmd.id, error=str(e))
                return
            finally:
                r.held.freeze_tried(cmd.id)
            if self.current_on(r.device) is r:
                r.held.add_frozen(group, cmd.id, in_entry=r.outcome is Outcome.OPEN and why == "late")
                self.core.trace("freeze", r, command=cmd.id, late=True)
                return
            try:  # the region began releasing while this one froze (and waits for it): undo now
                await self.core.backend.thaw(group)
            except Exception as e:  # noqa: BLE001 - logged: nothing else would thaw it
                log.error("thaw_failed", region=r.id, group=group.name, error=repr(e))

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
        if r is None or r.command is cmd or cmd.group.frozen or cmd.id in r.held.frozen_ids:
            return
        if self.hold.who_on(self.core, r.device) != "device-holders" and cmd.id not in r.held.locked_ids:
            return  # --freeze all: a running command is frozen, or locked, as a target already
        if worker in r.held.locked_pids:
            return
        await self._freeze_into(r, cmd, cmd.group, "adopt")

    def exit_held(self, pid: int, send: Send) -> None:
        """A process holding a GPU file that no region locked is exiting (ExitHeld): its exit waits
        for the end of a region of another command on its device, if one runs (the region's owner
        just released often exits while the next region times), and is resumed at once otherwise.
        Either way the region granted next on the device waits, up to --lock-wait, for the exit to
        finish (Exits.exiting): the driver frees the process's GPU memory."""
        cmd = next((c for c in self.core.commands.values() if c.runtimes.get(pid) == send), None)
        if cmd is None or cmd.device is None or not self.core.scheduler.isolates() or self.core.closing:
            send(P.Resume(id=0, region=""))  # (no region holds a device under shared or command)
            return
        device = cmd.device.key
        r = self.current_on(device)  # entering or held there, not a queued one
        if r is not None and (r.command is cmd or (r.ended is not None and r.ended.done())):
            r = None  # its own command's, or ending (released, withdrawn): nothing to wait for
        if r is None:
            self.exits.note_exiting(pid, device)
            send(P.Resume(id=0, region=""))
        else:
            r.held.wait_exit(pid, send)

    def worker_joined(self, cmd: Command, worker: int) -> None:
        """The warm worker `worker` has just joined `cmd` (an adoption, or a launch). One that the
        region on the device holds by the lock (an idle worker locked at its entry) holds the
        command with it: its program's CUDA calls block until the release. Unless the region
        holds the command already, it is named among the locked ones, so that a cancel kills it
        at once (Regions.holding) and `krex status` and the region's report count it, once."""
        r = self.holder_on(cmd.device_key) if cmd.device_key is not None else None
        if r is None or r.command is cmd or worker not in r.held.locked_pids or r.held.holds(cmd.id):
            return
        r.held.add_locked(cmd.id)

    def workers_held(self, r: Region) -> bool:
        """Whether every idle warm worker of the region's device is locked into it (so one taken
        mid-region by a command the region does not hold starts no GPU work); with none idle,
        nothing can be handed over (adopt() and launch() take only an idle one, at once)."""
        pool = self.core.pools.get(r.device)
        return pool is None or set(pool.idle_pids()) <= set(r.held.locked_pids)

    def holds_starts(self, device: str, cmd: Command) -> bool:
        """Whether a warm worker may not be handed a command starting now on `device`: a region
        there holds GPU holders only (device-holders) and would not hold the worker's context."""
        r = self.current_on(device)
        return (
            r is not None
            and r.command is not cmd
            and self.hold.who_on(self.core, r.device) == "device-holders"
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
        return self.hold.who_on(self.core, device) != "device-holders"
