"""What a command's end says: its report (how it ended, its exit, times, CPU, output counts and
spool files, its regions) and the error text a user is shown; and the durable record written when
its leader is spawned, from which a new daemon reports it should this one die (records.py).
"""

from __future__ import annotations

import os
import signal
import time

from krex_async import protocol as P
from krex_async.daemon.model.command import Command
from krex_async.daemon.persist.records import Record, start_ticks
from krex_async.isolation.base import Backend
from krex_async.linux.spawn import ExitStatus


def end_report(cmd: Command, status: ExitStatus, now: float) -> P.CommandReport:
    """The report of a command whose leader exited with `status` (`now`: time.monotonic() then);
    its state is why the daemon ended it, if it did, else how the leader ended."""
    out, err = cmd.spools.get("stdout"), cmd.spools.get("stderr")
    if cmd.end_reason:
        state = cmd.end_reason
    else:
        state = "signaled" if status.signal else "exited"
    return P.CommandReport(
        command=cmd.id,
        argv=list(cmd.spec.argv),
        device=cmd.device_key or "none",
        policy=cmd.policy_name,
        state=state,
        exit_code=None if status.signal else status.returncode,
        signal=status.signal,
        wall_s=now - cmd.started,
        queued_s=cmd.started - cmd.submitted,
        cpu_user_s=status.user_s,
        cpu_system_s=status.system_s,
        started_at=time.time() - (now - cmd.started),
        ended_at=time.time(),
        regions=cmd.regions,
        label=cmd.spec.label,
        via=cmd.launched.via if cmd.launched else "exec",
        start_latency_s=cmd.launched.start_latency_s if cmd.launched else None,
        stdout_bytes=cmd.out.total,
        stderr_bytes=cmd.err.total,
        error=_describe(state, status, cmd),
        stdout_spool=out.path if out else "",
        stderr_spool=err.path if err else "",
        stdout_dropped=out.dropped if out else 0,
        stderr_dropped=err.dropped if err else 0,
        spool_error="; ".join(f"{f.stream}: {f.error}" for f in cmd.spools.values() if f.error),
        reruns=cmd.reruns,
        rerun_reason=cmd.rerun_reason,
        mem_need=cmd.mem_need,
        mem_source=cmd.mem_source,
        mem_peak=cmd.mem_peak,
        gate_s=round(cmd.gate_s, 6),
        gate="unused" if cmd.gate == "open" else cmd.gate,
    )


def start_error(what: str, cmd: Command) -> str:
    """One answer whether a path is missing or hidden from the user (the kernel's errno is not
    passed on: it would tell which)."""
    env = cmd.spec.env
    path = env.get("PATH", "") if env is not None else os.environ.get("PATH", os.defpath)
    if what == "cwd":
        return (
            f"cwd {cmd.spec.cwd or '/'!r} is not a directory you can enter (it does not "
            "exist, or you may not reach it)"
        )
    return f"argv[0] {cmd.spec.argv[0]!r} not found or not executable by you (looked up on PATH {path!r})"


def spawn_record(cmd: Command, backend: Backend, daemon: tuple[int, int]) -> Record:
    """The durable record of a command whose leader was just spawned into its group; `daemon` is
    the recording daemon's (pid, start ticks), so a successor can tell whether it still runs."""
    assert cmd.launched is not None and cmd.group is not None
    pid = cmd.launched.pid
    out, err = cmd.spools.get("stdout"), cmd.spools.get("stderr")
    return Record(
        id=cmd.id,
        uid=cmd.uid,
        gid=cmd.gid,
        argv=list(cmd.spec.argv),
        device=cmd.device_key or "none",
        label=cmd.spec.label,
        policy=cmd.policy_name,
        backend=backend.name,
        group=cmd.group.name,
        cgroup=str(getattr(cmd.group, "top", "") or ""),
        cgroup_dir=backend.cgroup_dir(cmd.group) or "",
        pid=pid,
        start_ticks=start_ticks(pid) or 0,
        started_at=time.time(),
        stdout_spool=out.path if out else "",
        stderr_spool=err.path if err else "",
        daemon_pid=daemon[0],
        daemon_ticks=daemon[1],
    )


def _describe(state: str, status: ExitStatus, cmd: Command) -> str:
    if state == "timeout":
        return f"killed after its timeout of {cmd.spec.timeout} s"
    if state == "shutdown":
        return "ended because the daemon shut down"
    if state == "cancelled":
        return "cancelled by its agent" + (f": {cmd.end_note}" if cmd.end_note else "")
    if state == "failed":
        return cmd.start_error
    if status.signal:
        return f"killed by {signal_name(status.signal)}"
    return ""


def signal_name(sig: int) -> str:
    """SIGINT for 2; `signal N` for a number with no name."""
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"
