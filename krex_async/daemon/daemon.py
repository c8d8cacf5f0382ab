"""The daemon's state and its answers to requests. One event loop owns all of it.

`Daemon` holds the devices, the scheduler, the commands (running, queued, and ended ones whose results
are kept for their agents), the regions, and the isolation backend. `server.py` feeds it decoded
requests with the peer's credentials; every handler answers through the connection's `send`.
What `krex status` sees of it is status.py's.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import os
import secrets
import signal
from collections.abc import Callable
from typing import Any

from krex_async import logs
from krex_async import protocol as P
from krex_async.ctxpool import Pool, adoption
from krex_async.daemon.access import RequestError, inside, own, run_as
from krex_async.daemon.attribution import Attributor
from krex_async.daemon.commands import (
    Command,
    CommandRunner,
    CommandState,
    SpecError,
    Subscriber,
)
from krex_async.daemon.config import ServeConfig
from krex_async.daemon.core import Core, Send
from krex_async.daemon.metrics import Metrics
from krex_async.daemon.placement import choose
from krex_async.daemon.records import Records
from krex_async.daemon.recovery import recover
from krex_async.daemon.regions import Regions
from krex_async.daemon.spool import Spool
from krex_async.daemon.status import Status
from krex_async.daemon.stdinpipe import StdinBusy, StdinClosed, StdinPipe
from krex_async.daemon.tracing import Tracer
from krex_async.daemon.warmpools import WarmPools
from krex_async.devices import Node
from krex_async.devices.base import Device
from krex_async.isolation.base import Backend
from krex_async.scheduler import Scheduler

log = logs.get("krex.daemon")


class Daemon:
    def __init__(
        self, config: ServeConfig, backend: Backend, devices: list[Device], node: Node | None = None
    ) -> None:
        self.config = config
        self.backend = backend
        self.devices = devices
        self.node = node  # the opened vendor libraries, for live queries (status)
        self.all_cpus = frozenset(os.sched_getaffinity(0))
        self.scheduler = Scheduler(config.policy, [d.key for d in devices])
        self.commands: dict[str, Command] = {}
        self.probes: dict[str, Any] = {"state": "off", "backend": None, "reason": ""}  # start_probes
        self.pools: dict[str, Pool] = {}  # device key -> warm workers (--pool-size > 0)
        # Spool files and command records live in the state dir (none without one: a bare config).
        self.records = Records(config.state_dir) if config.state_dir else None
        spool = Spool(config.state_dir, config.spool_limit) if config.state_dir else None
        self.tasks: set[asyncio.Task[Any]] = set()
        self.tracer = Tracer()
        self.tracers = self.tracer.subscribers  # server.py adds `krex trace` peers here
        self.metrics = Metrics()  # always callable; the endpoint starts only with --metrics
        # What regions, attribution and recovery share with the daemon: these same objects.
        self.core = Core(
            config=config,
            backend=backend,
            devices=devices,
            node=node,
            scheduler=self.scheduler,
            commands=self.commands,
            pools=self.pools,
            metrics=self.metrics,
            trace=self.tracer.trace,
            track=self.track,
            records=self.records,
            spool=spool,
            probes=self.probes,
            tracers=self.tracers,
            all_cpus=self.all_cpus,
        )
        self.regions = Regions(self.core)
        self.warm = WarmPools(self.core, self.regions)
        self.runner = CommandRunner(
            backend,
            config.socket,
            self._on_exit,
            launcher=self.warm.launch,
            spool=spool,
            records=self.records,
        )
        self._attributor: Attributor | None = None  # set when probes run
        self._ids = itertools.count(1)
        # Unique across daemons and restarts (two started in one second shared ids once): a
        # command id names cgroups, records and spool files that another daemon must not meet.
        self._boot = secrets.token_hex(4)
        self.status = Status(self.core, self.regions, self.warm.adoptions, self._boot)
        recover(self.core, self.forget)  # a dead daemon's commands: ended and reported (recovery.py)

    @property
    def attributor(self) -> Attributor | None:
        """The probe attributor while probes run (server.start_probes sets it)."""
        return self._attributor

    @attributor.setter
    def attributor(self, attributor: Attributor | None) -> None:
        self._attributor = attributor
        self.core.attributor = attributor  # regions ask it through the core

    # ---------------------------------------------------------------------------------- helpers

    async def start_pools(self, user: tuple[int, int, list[int]] | None = None) -> None:
        await self.warm.start(user)

    async def adopt(self, req: P.Adopt, peer_pid: int, send: Send) -> None:
        await self.warm.adopt(req, peer_pid, send)

    def track(self, task: asyncio.Task[Any]) -> asyncio.Task[Any]:
        self.tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("task_failed", task=task.get_name(), error=repr(task.exception()))

    def device(self, key: str) -> Device:
        return next(d for d in self.devices if d.key == key)

    # --------------------------------------------------------------------------------- commands

    async def submit(self, req: P.Submit, uid: int, gid: int, send: Send, admin: bool = False) -> None:
        """Start (or queue) a command for `uid`. Raises RequestError; `admin` (root, --admin-group)
        lifts the per-user limit, never the node-wide one."""
        if self.core.closing:
            raise RequestError("shutdown", "the daemon is shutting down")
        if req.run_as is not None and req.run_as != uid:
            uid, gid = run_as(req.run_as, uid)
        if len(self.commands) >= self.config.max_commands:
            raise RequestError(
                "busy",
                f"{len(self.commands)} commands are queued, running or "
                "kept (--max-commands); retry after some have ended",
            )
        if not admin:
            mine = sum(c.uid == uid for c in self.commands.values())
            if mine >= self.config.max_commands_per_user:
                raise RequestError(
                    "busy",
                    f"{mine} of your commands are queued, running or kept "
                    "(--max-commands-per-user); retry after some have ended",
                )
        device = choose(self.core, req)
        cid = f"{self._boot}-{next(self._ids)}"
        while cid in self.commands:  # a dead daemon's command, recovered, started in the same second
            cid = f"{self._boot}-{next(self._ids)}"
        cmd = Command(
            id=cid,
            spec=req,
            uid=uid,
            gid=gid,
            device=device,
            policy=self.scheduler.policy,
            tail_limit=self.config.output_tail,
        )
        if (pool := self.warm.adoptable(cmd)) is not None:
            cmd.pool_env = {"KREX_POOL": adoption.pool_env(pool)}
        try:
            self.runner.check(cmd)
        except SpecError as e:
            raise RequestError(e.code, str(e)) from None
        cmd.subscribers.append(Subscriber(send, req.id, req.stream))
        if req.stdin_stream:
            cmd.stdin_pipe = StdinPipe()
        self.commands[cid] = cmd
        start_now = self.scheduler.add_command(cid, cmd.device_key)
        send(P.Accepted(id=req.id, command=cid, device=cmd.device_key or "none", queued=not start_now))
        self.metrics.command_submitted(cmd.policy_name, cmd.device_key or "none", not start_now, cid)
        log.info(
            "command_submitted",
            command=cid,
            argv=req.argv[:8],
            device=cmd.device_key,
            queued=not start_now,
            uid=uid,
        )
        if start_now:
            # Its own task: the connection's tasks are cancelled when the agent leaves, and a start
            # cancelled between creating the group and watching the leader would strand the command
            # ('starting' for ever, no report). The agent still hears of a failure here.
            await asyncio.shield(
                self.track(asyncio.get_running_loop().create_task(self._start(cmd), name=f"start-{cid}"))
            )

    async def _start(self, cmd: Command) -> None:
        # ended (cancelled, shut down) after its start was scheduled
        if cmd.state != CommandState.QUEUED:
            return
        if self.core.closing:  # promoted while the daemon shuts down: it never runs
            self._end_unstarted(cmd, "shutdown", "the daemon shut down first")
            return
        region = self.regions.admit_frozen(cmd)
        try:
            await self.runner.start(cmd, frozen=region is not None, cores=self.regions.cores.for_new())
        except SpecError as e:
            self._end_unstarted(cmd, "failed", str(e))
            return
        except Exception as e:  # a bug on the way: the command ends, said so, its device is freed
            log.exception("command_start_failed", command=cmd.id)
            if cmd.state == CommandState.STARTING and cmd.launched is None:
                await self.runner.abandon(cmd)
                self._end_unstarted(cmd, "failed", f"internal error while starting: {e!r}")
            raise
        if cmd.kill_pending is not None:  # cancelled (or shut down) while it was starting
            await self.runner.kill(cmd, *cmd.kill_pending)
        await self.regions.join(cmd, region)
        self.warm.demand(cmd.device_key)
        if self.attributor is not None:
            self.attributor.command_started(cmd)
        cmd.publish(lambda rid: P.Started(id=rid, command=cmd.id, pid=cmd.pid or 0))
        self.metrics.command_started(
            cmd.policy_name, cmd.device_key or "none", cmd.launched.via if cmd.launched else "exec", cmd.id
        )
        self.tracer.trace(
            "command_start",
            None,
            command=cmd.id,
            device=cmd.device_key or "",
            pid=cmd.pid or 0,
            frozen=region is not None,
        )

    def _end_unstarted(self, cmd: Command, state: str, error: str) -> None:
        """End a command that never ran (cancelled or shut down while queued, or its spawn failed):
        out of its device's queue at once, then reported like any other."""
        promoted = self.scheduler.end_command(cmd.id, cmd.device_key)  # it may have held the device
        cmd.state = CommandState.ENDED
        cmd.report = P.CommandReport(
            command=cmd.id,
            argv=list(cmd.spec.argv),
            device=cmd.device_key or "none",
            policy=cmd.policy_name,
            state=state,
            error=error,
            label=cmd.spec.label,
        )
        loop = asyncio.get_running_loop()
        for nxt in promoted:
            self.track(loop.create_task(self._start(self.commands[nxt])))
        self._on_exit(cmd)

    def _on_exit(self, cmd: Command) -> None:
        self.track(asyncio.get_running_loop().create_task(self._finalize(cmd)))

    async def _finalize(self, cmd: Command) -> None:
        """A command ended: release its regions (so its report has their outcome), promote waiters,
        deliver its report, and keep it for the retention time."""
        if cmd.stdin_pipe is not None:  # what its children still read sees EOF, as after a shell
            cmd.stdin_pipe.close()
        for other in self.regions.active.values():  # held by another's region, it ended all the same
            rep = other.report
            if rep.outcome == "held" and cmd.id in other.locked_ids and cmd.id not in rep.held_exited:
                rep.held_exited.append(cmd.id)
        ending = []
        for rid in self.scheduler.regions_of(cmd.id):
            r = self.regions.active.get(rid)
            if r is not None:
                r.end("owner-died")
                if r.task is not None:
                    ending.append(r.task)
        if ending:
            await asyncio.wait(ending, timeout=10)
        loop = asyncio.get_running_loop()
        for nxt in self.scheduler.end_command(cmd.id, cmd.device_key):
            self.track(loop.create_task(self._start(self.commands[nxt])))
        assert cmd.report is not None
        adopted = self.warm.report(cmd.id, cmd.report)
        if self.records is not None and (cmd.regions or adopted):
            self.records.ended(cmd.id, cmd.report)  # again: with its regions' and the pool's parts
        self.warm.demand(cmd.device_key)
        cmd.slim()  # kept for --retention: only what a report and an attach need
        cmd.done.set()
        report = cmd.report
        self.warm.ended(report)
        # Before the agent hears of it: a scrape after a report always includes that command.
        self.metrics.command_ended(
            report.policy,
            report.state,
            report.wall_s,
            cmd.id,
            started=cmd.launched is not None,
            device=report.device,
        )
        cmd.publish_exit(report)
        self.tracer.trace(
            "command_end",
            None,
            command=cmd.id,
            device=cmd.device_key or "",
            state=report.state,
            exit_code=report.exit_code,
        )
        log.info(
            "command",
            command=cmd.id,
            state=report.state,
            exit_code=report.exit_code,
            signal=report.signal,
            wall_s=round(report.wall_s, 6),
            queued_s=round(report.queued_s, 6),
            regions=len(report.regions),
            device=report.device,
            via=report.via,
            pool_adopted=report.pool_adopted,
            pool_declined=report.pool_declined or None,
        )
        if cmd.group is not None:
            try:
                await self.backend.remove(cmd.group)
            except Exception as e:  # a leftover group is logged; the retention below must still run
                log.error("group_remove_failed", command=cmd.id, error=repr(e))
        if self.attributor is not None:
            loop.call_later(1.0, self.attributor.command_ended, cmd)  # late events still attribute
        loop.call_later(self.config.retention, self.forget, cmd)

    def forget(self, cmd: Command) -> None:
        """The command's retention ended: drop it, its spool files and its record."""
        if self.commands.get(cmd.id) is cmd:
            del self.commands[cmd.id]
            self.warm.forget(cmd)
        self.runner.release(cmd)

    async def cancel(self, req: P.Cancel, uid: int) -> None:
        cmd = own(self.core, req.command, uid)
        if cmd.state == CommandState.QUEUED:
            self._end_unstarted(cmd, "cancelled", "cancelled before it started")
        elif cmd.state == CommandState.RUNNING:
            await self.runner.kill(cmd, "cancelled", req.signal)
        elif cmd.state == CommandState.STARTING:
            # no process to signal yet: _start kills it once it runs
            cmd.kill_pending = cmd.kill_pending or ("cancelled", req.signal)

    async def stdin(self, req: P.StdinData, uid: int) -> None:
        """Feed a command's stdin pipe (Submit.stdin_stream); returns once written (flow control:
        a command that does not read holds its agent's next chunk back). Raises RequestError."""
        cmd = own(self.core, req.command, uid)
        if cmd.stdin_pipe is None:
            raise RequestError("bad_request", f"command {cmd.id} was not submitted with stdin_stream")
        try:
            await cmd.stdin_pipe.write(req.data, req.eof)
        except StdinClosed as e:
            raise RequestError("stdin_closed", f"{cmd.id}: {e}") from None
        except StdinBusy as e:
            raise RequestError("busy", f"{cmd.id}: {e}") from None

    def attach(self, req: P.Attach, uid: int, send: Send) -> None:
        cmd = own(self.core, req.command, uid)
        send(
            P.Accepted(
                id=req.id,
                command=cmd.id,
                device=cmd.device_key or "none",
                queued=cmd.state == CommandState.QUEUED,
            )
        )
        if cmd.state == CommandState.ENDED:
            assert cmd.report is not None
            send(
                P.Exited(
                    id=req.id,
                    report=cmd.report,
                    stdout_tail=bytes(cmd.out.buf),
                    stderr_tail=bytes(cmd.err.buf),
                )
            )
        else:
            # What it wrote before this attach (the kept tails; the spool files hold all), then
            # what it writes from now on: an agent that reconnects misses nothing the daemon kept.
            for stream, tail in (("stdout", cmd.out), ("stderr", cmd.err)):
                if tail.buf:
                    send(P.Output(id=req.id, command=cmd.id, stream=stream, data=bytes(tail.buf)))  # type: ignore[arg-type]
            cmd.subscribers.append(Subscriber(send, req.id, True))

    def disconnected(self, send: Send) -> None:
        """A connection closed: end the regions it held and the commands only it was watching."""
        for r in list(self.regions.active.values()):
            if r.send == send:
                r.end("owner-died")
        for cmd in self.commands.values():
            cmd.runtimes = {p: s for p, s in cmd.runtimes.items() if s != send}
            before = len(cmd.subscribers)
            cmd.subscribers = [s for s in cmd.subscribers if s.send != send]
            if (
                before
                and not cmd.subscribers
                and cmd.state in (CommandState.QUEUED, CommandState.STARTING, CommandState.RUNNING)
                and cmd.spec.on_disconnect == "kill"
            ):
                log.info("agent_disconnected", command=cmd.id, action="kill")
                self.track(
                    asyncio.get_running_loop().create_task(
                        self.cancel(P.Cancel(id=0, command=cmd.id, signal=9), 0)
                    )
                )
        self.tracer.drop(send)

    # ---------------------------------------------------------------------------------- regions

    def region_enter(self, req: P.RegionEnter, peer_pid: int, send: Send) -> None:
        cmd = self.commands.get(req.command)
        if cmd is None:
            raise RequestError("unknown_command", f"no command {req.command!r}")
        pid = inside(self.core, cmd, peer_pid, req.token, req.pid)
        if cmd.device is None:
            raise RequestError("bad_request", f"command {cmd.id} has no device (device=none)")
        if self.core.closing:
            raise RequestError("shutdown", "the daemon is shutting down")
        if self.regions.by_owner_pid(cmd, pid) is not None:
            raise RequestError(
                "bad_request", f"pid {pid} already holds or awaits a region: regions do not nest"
            )
        self.regions.create(cmd, req, pid, send)

    def region_exit(self, req: P.RegionExit, peer_pid: int) -> None:
        r = self.regions.active.get(req.region)
        if r is None:
            raise RequestError("unknown_region", f"no active region {req.region!r}")
        if not hmac.compare_digest(req.token.encode(), r.command.token.encode()) or r.pid != peer_pid:
            raise RequestError("forbidden", f"region {req.region} belongs to another process")
        r.exit_id = req.id
        if req.drain:
            r.report.drain = req.drain
            r.report.drain_s = req.drain_s
            r.report.drain_window_s = self.config.drain_window
        r.report.warm_s = req.warm_s
        r.end("released")

    def quiesce_ready(self, req: P.QuiesceReady, peer_pid: int, send: Send) -> None:
        cmd = self.commands.get(req.command)
        if cmd is None:
            raise RequestError("unknown_command", f"no command {req.command!r}")
        pid = inside(self.core, cmd, peer_pid, req.token, req.pid)
        cmd.runtimes[pid] = send
        if req.pool_declined:
            self.warm.declined(cmd, req.pool_declined)

    def exit_held(self, req: P.ExitHeld, peer_pid: int, send: Send) -> None:
        """A command's process holding a GPU file is exiting: its runtime waits for a Resume.

        Locked by `req.region`: that region's release resumes it (the runtime was told Held). Else
        the exit waits for the end of a region of another command on its device, if one runs (the
        region's owner just released often exits while the next region times), and is resumed at
        once otherwise. Either way the region granted next on the device waits, up to --lock-wait,
        for the exit to finish (Regions.exiting): the driver frees the process's GPU memory."""
        regions = self.regions
        if req.region:  # its Resume comes with that region's release (or came: it is over)
            r = regions.active.get(req.region)
            if r is not None and peer_pid in r.locked_pids and peer_pid not in r.report.exit_deferred:
                r.report.exit_deferred.append(peer_pid)
                regions.note_exiting(peer_pid, r.device)
            return
        cmd = next((c for c in self.commands.values() if c.runtimes.get(peer_pid) == send), None)
        if cmd is None or cmd.device is None or not self.scheduler.isolates() or self.core.closing:
            send(P.Resume(id=0, region=""))  # (no region holds a device under shared or command)
            return
        device = cmd.device.key
        r = regions.current_on(device)  # entering or held there, not a queued one
        if r is not None and (r.command is cmd or (r.ended is not None and r.ended.done())):
            r = None  # its own command's, or ending (released, withdrawn): nothing to wait for
        if r is None:
            regions.note_exiting(peer_pid, device)
            send(P.Resume(id=0, region=""))
        else:
            r.exit_waiters[peer_pid] = send
            r.report.exit_deferred.append(peer_pid)

    def quiesce_ack(self, req: P.QuiesceAck, peer_pid: int) -> None:
        r = self.regions.active.get(req.region)
        if r is not None:
            self.regions.drain.ack(r.command, peer_pid, req)

    def send_timeline(
        self, req: P.Timeline, send: Send, visible: Callable[[P.TraceEvent], bool] | None = None
    ) -> None:
        self.tracer.send_timeline(req, send, visible)

    # --------------------------------------------------------------------------------- shutdown

    async def shutdown(self) -> None:
        """End every region (thawing), then every command: SIGTERM, then SIGKILL after the grace."""
        self.core.closing = True
        for r in list(self.regions.active.values()):
            r.end("shutdown")
        region_tasks = [r.task for r in self.regions.active.values() if r.task]
        if region_tasks:
            await asyncio.wait(region_tasks, timeout=5)
        live = [c for c in self.commands.values() if c.state is not CommandState.ENDED]
        for c in live:
            if c.state == CommandState.QUEUED:
                self._end_unstarted(c, "shutdown", "the daemon shut down first")
            elif c.state == CommandState.STARTING:
                c.kill_pending = ("shutdown", signal.SIGTERM)
            elif c.group is not None:
                if c.group.frozen:
                    await self.backend.thaw(c.group)
                await self.runner.kill(c, "shutdown", signal.SIGTERM)
        waits = [asyncio.ensure_future(c.done.wait()) for c in live if c.state != CommandState.ENDED]
        if waits:
            _, pending = await asyncio.wait(waits, timeout=self.config.kill_grace)
            if pending:
                for c in live:
                    if c.state == CommandState.RUNNING and c.group is not None:
                        await self.backend.kill(c.group, signal.SIGKILL)
                await asyncio.wait(pending, timeout=5)
        await self.warm.close()
        if self.attributor is not None:
            self.attributor.backend.stop()
        await self.backend.close()
        self.regions.hold.close()
        if self.node is not None:
            self.node.close()
