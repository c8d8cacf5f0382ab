"""Durable records of running commands, and what a new daemon does with those of a dead one.

At spawn the daemon writes `<state_dir>/commands/<id>.json` (temporary file, then rename: a reader
sees the old record or the new, never half of one; no fsync: the record has to survive the daemon's
death, which the page cache does, and after a crash of the machine its processes are gone too). It
names the command, its owner, how to find its processes again (the backend and the cgroup, the
leader's pid and the leader's start time in clock ticks from /proc/PID/stat, so that a reused pid is
never mistaken for it) and its spool files. The record is removed when the command's retention ends.

A daemon starting on the same state dir finds the records no live daemon owns (`load`): their
commands belong to a daemon that died (SIGKILL, OOM, a crash). It ends what is left of each
(`end_lost`) and keeps it as an ended command in state `lost`, with what its spool files hold, for
the retention time, so its agent can `attach` and learn what happened. A record that already holds
its command's final report (the command ended before its daemon stopped) is kept as that result.

Why not adopt a command that is still running: its exit status could only be read by its parent, the
dead daemon (the kernel hands the orphan to init or a subreaper, which reaps it); a new daemon could
watch it but never say how it ended, and its output pipes were the dead daemon's, so what it writes
next goes nowhere (EPIPE/SIGPIPE). Ending it and reporting what is known is the honest result.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import msgspec

from krex_async import logs
from krex_async import protocol as P
from krex_async.isolation.base import Backend, Group, IsolationError
from krex_async.linux import procfs
from krex_async.linux.fsutil import replace_file
from krex_async.linux.procfs import start_time as start_ticks  # the one reading: report.py's name

log = logs.get("krex.records")


class Record(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    version: int = 1
    id: str
    uid: int
    gid: int
    argv: list[str]
    device: str
    label: str = ""
    policy: str = ""
    backend: str  # "cgroup" or "signal"
    group: str  # the backend's group name (cmd-<id>)
    cgroup: str = ""  # cgroup backend: the group's directory, relative to the backend's v2 root
    cgroup_dir: str = ""  # the absolute directory its processes started in (backend.cgroup_dir)
    pid: int  # the command's leader (its session and process group id too)
    start_ticks: int  # field 22 of /proc/<pid>/stat: when the leader started, in clock ticks
    started_at: float  # wall-clock seconds
    stdout_spool: str = ""
    stderr_spool: str = ""
    daemon_pid: int
    daemon_ticks: int  # the daemon's start time: a live daemon's records are never taken
    report: P.CommandReport | None = None  # set once the command ended: a restart keeps its result


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(Record)


def _stat(pid: int) -> tuple[int, int, int] | None:
    """(parent pid, session id, start ticks) of a live process."""
    st = procfs.stat(pid)
    return None if st is None or st.state == "Z" else (st.ppid, st.session, st.start)


class Records:
    """The record directory of one daemon. Write errors are logged: a command runs without its
    record rather than not at all (it is then not reported after a crash)."""

    def __init__(self, state_dir: str) -> None:
        self.dir = os.path.join(state_dir, "commands")
        os.makedirs(self.dir, mode=0o700, exist_ok=True)
        self.me = (os.getpid(), start_ticks(os.getpid()) or 0)

    def path(self, command: str) -> str:
        return os.path.join(self.dir, f"{command}.json")

    def ended(self, command: str, report: P.CommandReport | None) -> None:
        """Add the final report to the command's record, so a daemon that restarts within the
        retention time still hands it to the agent (and does not call the command lost)."""
        path = self.path(command)
        try:
            with open(path, "rb") as f:
                rec = _decoder.decode(f.read())
        except FileNotFoundError:
            return  # never recorded (a spawn that failed, or a failed record write)
        except (OSError, msgspec.DecodeError) as e:
            log.warning("record_damaged", path=path, error=str(e))
            return
        rec.report = report
        self.write(rec)

    def write(self, rec: Record) -> None:
        path = self.path(rec.id)
        try:
            replace_file(path, _encoder.encode(rec))
        except OSError as e:
            log.warning("record_failed", command=rec.id, path=path, error=str(e))

    def remove(self, command: str) -> None:
        try:
            os.unlink(self.path(command))
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warning("record_remove_failed", command=command, error=str(e))

    def load(self) -> list[Record]:
        """Records of commands whose daemon is dead, oldest first. Damaged records are logged and
        removed; those of a live daemon (another one sharing this state dir) are left alone."""
        try:
            names = sorted(os.listdir(self.dir))
        except OSError:
            return []
        out: list[Record] = []
        for name in names:
            path = os.path.join(self.dir, name)
            if not name.endswith(".json"):
                if name.endswith(".tmp"):  # a write the dead daemon did not finish
                    self._unlink(path)
                continue
            try:
                with open(path, "rb") as f:
                    rec = _decoder.decode(f.read())
            except (OSError, msgspec.DecodeError) as e:
                log.warning("record_damaged", path=path, error=str(e))
                self._unlink(path)
                continue
            if (rec.daemon_pid, rec.daemon_ticks) == self.me or start_ticks(
                rec.daemon_pid
            ) == rec.daemon_ticks:
                continue
            out.append(rec)
        return sorted(out, key=lambda r: r.started_at)

    def ids(self) -> set[str]:
        """Every command that has a record here (a live daemon's too)."""
        try:
            return {n[:-5] for n in os.listdir(self.dir) if n.endswith(".json")}
        except OSError:
            return set()

    @staticmethod
    def _unlink(path: str) -> None:
        try:
            os.unlink(path)
        except OSError:
            pass


def leftover_pids(rec: Record) -> list[int]:
    """Live processes of the lost command: its leader if its start time matches, its descendants,
    and every process of the leader's session (spawn gives each leader its own), all started no
    earlier than the leader. The kernel does not reuse a pid while a session of that id has members,
    so these are the command's. A process that made its own session and left the tree escapes, as
    it does the signal backend."""
    procs: dict[int, tuple[int, int, int]] = {}
    for pid in procfs.pids():
        if (st := _stat(pid)) is not None:
            procs[pid] = st
    leader = procs.get(rec.pid)
    if leader is not None and leader[2] != rec.start_ticks:
        return []  # the pid was reused: nothing of the command's session is left
    mine = {p for p, (_, sid, ticks) in procs.items() if sid == rec.pid and ticks >= rec.start_ticks}
    if leader is not None:
        mine.add(rec.pid)
    grew = True
    while grew:  # descendants of what is already found
        new = {
            p
            for p, (ppid, _, ticks) in procs.items()
            if ppid in mine and p not in mine and ticks >= rec.start_ticks
        }
        mine |= new
        grew = bool(new)
    return sorted(mine)


async def end_lost(backend: Backend, rec: Record, timeout: float = 3.0) -> tuple[str, list[int]]:
    """SIGKILL what is left of a dead daemon's command and wait (bounded) until it is gone; returns
    what was done, and the pids still alive after `timeout` (normally none). The cgroup backend's
    group is killed and removed through the backend (the start-up sweep left it, populated, in
    `orphans`) when this daemon has the same cgroup root; otherwise, and for what the cgroup no longer
    holds, the leader's session is signalled."""
    g: Group | None = None
    if backend.name == "cgroup" and rec.backend == "cgroup" and rec.cgroup:
        from krex_async.isolation.cgroup import CgroupGroup

        g = CgroupGroup(command_id=rec.id, pid=rec.pid, top=rec.cgroup)
        if backend.cgroup_dir(g) != rec.cgroup_dir:  # another cgroup root than the dead daemon's
            g = None
    if g is not None:
        try:
            n = len(backend.pids(g))
            await backend.kill(g, signal.SIGKILL)
            await backend.remove(g)
            return f"killed {n} process(es) in cgroup {rec.cgroup} and removed it", []
        except (IsolationError, OSError) as e:
            if os.path.isdir(rec.cgroup_dir):  # a vanished cgroup is a state, not a failure
                log.warning("lost_cgroup", command=rec.id, error=str(e))
            # fall through: the session still finds processes the cgroup no longer holds
    pids = leftover_pids(rec)
    killed = len(pids)
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout
    while pids and time.monotonic() < deadline:
        pids = [p for p in pids if (st := _stat(p)) is not None and st[2] >= rec.start_ticks]
        await asyncio.sleep(0.02)
    if pids:
        return f"processes {pids} still alive {timeout} s after SIGKILL", pids
    return (f"killed {killed} process(es) of session {rec.pid}" if killed else "no processes left"), []
