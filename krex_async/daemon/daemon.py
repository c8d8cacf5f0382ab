"""The daemon: its parts, put together once, and the requests connection.py hands it. One event loop owns
all of it.

`Daemon` builds the shared `Core` (model/core.py) and the parts that take it: `Regions`
(regions/engine.py), `WarmPools` (commands/warmpools.py), `Lifecycle` (commands/lifecycle.py: a
command from submit to forget), `DaemonStatus` (observe/status.py), and the observers: the `Tracer`
(observe/tracing.py), the metrics (observe/metering.py) and, while probes run, the `Attributor`
(observe/attribution.py) subscribe to the core's events (model/events.py); the daemon keeps the
tracer and the metrics, reaches everything the parts share through `core`, and keeps no second
handle to it. connection.py feeds it decoded requests with the peer's credentials; each is
answered by the part that owns it, through the connection's `send`, or refused with a RequestError
(commands/access.py). The region requests a command's runtime makes are checked here.
"""

from __future__ import annotations

import asyncio
import hmac
import secrets
from collections.abc import Callable
from typing import Any

from krex_async import logs
from krex_async import protocol as P
from krex_async.daemon.commands.access import RequestError, inside
from krex_async.daemon.commands.lifecycle import Lifecycle
from krex_async.daemon.commands.recovery import recover
from krex_async.daemon.commands.warmpools import WarmPools
from krex_async.daemon.config import ServeConfig
from krex_async.daemon.model.command import Command
from krex_async.daemon.model.core import Core, Send
from krex_async.daemon.observe.attribution import Attributor
from krex_async.daemon.observe.metering import Metering
from krex_async.daemon.observe.metrics import Metrics
from krex_async.daemon.observe.status import DaemonStatus
from krex_async.daemon.observe.tracing import Tracer
from krex_async.daemon.persist.records import Records
from krex_async.daemon.persist.spool import Spool
from krex_async.daemon.regions.engine import Regions
from krex_async.devices import Node
from krex_async.devices.base import Device
from krex_async.isolation.base import Backend
from krex_async.scheduler import Scheduler

log = logs.get("krex.daemon")


