"""The daemon's probes started: the backend --probes asks for, fed to a new `Attributor`
(attribution.py), tracefs tried where bcc could not start, and the launch probe told which
processes are krex's own. A probe that cannot run is a state `krex status` shows, never a reason
not to serve.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from krex_async import logs
from krex_async.daemon.daemon import Daemon
from krex_async.daemon.model.command import CommandState
from krex_async.daemon.observe.attribution import Attributor

log = logs.get("krex.server")


def is_krex_process(
    daemon: Daemon, attributor: Attributor, tgid: int, cgroup_root: str | None = None
) -> bool:
    """Whether `tgid` is inside krex, for the launch probe's scope `outsiders` (such a process is
    never trapped): it belongs to a command (the attributor: a descendant of a command's root
    process, cached per tgid; or, with `cgroup_root`, the cgroup v2 mount, a process in a command's
    cgroup, which catches one that left the command's process tree by a double fork), or it is one
    of the daemon's pool workers. A pool worker is not a command while it waits, but it takes one
    without a new exec, and a probed worker would trap its command's launches until the next
    rescan; a warm worker launches nothing while it waits, and creates no context while a region
    holds its device. Reads /proc (the attributor's cache is the loop's): call it on the loop only.
    """
    if attributor.command_of(tgid) is not None:
        return True
    if any(tgid in pool.pids() for pool in daemon.core.pools.values()):
        return True
    if cgroup_root is None:
        return False
    from krex_async.isolation.cgroupfs import own_cgroups

    try:
        path = cgroup_root + own_cgroups(str(tgid)).get("", "/")
    except (OSError, ValueError):
        return False
    path = path.rstrip("/")
    for cmd in daemon.core.commands.values():
        cg = (
            daemon.core.backend.cgroup_dir(cmd.group)
            if cmd.group is not None and cmd.state in (CommandState.STARTING, CommandState.RUNNING)
            else None
        )
        if cg and (path == cg.rstrip("/") or path.startswith(cg.rstrip("/") + "/")):
            return True
    return False


def start_probes(daemon: Daemon) -> None:
    """Open the probe backend `--probes` asks for and feed its events to the attributor. A probe
    that cannot run is a logged state, never a reason not to serve; so is one that fails later
    (Attributor.probe_failed). `core.probes` (in `krex status`) says which state, and why."""
    cfg = daemon.core.config
    if cfg.probes == "off":
        log.info("probes", backend=None, reason="off (--probes off)")
        daemon.core.probes.update(state="off", reason="--probes off")
        return
    from krex_async.probes import FailureReporting, open_probes

    attributor: Attributor | None = None
    from krex_async.probes.attribution import cgroup2_root

    cg_root = cgroup2_root()

    def is_command(tgid: int) -> bool:  # the launch probe calls it on the loop only
        return attributor is not None and is_krex_process(daemon, attributor, tgid, cg_root)

    backend, reason = open_probes(
        cfg.probes,
        cfg.probe_prefix_list or None,
        cfg.launch_lib_list or None,
        launch_scope=cfg.launch_scope,
        is_command=is_command,
    )
    log.info("probes", backend=backend.name if backend else None, reason=reason)
    daemon.core.probes.update(state="unavailable", reason=reason)
    if backend is None:
        return
    loop = asyncio.get_running_loop()

    def started(b: Any) -> str:
        """Start `b` feeding a new attributor: "" or why it could not (what did start is stopped)."""
        nonlocal attributor
        attributor = Attributor(daemon.core, daemon.regions, b, daemon.metrics, daemon.tracer.subscribers)
        if isinstance(b, FailureReporting):
            b.on_failure = attributor.probe_failed
        try:
            b.start(loop, attributor.on_events)
        except Exception as e:  # ProbeUnavailable or a failed attach
            with contextlib.suppress(Exception):
                b.stop()  # whatever part of it did start (programs, threads) goes
            attributor = None
            return f"{b.name} failed to start: {e}"
        return ""

    why = started(backend)
    if why and cfg.probes == "auto" and backend.name != "tracefs":
        # auto: bcc compiled a test program but not this one (an older kernel, a missing
        # tracepoint): tracefs may still serve
        fallback, fallback_reason = open_probes("tracefs", cfg.probe_prefix_list or None)
        if fallback is not None:
            if not (why_not := started(fallback)):
                backend, reason, why = fallback, f"{fallback_reason}, after {why}", ""
            else:
                why = f"{why}; tracefs failed too: {why_not}"
    if why:  # run without probes, and say so
        log.warning("probes", backend=None, reason=why)
        daemon.core.probes.update(reason=why)
        return
    daemon.attributor = attributor
    daemon.core.probes.update(state="running", backend=backend.name, reason=reason)
    failed = getattr(backend, "failed", None)
    if failed:
        log.warning("probes_partial", failed=failed)
        daemon.core.probes["partial"] = dict(failed)
