"""The metrics as an observer: what each region and command event (events.py) puts into `Metrics`
(metrics.py). The engine emits the event; this module alone knows which series it moves."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from krex_async.daemon.model import events as E
from krex_async.daemon.model.fanout import Bus, undo_all
from krex_async.daemon.observe.metrics import Metrics

if TYPE_CHECKING:
    from krex_async.ctxpool import Pool
    from krex_async.daemon.model.command import Command


class Metering:
    def __init__(self, metrics: Metrics, commands: Mapping[str, Command], pools: Mapping[str, Pool]) -> None:
        self.metrics = metrics
        self.commands = commands  # a held command's user labels the seconds it was held
        self.pools = pools  # a pool's sizes, once a command a worker ran has ended

    def observe(self, bus: Bus) -> Callable[[], None]:
        """Subscribe to every event the metrics count; returns what unsubscribes them all."""
        undo = [
            bus.subscribe(E.RegionGranted, self.region_granted),
            bus.subscribe(E.RegionReleased, self.region_released),
            bus.subscribe(E.ShareWaited, lambda e: self.metrics.share_waited(e.region.device, e.seconds)),
            bus.subscribe(E.SiblingHeld, lambda e: self.metrics.command_held(e.device, e.command, e.seconds)),
            bus.subscribe(E.SiblingForgotten, lambda e: self.metrics.command_held_forget(e.command)),
            bus.subscribe(E.CommandSubmitted, self.command_submitted),
            bus.subscribe(E.CommandStarted, self.command_started),
            bus.subscribe(E.CommandRequeued, self.command_requeued),
            bus.subscribe(E.CommandEnded, self.command_ended),
            bus.subscribe(E.MemoryWaiting, lambda e: self.metrics.memory_waiting(e.device, e.waiting)),
            bus.subscribe(
                E.MemoryReserved, lambda e: self.metrics.memory_reserved(e.device, e.reserved, e.used)
            ),
        ]
        return undo_all(undo)

    # -------------------------------------------------------------------------------- regions

    def region_granted(self, e: E.RegionGranted) -> None:
        r, rep = e.region, e.region.report
        self.metrics.region_entered(r.device, rep.enter_s, rep.freeze_s, rep.cores_s, rep.quiesce_s)
        self.metrics.holding(r.device, e.frozen, e.locked)

    def region_released(self, e: E.RegionReleased) -> None:
        r, rep = e.region, e.region.report
        self.metrics.region_released(r.device, rep.held_s, rep.outcome, rep.drain, granted=e.granted)
        if e.granted:
            self.metrics.holding(r.device, 0, 0)
            uids = [c.uid for cid in e.held if (c := self.commands.get(cid)) is not None]
            self.metrics.held_for(uids, rep.held_s)
        self.metrics.strays(r.device, rep.strays)

    # ------------------------------------------------------------------------------- commands

    def command_submitted(self, e: E.CommandSubmitted) -> None:
        cmd = e.cmd
        self.metrics.command_submitted(cmd.policy_name, cmd.device_key or "none", e.queued, cmd.id)

    def command_started(self, e: E.CommandStarted) -> None:
        cmd = e.cmd
        via = cmd.launched.via if cmd.launched else "exec"
        self.metrics.command_started(cmd.policy_name, cmd.device_key or "none", via, cmd.id)

    def command_requeued(self, e: E.CommandRequeued) -> None:
        cmd = e.cmd
        self.metrics.rerun(cmd.device_key or "none", e.reason)
        self.metrics.command_requeued(cmd.policy_name, cmd.device_key or "none", cmd.id)

    def command_ended(self, e: E.CommandEnded) -> None:
        cmd, report = e.cmd, e.cmd.report
        assert report is not None
        self.metrics.command_ended(
            report.policy,
            report.state,
            report.wall_s,
            cmd.id,
            started=cmd.launched is not None,
            device=report.device,
        )
        # its pool's sizes, and the start latency of the worker that ran it (known once it began)
        pool = self.pools.get(report.device) if report.via == "pool" else None
        if pool is not None:
            st = pool.status()
            self.metrics.pool(
                report.device,
                st.get("warm", 0),
                st.get("busy", 0),
                st.get("retired", 0),
                report.start_latency_s,
            )