class Daemon:
    def __init__(
        self, config: ServeConfig, backend: Backend, devices: list[Device], node: Node | None = None
    ) -> None:
        commands: dict[str, Command] = {}
        self.tasks: set[asyncio.Task[Any]] = set()
        self.tracer = Tracer(commands)  # it names a starting command's label and argv
        self.metrics = Metrics()  # always callable; the endpoint starts only with --metrics
        for d in devices:  # first: every per-device series carries the device's UUID and model
            self.metrics.device_info(d.key, d.index, d.uuid, d.name, d.vendor)
        # What the parts share: the daemon reaches them through the core too, never a second handle.
        self.core = Core(
            config=config,
            backend=backend,
            devices=devices,
            node=node,  # the opened vendor libraries, for live queries (status)
            scheduler=Scheduler(config.policy, [d.key for d in devices]),
            commands=commands,
            pools={},  # device key -> warm workers (--pool-size > 0)
            trace=self.tracer.trace,
            track=self.track,
            # Spool files and command records live in the state dir (none without one: a bare config).
            records=Records(config.state_dir) if config.state_dir else None,
            spool=Spool(config.state_dir, config.spool_limit) if config.state_dir else None,
            probes={"state": "off", "backend": None, "reason": ""},  # start_probes
        )
        # The observers follow regions and commands through the core's events (events.py).
        Metering(self.metrics, commands, self.core.pools).observe(self.core.events)
        self.tracer.observe(self.core.events)
        self.regions = Regions(self.core)
        self.warm = WarmPools(self.core, self.regions)
        # Unique across daemons and restarts (two started in one second shared ids once): a
        # command id names cgroups, records and spool files that another daemon must not meet.
        self._boot = secrets.token_hex(4)
        self.lifecycle = Lifecycle(self.core, self.regions, self.warm, self._boot)
        self._attributor: Attributor | None = None  # set when probes run
        self._unobserve: Callable[[], None] | None = None  # the attributor's subscriptions
        self.status = DaemonStatus(
            self.core, self.regions, self.warm.adoptions, self._boot, self.lifecycle.admission, self.metrics
        )
        # a dead daemon's commands: ended and reported (recovery.py)
        recover(self.core, self.lifecycle.forget)

    @property
    def attributor(self) -> Attributor | None:
        """The probe attributor while probes run (probing.start_probes sets it)."""
        return self._attributor

    @attributor.setter
    def attributor(self, attributor: Attributor | None) -> None:
        if self._unobserve is not None:
            self._unobserve()
            self._unobserve = None
        self._attributor = attributor
        self.core.attributor = attributor  # the parts ask it through the core
        if attributor is not None:  # and it follows regions and commands through its events
            self._unobserve = attributor.observe(self.core.events)

    def track(self, task: asyncio.Task[Any]) -> asyncio.Task[Any]:
        """Keep `task` until it ends; a failure is logged (nothing else would see it)."""
        self.tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("task_failed", task=task.get_name(), error=repr(task.exception()))

    async def start_pools(self, user: tuple[int, int, list[int]] | None = None) -> None:
        await self.warm.start(user)

    # --------------------------------------------------------------------- an agent's requests

    async def submit(self, req: P.Submit, uid: int, gid: int, send: Send, admin: bool = False) -> None:
        await self.lifecycle.submit(req, uid, gid, send, admin)

    async def cancel(self, req: P.Cancel, uid: int) -> None:
        await self.lifecycle.cancel(req, uid)

    async def stdin(self, req: P.StdinData, uid: int) -> None:
        await self.lifecycle.stdin(req, uid)

    def attach(self, req: P.Attach, uid: int, send: Send) -> None:
        self.lifecycle.attach(req, uid, send)

    def send_timeline(
        self, req: P.Timeline, send: Send, visible: Callable[[P.TraceEvent], bool] | None = None
    ) -> None:
        self.tracer.send_timeline(req, send, visible)

    def subscribe_trace(self, send: Send, req_id: int) -> None:
        """A `krex trace` peer: every trace event from now on, until its connection closes."""
        self.tracer.subscribers.append((send, req_id))

    def disconnected(self, send: Send) -> None:
        """A connection closed: end the regions it held and the commands only it was watching."""
        self.regions.end_owned_by(send)
        self.lifecycle.disconnected(send)
        self.tracer.drop(send)

    # --------------------------------------------------------- requests from inside a command

    async def mem_gate(self, req: P.MemGate, peer_pid: int) -> None:
        cmd = self.core.commands.get(req.command)
        if cmd is None:
            raise RequestError("unknown_command", f"no command {req.command!r}")
        inside(self.core, cmd, peer_pid, req.token, req.pid)
        await self.lifecycle.gate(cmd)

    async def adopt(self, req: P.Adopt, peer_pid: int, send: Send) -> None:
        await self.warm.adopt(req, peer_pid, send)

    def region_enter(self, req: P.RegionEnter, peer_pid: int, send: Send) -> None:
        cmd = self.core.commands.get(req.command)
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
        r = self.regions.get(req.region)
        if r is None:
            raise RequestError("unknown_region", f"no active region {req.region!r}")
        if not hmac.compare_digest(req.token.encode(), r.command.token.encode()) or r.pid != peer_pid:
            raise RequestError("forbidden", f"region {req.region} belongs to another process")
        self.regions.exit(r, req)

    def quiesce_ready(self, req: P.QuiesceReady, peer_pid: int, send: Send) -> None:
        cmd = self.core.commands.get(req.command)
        if cmd is None:
            raise RequestError("unknown_command", f"no command {req.command!r}")
        pid = inside(self.core, cmd, peer_pid, req.token, req.pid)
        cmd.runtimes[pid] = send
        if req.pool_declined:
            self.warm.declined(cmd, req.pool_declined)

    def exit_held(self, req: P.ExitHeld, peer_pid: int, send: Send) -> None:
        """A command's process holding a GPU file is exiting: its runtime waits for a Resume, which
        comes with the release of the region that locked it, or of one running on its device, or at
        once (Regions.exit_held)."""
        self.regions.exit_held(req, peer_pid, send)

    def quiesce_ack(self, req: P.QuiesceAck, peer_pid: int) -> None:
        self.regions.ack(req, peer_pid)

    # --------------------------------------------------------------------------------- shutdown

    async def shutdown(self) -> None:
        """End every region (thawing), then every command: SIGTERM, then SIGKILL after the grace."""
        self.core.closing = True
        await self.regions.end_all()
        await self.lifecycle.stop()
        self.lifecycle.admission.footprints.flush()  # what the last commands' ends taught
        await self.warm.close()
        if self.attributor is not None:
            self.attributor.backend.stop()
        await self.core.backend.close()
        self.regions.close()
        if self.core.node is not None:
            self.core.node.close()
