"""A command's life in the daemon: submitted (checked, placed, queued), started, ended and reported,
kept for its agent until --retention passes, then forgotten; and what its agent may do meanwhile
(attach, feed stdin, cancel, leave).

`CommandRunner` (runner.py) spawns and watches the processes; this module decides when, and what the
rest of the daemon hears: the scheduler's queues, the regions a command held, the warm pools, the
metrics, the trace, the durable record.
"""

from __future__ import annotations

import asyncio
import itertools
import signal
import time

from krex_async import logs
from krex_async import protocol as P
from krex_async.ctxpool import adoption
from krex_async.daemon.commands import memsample, reruns
from krex_async.daemon.commands.access import RequestError, own, run_as
from krex_async.daemon.commands.admission import Admission
from krex_async.daemon.commands.placement import choose
from krex_async.daemon.commands.report import signal_name
from krex_async.daemon.commands.runner import CommandRunner
from krex_async.daemon.commands.warmpools import WarmPools
from krex_async.daemon.model import events as E
from krex_async.daemon.model.command import Command, CommandState, SpecError, Subscriber
from krex_async.daemon.model.core import Core, Send
from krex_async.daemon.model.stdinpipe import StdinBusy, StdinClosed, StdinPipe
from krex_async.daemon.regions.engine import Regions

log = logs.get("krex.daemon")


