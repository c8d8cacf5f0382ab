"""The daemon's use of its warm pools (ctxpool): one pool per device, the commands a worker may take
(a launch, or an interpreter adopted from inside a command's tree), warm workers kept towards the
commands running on each device, and what the pools add to a command's report (metering.py puts a
pool's sizes into the metrics).

pools.py says what the pools start with (user, environment); this module serves commands with them.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from krex_async import protocol as P
from krex_async.ctxpool import Pool, PoolConfig, adoption
from krex_async.daemon.commands.access import RequestError, inside
from krex_async.daemon.commands.pools import pool_env, pool_identity
from krex_async.daemon.model.command import Command, CommandState
from krex_async.daemon.model.core import Core, Send
from krex_async.daemon.model.events import WorkerJoined
from krex_async.daemon.regions.engine import Regions
from krex_async.isolation.base import Backend, Group
from krex_async.linux.spawn import Launched, LaunchSpec


def pool_user(name: str) -> tuple[int, int, list[int]] | None:
    """--pool-user as (uid, gid, groups); None for the daemon's own. Raises SystemExit naming an
    unknown user, or a user other than the daemon's when the daemon cannot switch users."""
    try:
        return pool_identity(name)
    except ValueError as e:
        raise SystemExit(f"krex: --pool-user {name!r}: {e}") from None


def _signal_launched(fut: asyncio.Future[Launched | str], signals: list[int]) -> None:
    """Send `signals` to the worker that took an adoption, once it runs the program (a decline
    runs the program in the interpreter, which has them pending)."""
    if fut.cancelled() or not isinstance(launched := fut.result(), Launched):
        return
    for sig in signals:
        if launched.returncode is None:  # still ours to signal: not yet reaped, so not reused
            try:
                os.kill(launched.pid, sig)
            except ProcessLookupError:
                return


