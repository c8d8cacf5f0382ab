"""Start-up: the commands of a daemon that died on this state dir, ended and reported.

`recover(core, forget)` runs once, in the new daemon's constructor, before it accepts a connection. For
each record of a dead daemon (records.py) it registers an ended command, so that `attach(id)` by its owner
and `krex status` see it at once:

- the command had ended (its record holds the final report): that report, as it was;
- else state `lost`, "the daemon that ran it stopped (pid N); its processes were ended", with the
  output its spool files hold (their tails become the report's tails).

Nothing a user controls may hold up start-up: the spool files are read without waiting (a lease on
one fails the open at once, `spool.read_tail`), and a tail that could not be read then is read by a
background task once the kernel has broken the lease (lease-break-time, 45 s by default).

What is left of a lost command's processes is ended by a task (`records.end_lost`: through the cgroup
backend, or by signalling the leader's session); a process that survives it is named in the report's
error. Each command is forgotten (record and spool files removed) when its retention ends, counted
from when it ended. Spool files that no record names any more are removed.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

import msgspec

from krex_async import logs
from krex_async import protocol as P
from krex_async.daemon.model.command import Command, CommandState, Tail
from krex_async.daemon.persist.records import Record, end_lost
from krex_async.daemon.persist.spool import read_tail
from krex_async.scheduler import Policy

if TYPE_CHECKING:
    from collections.abc import Callable

    from krex_async.daemon.model.core import Core

log = logs.get("krex.recovery")


def _command(core: Core, rec: Record) -> Command:
    device = next((d for d in core.devices if d.key == rec.device), None)
    spec = P.Submit(id=0, argv=rec.argv, label=rec.label, device=rec.device if device else "none")
    cmd = Command(
        id=rec.id,
        spec=spec,
        uid=rec.uid,
        gid=rec.gid,
        device=device,
        policy=_policy(rec.policy),
        tail_limit=core.config.output_tail,
    )
    cmd.state = CommandState.ENDED
    cmd.done.set()
    # Its age counts from when it was submitted to the dead daemon, not from this recovery.
    since = time.time() - rec.started_at + (rec.report.queued_s if rec.report is not None else 0.0)
    if rec.started_at > 0 and since >= 0:
        cmd.submitted = time.monotonic() - since
    else:  # no start time recorded (or one after now): `krex status` says it is not known
        cmd.age_known = False
    late = [
        (tail, path)
        for tail, path in ((cmd.out, rec.stdout_spool), (cmd.err, rec.stderr_spool))
        if path and not _load(tail, path)
    ]
    if late:
        log.warning("spool_leased", command=rec.id, paths=[p for _, p in late])
        core.track(asyncio.get_running_loop().create_task(_load_later(late), name=f"spool-tail-{rec.id}"))
    if rec.report is not None:
        cmd.report = rec.report
        return cmd
    now = time.time()
    cmd.report = P.CommandReport(
        command=rec.id,
        argv=list(rec.argv),
        device=rec.device,
        policy=rec.policy,
        state="lost",
        started_at=rec.started_at,
        ended_at=now,
        wall_s=max(0.0, now - rec.started_at),
        label=rec.label,
        stdout_bytes=cmd.out.total,
        stderr_bytes=cmd.err.total,
        stdout_spool=rec.stdout_spool,
        stderr_spool=rec.stderr_spool,
        error=f"the daemon that ran it stopped (pid {rec.daemon_pid}); its processes were ended",
    )
    return cmd


def _policy(name: str) -> Policy | None:
    """The record's policy; None where it names none (an older record) or one this daemon lacks."""
    try:
        return Policy(name)
    except ValueError:
        return None


def _load(tail: Tail, path: str) -> bool:
    """Fill `tail` from the spool file; False when a lease holds the file (nothing waited)."""
    try:
        tail.buf[:], tail.total = read_tail(path, tail.limit)
    except BlockingIOError:
        return False
    return True


async def _load_later(late: list[tuple[Tail, str]], every: float = 1.0, bound: float = 300.0) -> None:
    """Retry leased spool files until the kernel has broken their leases (bounded)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + bound
    while late and loop.time() < deadline:
        await asyncio.sleep(every)
        late = [(tail, path) for tail, path in late if not _load(tail, path)]
    if late:
        log.warning("spool_unread", paths=[p for _, p in late])


def recover(core: Core, forget: Callable[[Command], None]) -> list[Command]:
    """Register the dead daemon's commands (see the module docstring); start ending the lost ones.
    Never raises for a damaged record or a process that cannot be signalled (both are logged).
    `forget` drops a command whose retention ended (the daemon's)."""
    records = core.records
    if records is None:
        return []
    loop = asyncio.get_running_loop()
    found: list[Command] = []
    for rec in records.load():
        if rec.id in core.commands:
            continue
        cmd = _command(core, rec)
        core.commands[cmd.id] = cmd
        found.append(cmd)
        assert cmd.report is not None
        age = time.time() - (cmd.report.ended_at or time.time())
        loop.call_later(max(0.0, core.config.retention - age), forget, cmd)
        log.info(
            "recovered",
            command=cmd.id,
            state=cmd.report.state,
            uid=cmd.uid,
            daemon_pid=rec.daemon_pid,
            stdout_bytes=cmd.out.total,
        )
        if rec.report is None:  # the report is written once what is left has been ended
            core.track(loop.create_task(_end(core, rec, cmd), name=f"end-lost-{rec.id}"))
    if core.spool is not None and core.spool.limit > 0:
        stale = core.spool.sweep(set(core.commands) | records.ids())
        if stale:
            log.info("spool_swept", files=len(stale))
    return found


async def _end(core: Core, rec: Record, cmd: Command) -> None:
    done, alive = await end_lost(core.backend, rec)
    log.info("lost_command_ended", command=rec.id, action=done)
    if alive and cmd.report is not None:
        cmd.report.error = f"the daemon that ran it stopped (pid {rec.daemon_pid}); {done}"
    # Only now: a daemon that dies before this line leaves the record without a report, and the
    # next one ends the leftovers again (written first, they would have been taken as ended).
    if core.records is not None and core.commands.get(cmd.id) is cmd:  # not yet forgotten
        core.records.write(msgspec.structs.replace(rec, report=cmd.report))