class Lifecycle:
    def __init__(self, core: Core, regions: Regions, warm: WarmPools, boot: str) -> None:
        self.core = core
        self.regions = regions  # a command's regions end with it; one may hold its start frozen
        self.warm = warm  # a warm worker may start it, or adopt its interpreters
        self.runner = CommandRunner(
            core.backend,
            core.config.socket,
            self._on_exit,
            launcher=warm.launch,  # a warm worker starts what it can take
            spool=core.spool,
            records=core.records,
        )
        self.boot = boot  # every command id starts with it (Daemon: unique across daemons)
        self._ids = itertools.count(1)
        self.admission = Admission(core)  # a command starts only when it fits in device memory
        if self.admission.devices and core.config.mem_gate == "on":
            core.events.subscribe(E.RegionReleased, self._region_released)

    async def submit(self, req: P.Submit, uid: int, gid: int, send: Send, admin: bool = False) -> None:
        """Start (or queue) a command for `uid`. Raises RequestError; `admin` (root, --admin-group)
        lifts the per-user limit, never the node-wide one."""
        if self.core.closing:
            raise RequestError("shutdown", "the daemon is shutting down")
        if req.run_as is not None and req.run_as != uid:
            uid, gid = run_as(req.run_as, uid, self.core.config.run_as_peers)
        if len(self.core.commands) >= self.core.config.max_commands:
            raise RequestError(
                "busy",
                f"{len(self.core.commands)} commands are queued, running or "
                "kept (--max-commands); retry after some have ended",
            )
        if not admin:
            mine = sum(c.uid == uid for c in self.core.commands.values())
            if mine >= self.core.config.max_commands_per_user:
                raise RequestError(
                    "busy",
                    f"{mine} of your commands are queued, running or kept "
                    "(--max-commands-per-user); retry after some have ended",
                )
        if req.rerun_on_oom and (req.stdin is not None or req.stdin_stream):
            raise RequestError(
                "bad_spec", "rerun_on_oom needs a command without stdin: a re-run could not feed it again"
            )
        device = choose(self.core, req, uid, self.admission)
        cid = f"{self.boot}-{next(self._ids)}"
        while cid in self.core.commands:  # a dead daemon's command, recovered, started in the same second
            cid = f"{self.boot}-{next(self._ids)}"
        cmd = Command(
            id=cid,
            spec=req,
            uid=uid,
            gid=gid,
            device=device,
            policy=self.core.scheduler.policy,
            tail_limit=self.core.config.output_tail,
        )
        if device is not None and (why := self.admission.too_large(cmd, device)):
            raise RequestError("too_large", why)
        if (pool := self.warm.adoptable(cmd)) is not None:
            cmd.pool_env = {"KREX_POOL": adoption.pool_env(pool)}
        try:
            self.runner.check(cmd)
        except SpecError as e:
            raise RequestError(e.code, str(e)) from None
        cmd.subscribers.append(Subscriber(send, req.id, req.stream))
        if req.stdin_stream:
            cmd.stdin_pipe = StdinPipe()
        self.core.commands[cid] = cmd
        start_now = self.core.scheduler.add_command(cid, cmd.device_key) and self.admission.admit(cmd)
        send(P.Accepted(id=req.id, command=cid, device=cmd.device_key or "none", queued=not start_now))
        self.core.events.emit(E.CommandSubmitted(cmd, queued=not start_now))
        log.info(
            "command_submitted",
            command=cid,
            argv=req.argv[:8],
            device=cmd.device_key,
            queued=not start_now,
            uid=uid,
            waits_for=cmd.mem_wait or None,
        )
        if start_now:
            # Its own task: the connection's tasks are cancelled when the agent leaves, and a start
            # cancelled between creating the group and watching the leader would strand the command
            # ('starting' for ever, no report). The agent still hears of a failure here.
            await asyncio.shield(
                self.core.track(asyncio.get_running_loop().create_task(self._start(cmd), name=f"start-{cid}"))
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
            await self.runner.start(cmd, frozen=region is not None, cores=self.regions.cores_for_new())
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
            reason, sig = cmd.kill_pending
            await self.runner.kill(
                cmd, reason, self._cancel_signal(cmd, sig) if reason == "cancelled" else sig
            )
        await self.regions.join(cmd, region)
        self.warm.demand(cmd.device_key)
        self.core.events.emit(E.CommandStarted(cmd, frozen=region is not None))
        cmd.publish(lambda rid: P.Started(id=rid, command=cmd.id, pid=cmd.pid or 0))

    def _launch(self, cmd: Command) -> None:
        """Start a command its device's queue (or memory) let go, as a task of its own; or, one
        that waits at its gate (--mem-gate), let its runtime go on into CUDA."""
        if cmd.gate == "asked":
            self._open(cmd)
            return
        self.core.track(asyncio.get_running_loop().create_task(self._start(cmd), name=f"start-{cmd.id}"))

    def _region_released(self, e: E.RegionReleased) -> None:
        """CUDA starts waited for the region (admission._region_on): let them go, unless the next
        region holds the device already."""
        for cmd in self.admission.pump(e.region.device):
            self._launch(cmd)

    async def gate(self, cmd: Command) -> None:
        """A command's runtime is about to initialise CUDA (MemGate): return once memory admission
        lets the command use its device; at once where it is not gated or passed already."""
        was = cmd.gate
        # Its CUDA starts inside its own region (or while it waits for one): the others are held
        # for it, so waiting for their memory would wait until the region's timeout
        if self.admission.ask(cmd, now=self.regions.of_command(cmd)):
            if was == "asked":
                self._open(cmd)  # its other processes waiting at the gate go too
            elif was == "open":
                log.info("command_gate_passed", command=cmd.id, waited_s=0.0)
            return
        opened: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def go() -> None:
            if not opened.done():
                opened.set_result(None)

        cmd.gate_waiters.append(go)
        log.info("command_gated", command=cmd.id, reason=cmd.mem_wait)
        try:
            await opened  # cancelled with the connection: a process that died waiting asks no more
        finally:
            if go in cmd.gate_waiters:
                cmd.gate_waiters.remove(go)

    def _open(self, cmd: Command) -> None:
        cmd.gate, cmd.gate_s = "passed", time.monotonic() - cmd.gate_asked
        for opened in cmd.gate_waiters:
            opened()
        cmd.gate_waiters.clear()
        log.info("command_gate_passed", command=cmd.id, waited_s=round(cmd.gate_s, 6))

    async def memory_loop(self) -> None:
        """Sample device memory while the daemon serves; start what comes to fit (admission.py)."""
        await self.admission.sample_loop(self._launch)

    def _end_unstarted(self, cmd: Command, state: str, error: str) -> None:
        """End a command that never ran (cancelled or shut down while queued, or its spawn failed):
        out of its device's queue at once, then reported like any other."""
        promoted = self.core.scheduler.end_command(cmd.id, cmd.device_key)  # it may have held the device
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
        for nxt in promoted:
            if self.admission.admit(self.core.commands[nxt]):
                self._launch(self.core.commands[nxt])
        self._on_exit(cmd)

    def _on_exit(self, cmd: Command) -> None:
        self.core.track(asyncio.get_running_loop().create_task(self._finalize(cmd)))

    async def _finalize(self, cmd: Command) -> None:
        """A command ended: release its regions (so its report has their outcome), promote waiters,
        deliver its report, and keep it for the retention time."""
        if cmd.stdin_pipe is not None:  # what its children still read sees EOF, as after a shell
            cmd.stdin_pipe.close()
        oom = self.admission.tracks(cmd.device_key) and reruns.is_oom(cmd)
        if oom and await self._oom(cmd):
            return  # re-run: it starts again once it fits (guarded) or can run alone
        self.regions.ended_held(cmd)  # held by another's region, it ended all the same
        await self.regions.end_of(cmd)
        loop = asyncio.get_running_loop()
        for nxt in self.core.scheduler.end_command(cmd.id, cmd.device_key):
            if self.admission.admit(self.core.commands[nxt]):
                self._launch(self.core.commands[nxt])
        if not self.core.closing:
            for fits in self.admission.ended(cmd, oom):
                self._launch(fits)
        assert cmd.report is not None
        adopted = self.warm.report(cmd.id, cmd.report)
        if self.core.records is not None and (cmd.regions or adopted):
            self.core.records.ended(cmd.id, cmd.report)  # again: with its regions' and the pool's parts
        self.warm.demand(cmd.device_key)
        cmd.slim()  # kept for --retention: only what a report and an attach need
        cmd.done.set()
        report = cmd.report
        # Before the agent hears of it: a scrape after a report always includes that command.
        self.core.events.emit(E.CommandEnded(cmd))
        cmd.publish_exit(report)
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
                await self.core.backend.remove(cmd.group)
            except Exception as e:  # a leftover group is logged; the retention below must still run
                log.error("group_remove_failed", command=cmd.id, error=repr(e))
        self.core.events.emit(E.CommandGone(cmd))
        loop.call_later(self.core.config.retention, self.forget, cmd)

    async def _oom(self, cmd: Command) -> bool:
        """The command failed with CUDA out of memory: re-run it (True) or say why not (reruns.py)."""
        try:  # what it showed it needs at least, before its output goes
            self.admission.learn_floor(cmd)
        except Exception as e:  # noqa: BLE001 - the command's end must go on: its report, its memory
            log.error("oom_floor_failed", command=cmd.id, error=repr(e))
        others = self.core.scheduler.siblings(cmd.device_key or "", cmd.id)
        if not cmd.co_located and others and await memsample.others_hold(self.admission, cmd):
            cmd.co_located = True  # beside one not counted yet (it allocated without asking)
        if not reruns.verdict(cmd, others, self.admission.fits_alone(cmd), self.core.closing):
            return False
        await self._rerun(cmd)
        return True

    async def _rerun(self, cmd: Command) -> None:
        """Put an out-of-memory command back in line, first, to run alone: its regions end, its
        group and spool files go, its output so far is void (its agents hear Rerun)."""
        await self.regions.end_of(cmd)
        if cmd.group is not None:
            try:
                await self.core.backend.remove(cmd.group)
            except Exception as e:  # its next start makes a group of its own name: say why it fails
                log.error("group_remove_failed", command=cmd.id, error=repr(e))
        if self.core.spool is not None and cmd.spools:
            self.core.spool.remove(sorted(f.path for f in cmd.spools.values()))
        cmd.reset_for_rerun(reason := reruns.REASON)
        self.admission.requeue(cmd)
        self.core.events.emit(E.CommandRequeued(cmd, reason))
        log.info("command_rerun", command=cmd.id, device=cmd.device_key, reason=reason)
        cmd.publish(lambda rid: P.Rerun(id=rid, command=cmd.id, reason=reason))
        for other in self.admission.pump(cmd.device_key):
            self._launch(other)

    def forget(self, cmd: Command) -> None:
        """The command's retention ended: drop it, its spool files and its record."""
        if self.core.commands.get(cmd.id) is cmd:
            del self.core.commands[cmd.id]
            self.warm.forget(cmd)
        self.runner.release(cmd)

    async def cancel(self, req: P.Cancel, uid: int) -> None:
        cmd = own(self.core, req.command, uid)
        if req.queued_only and cmd.state != CommandState.QUEUED:
            raise RequestError("not_queued", f"command {cmd.id} is {cmd.state}, no longer queued")
        if cmd.state == CommandState.QUEUED:
            self._end_unstarted(cmd, "cancelled", "cancelled before it started")
        elif cmd.state == CommandState.RUNNING:
            await self.runner.kill(cmd, "cancelled", self._cancel_signal(cmd, req.signal))
        elif cmd.state == CommandState.STARTING:
            # no process to signal yet: _start kills it once it runs
            cmd.kill_pending = cmd.kill_pending or ("cancelled", req.signal)

    def _cancel_signal(self, cmd: Command, sig: int) -> int:
        """The signal a cancel sends: the one asked for, or SIGKILL for a command a region holds,
        which would act on any other only once the region ends (up to --region-timeout): it ends
        now, killed where it stands, never thawed into the region (the report says so)."""
        if sig == signal.SIGKILL or (held := self.regions.holding(cmd)) is None:
            return sig
        how, r = held
        by = f" by region {r.report.name!r} of {r.command.id}" if r is not None else ""
        cmd.end_note = (
            f"killed by SIGKILL: it was {how}{by} and would have acted on "
            f"{signal_name(sig)} only once the region ended"
        )
        return signal.SIGKILL

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
        """A connection closed: it watches no command and speaks for no runtime any more; a command
        only it was watching ends, if it asked to (on_disconnect=kill)."""
        for cmd in self.core.commands.values():
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
                self.core.track(
                    asyncio.get_running_loop().create_task(
                        self.cancel(P.Cancel(id=0, command=cmd.id, signal=9), 0)
                    )
                )

    async def stop(self) -> None:
        """Shutdown: every command ends, a queued one at once, a running one by SIGTERM, then
        SIGKILL after --kill-grace; returns once all have ended (or a last bounded wait)."""
        live = [c for c in self.core.commands.values() if c.state is not CommandState.ENDED]
        for c in live:
            if c.state == CommandState.QUEUED:
                self._end_unstarted(c, "shutdown", "the daemon shut down first")
            elif c.state == CommandState.STARTING:
                c.kill_pending = ("shutdown", signal.SIGTERM)
            elif c.group is not None:
                if c.group.frozen:
                    await self.core.backend.thaw(c.group)
                await self.runner.kill(c, "shutdown", signal.SIGTERM)
        waits = [asyncio.ensure_future(c.done.wait()) for c in live if c.state != CommandState.ENDED]
        if waits:
            _, pending = await asyncio.wait(waits, timeout=self.core.config.kill_grace)
            if pending:
                for c in live:
                    if c.state == CommandState.RUNNING and c.group is not None:
                        await self.core.backend.kill(c.group, signal.SIGKILL)
                await asyncio.wait(pending, timeout=5)