class WarmPools:
    def __init__(self, core: Core, regions: Regions) -> None:
        self.core = core
        self.regions = regions  # a region may hold a worker's start, or the command adopting it
        self.pools = core.pools  # device key -> warm workers (--pool-size > 0)
        self.adoptions: dict[str, adoption.Tally] = {}  # command id -> interpreters adopted or not
        self.joining: Group | None = None  # the group of the command a worker is handed to now

    async def start(self, user: tuple[int, int, list[int]] | None = None) -> None:
        """One pool of warm workers per device, run as `user` (pool_user(); None: the daemon's),
        whose commands alone they serve (others are spawned plainly), with the environment
        commands get from the daemon."""
        cfg = self.core.config
        if cfg.pool_size <= 0:
            return
        preload, init = cfg.pool_preload_list, cfg.pool_init_list
        for d in self.core.devices:
            pool = Pool(
                d,
                cgroup_hook=self._join_group,
                config=PoolConfig(
                    size=cfg.pool_size,
                    max_uses=cfg.pool_max_uses,
                    keep_s=cfg.pool_keep_s,
                    preload=preload,
                    init_context=d.vendor != "cpu",
                    init_modules=init,
                ),
                env=pool_env(d.env),
                user=user,
                # a worker started, or back from a command, while a region holds cores is fenced
                on_unsettled=self.regions.cores.fence_worker,
            )
            await pool.start()
            self.pools[d.key] = pool

    def _join_group(self, pid: int, spec: LaunchSpec) -> None:
        """Pool hook: the worker taking a command joins that command's group first. The probes
        learn it is the command's: its parent is the daemon, not the command's leader, and once
        it owns a region it sits in the group's keep/ leaf, whose cgroup they do not know. A
        worker a region holds by the lock holds the command with it (Joins.worker_joined)."""
        if self.joining is not None:
            self.core.backend.join(self.joining, pid)
            cmd = next((c for c in self.core.commands.values() if c.group is self.joining), None)
            if cmd is not None:
                self.regions.worker_joined(cmd, pid)
                self.core.events.emit(WorkerJoined(cmd, pid))  # the probes: its events are the command's

    def launch(self, cmd: Command, spec: LaunchSpec) -> Launched | None:
        """The runner's launcher: `cmd` started in a warm worker, or None (spawn it plainly)."""
        pool = self.pools.get(cmd.device_key or "")
        if pool is None or spec.uid is not None or not pool.accepts(spec):
            return None
        if self.regions.holds_starts(pool.device.key, cmd):
            return None  # a worker's context would arrive unseen mid-region: start it plainly
        self.joining = cmd.group
        try:
            return pool.launch_nowait(spec)
        finally:
            self.joining = None

    def adoptable(self, cmd: Command) -> Pool | None:
        """The pool that may adopt this command's interpreters: its device's, running as the
        command's user, with a backend that can put a worker into the command's group."""
        pool = self.pools.get(cmd.device_key or "")
        if (
            pool is None
            or type(self.core.backend).join is Backend.join
            or not adoption.workers_can_take_fds(pool)
        ):
            return None
        uid, gid, _ = pool.identity
        return pool if (cmd.uid, cmd.gid) == (uid, gid) or cmd.uid == uid == os.geteuid() else None

    def demand(self, device: str | None) -> None:
        """Pool sizing: keep warm workers towards the commands running on the device."""
        pool = self.pools.get(device or "")
        if pool is not None:
            commands = self.core.commands
            q = self.core.scheduler.devices[pool.device.key]
            live = (CommandState.STARTING, CommandState.RUNNING)
            pool.set_demand(sum(commands[c].state in live for c in q.commands if c in commands))

    async def adopt(self, req: P.Adopt, peer_pid: int, send: Send) -> None:
        """An interpreter of a command asks to be run by a warm worker (ctxpool/adoption.py)."""
        cmd = self.core.commands.get(req.command)
        if cmd is None:
            raise RequestError("unknown_command", f"no command {req.command!r}")
        inside(self.core, cmd, peer_pid, req.token, req.pid)
        if self.core.closing:
            raise RequestError("shutdown", "the daemon is shutting down")
        pool = self.adoptable(cmd)
        tally = self.adoptions.setdefault(cmd.id, adoption.Tally())

        taken: list[Any] = []  # the worker reserved for this adoption until it is handed over
        since = req.blocked_at or time.monotonic()

        def hand(spec: LaunchSpec, pidfd: int, adopt: dict[str, Any]) -> Any:
            assert pool is not None
            self.joining = cmd.group
            try:
                fut = pool.adopt(spec, pidfd, adopt, worker=taken.pop())
            finally:
                self.joining = None
            # The worker is in the command's tree from here on, so the tree's signals reach it;
            # those sent before, while the interpreter waited with them blocked (a cancel), reach
            # it once it runs the program, as they would have reached a fresh interpreter.
            missed = [sig for t, sig in cmd.signalled if t >= since]
            if missed:
                fut.add_done_callback(lambda f: _signal_launched(f, missed))
            return fut

        async def prepare() -> str | None:
            """Once the adoption is allowed (a refused one never waits): reserve a worker, waiting
            a little for a warming one (a burst outruns the refill; first come, first served), then
            hold the command if a region needs it held."""
            assert pool is not None
            worker = await pool.take(self.core.config.pool_wait)
            if worker is None:
                return "no warm worker"
            taken.append(worker)
            await self.regions.hold_arrival(cmd, worker.pid)
            return None

        cmd.adopters.add(peer_pid)
        cmd.adopted_ended_at = 0.0
        try:
            ran = await adoption.serve(pool, req, peer_pid, send, hand, tally, prepare=prepare)
            # ran: its interpreter leaves (Command.leaving); declined: it runs the program itself
            cmd.adopted_ended_at = time.monotonic() if ran else 0.0
        finally:
            cmd.adopters.discard(peer_pid)
            if taken and pool is not None:  # reserved, never handed over (no pidfd, cancelled)
                pool.untake(taken.pop())

    def declined(self, cmd: Command, reason: str) -> None:
        """An interpreter of `cmd` that its runtime ran itself, not adopted, and why (QuiesceReady)."""
        self.adoptions.setdefault(cmd.id, adoption.Tally()).decline(reason, self.adoptable(cmd))

    def report(self, command: str, report: P.CommandReport) -> bool:
        """Put the command's adoptions into its report; whether it had any to put."""
        tally = self.adoptions.get(command)
        if tally is not None:
            report.pool_adopted, report.pool_declined = tally.adopted, dict(tally.declined)
        return tally is not None

    def forget(self, cmd: Command) -> None:
        self.adoptions.pop(cmd.id, None)

    async def close(self) -> None:
        for pool in self.pools.values():
            await pool.close()
