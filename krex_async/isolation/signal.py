"""The signal backend: SIGSTOP/SIGCONT of a command's process tree and sched_setaffinity of its threads.

It needs no cgroups and no root, so it runs on laptops and in CI containers. A command's processes are
its leader's descendants, every process still in the leader's session (which catches orphans that
were reparented to init), and what it detached (setsid and a double fork): processes born since the
leader, outside its tree, whose environment names the command (KREX_COMMAND). One that clears its
environment before it detaches is not seen, which is the limit of this backend and the reason the
cgroup backend exists.

One /proc snapshot serves a whole batch of freezes (`freeze_many`), so entering a region with many
siblings reads /proc once, not once per sibling. A process that was already stopped (state T) before a
freeze is remembered and left stopped at thaw.

Each process is stopped and later resumed through a pidfd opened just before its SIGSTOP: a stopped
process that is killed and reaped meanwhile frees its pid, and a SIGCONT by pid at thaw could then
resume whatever process took the pid next (one that its owner had stopped, say).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections import defaultdict
from dataclasses import dataclass

from krex_async.isolation.base import Backend, Freeze, FreezeError, Group
from krex_async.isolation.sigguard import Guard, GuardError
from krex_async.linux import procfs

_STOPPED = frozenset("tT")
_LAUNCH = "krex-launch"  # $0 of the launch shell, told apart in /proc/<pid>/cmdline


@dataclass(slots=True)
class _Proc:
    pid: int
    ppid: int
    sid: int
    state: str
    born: int = 0  # start time, clock ticks since boot


class _Snapshot:
    """Every process's parent, session and state, read from /proc at one moment."""

    def __init__(self) -> None:
        self.procs: dict[int, _Proc] = {}
        self.children: dict[int, list[int]] = defaultdict(list)
        self.sessions: dict[int, list[int]] = defaultdict(list)
        self.environs: dict[int, bytes] = {}
        for pid in procfs.pids():
            p = _read_stat(pid)
            if p is None:
                continue
            self.procs[p.pid] = p
            self.children[p.ppid].append(p.pid)
            self.sessions[p.sid].append(p.pid)

    def tree(self, leader: int, command: str = "", born: int = 0) -> list[int]:
        """The leader (if alive), its descendants, and its session's members, each once; with
        `command` (its id) and `born` (the leader's start time) also the processes it detached."""
        out: list[int] = []
        seen: set[int] = set()
        stack = [leader] if leader in self.procs else []
        stack += self.sessions.get(leader, [])
        if command and born:
            stack += self.detached(leader, command, born)
        while stack:
            pid = stack.pop()
            if pid in seen:
                continue
            seen.add(pid)
            out.append(pid)
            stack.extend(self.children.get(pid, ()))
        if leader in seen:
            out.remove(leader)
            out.insert(0, leader)
        return out

    def detached(self, leader: int, command: str, born: int) -> list[int]:
        """Roots of what the command detached: a process that left its session (setsid) and its
        parent (a double fork: orphans go to init or a subreaper) is no descendant and no session
        member any more. Candidates are the processes born since the leader whose parent is
        older (the roots of every tree of new processes); those whose environment still names
        the command (KREX_COMMAND, given to each command) are its own. A program that clears
        its environment before it detaches is not found: the cgroup backend has no such gap."""
        key = f"KREX_COMMAND={command}\0".encode()
        roots = []
        for p in self.procs.values():
            if p.pid == leader or p.born < born or p.sid == leader:
                continue
            parent = self.procs.get(p.ppid)
            if parent is not None and parent.born >= born:
                continue  # a child of a new process: walked from its root
            if (env := self._environ(p.pid)) and (env.startswith(key) or b"\0" + key in env):
                roots.append(p.pid)
        return roots

    def _environ(self, pid: int) -> bytes:
        """/proc/<pid>/environ, read once per snapshot (b"" when gone or another user's)."""
        if pid not in self.environs:
            self.environs[pid] = procfs.environ(pid) or b""
        return self.environs[pid]


def _read_stat(pid: int) -> _Proc | None:
    st = procfs.stat(pid)
    return None if st is None else _Proc(pid, st.ppid, st.session, st.state, st.start)


def _state(pid: int) -> str | None:
    p = _read_stat(pid)
    return p.state if p else None


def _is_launch_shell(pid: int) -> bool:
    """Whether `pid` still runs the launch shell of `launch_argv` (it has not exec'd yet)."""
    cmd = procfs.cmdline(pid)
    return cmd is not None and _launching(cmd)


def _launching(cmdline: bytes) -> bool:
    """Whether a /proc/<pid>/cmdline may still be the launch shell's. Empty counts: in the middle
    of an exec (the launch shell's own, or its start-up's) the new image has no arguments yet, and
    taking that for "past its stop" would leave the shell stopped, never resumed."""
    return not cmdline or f"\0{_LAUNCH}\0".encode() in cmdline


def _members(snap: _Snapshot, group: Group) -> list[int]:
    """The group's processes in `snap`: its leader's tree, session, and what it detached."""
    if group.pid is None:
        return []
    born = group.extra.get("born", 0)
    return snap.tree(group.pid, group.command_id, born if isinstance(born, int) else 0)


def set_affinity(pid: int, cpus: set[int] | frozenset[int]) -> list[str]:
    """Every thread of `pid` onto `cpus` (threads started later inherit their creator's); the
    threads that refused, each with why (one exited meanwhile, a CPU outside its cpuset)."""
    refused = []
    for tid in procfs.tids(pid) or ():
        try:
            os.sched_setaffinity(tid, cpus)
        except OSError as e:
            refused.append(f"{tid}: {e}")
    return refused


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError:
            pass


def _pidfd(pid: int) -> int | None:
    """A pidfd of `pid`, or None when it is gone."""
    try:
        return os.pidfd_open(pid)
    except OSError:
        return None


async def _until_stopped(sent: dict[str, list[int]], deadline: float, timeout: float) -> None:
    """Until every process of `sent` has stopped (or gone); FreezeError past `deadline`."""
    pending = [pid for pids in sent.values() for pid in pids]
    while True:
        pending = [pid for pid in pending if _state(pid) not in (None, "Z", "X", *_STOPPED)]
        if not pending:
            return
        if time.perf_counter() > deadline:
            raise FreezeError(",".join(sent), f"pids {pending} did not stop within {timeout:.3f} s")
        await asyncio.sleep(0.0002)


def _signal_fds(fds: dict[int, int], pids: list[int], sig: int) -> None:
    """Signal `pids` through their pidfds in `fds` (a process that is gone is skipped)."""
    for pid in pids:
        fd = fds.get(pid)
        if fd is None:
            continue
        try:
            signal.pidfd_send_signal(fd, sig)
        except OSError:
            pass


def _close_fds(fds: dict[int, int]) -> None:
    for fd in fds.values():
        os.close(fd)
    fds.clear()


class SignalBackend(Backend):
    name = "signal"

    def __init__(self, cpus: frozenset[int] | None = None) -> None:
        super().__init__()
        self.all_cpus = frozenset(cpus or os.sched_getaffinity(0))
        self.reason = "signals and sched_setaffinity: needs no cgroups and no root"
        self.guard: Guard | None = None  # resumes what we stopped if the daemon dies
        self._late: set[asyncio.Task[None]] = set()  # launch shells resumed once they stopped

    async def reconcile(self) -> list[str]:
        """At start-up: start the guard (nothing of a previous daemon's can be found by pid)."""
        try:
            self.guard = Guard.start()
        except GuardError as e:
            return [f"no signal guard, stopped processes stay stopped if the daemon dies: {e}"]
        return [f"signal guard pid {self.guard.pid} resumes stopped processes if the daemon dies"]

    def _stopping(self, pids: list[int]) -> None:
        if self.guard is not None:
            self.guard.stopped(pids)

    def _resumed(self, pids: list[int]) -> None:
        if self.guard is not None:
            self.guard.resumed(pids)

    async def create(self, command_id: str) -> Group:
        return Group(command_id)

    def launch_argv(
        self,
        group: Group,
        argv: list[str],
        *,
        frozen: bool,
        as_user: tuple[int, int, list[int]] | None = None,
    ) -> list[str]:
        if not frozen:
            return argv
        # The shell stops itself before exec: the command's first instruction runs only after thaw.
        group.frozen = True
        group.extra["sent"] = []
        group.extra["launched_stopped"] = True
        return ["/bin/sh", "-c", 'kill -STOP $$; exec "$@"', _LAUNCH, *argv]

    async def started(self, group: Group, pid: int) -> None:
        group.pid = pid
        if (p := _read_stat(pid)) is not None:
            group.extra["born"] = p.born  # what it detaches later is born after it
        if group.extra.get("launched_stopped"):
            self._stopping([pid])
        if group.cores is not None:
            set_affinity(pid, group.cores)

    def pids(self, group: Group) -> list[int]:
        return _members(_Snapshot(), group)

    async def freeze(
        self, group: Group, *, keep: frozenset[int] = frozenset(), timeout: float = 1.0
    ) -> Freeze:
        return (await self.freeze_many([group], keep=keep, timeout=timeout))[0]

    async def freeze_many(
        self, groups: list[Group], *, keep: frozenset[int] = frozenset(), timeout: float = 1.0
    ) -> list[Freeze]:
        """Stop the groups' processes from one /proc snapshot, then verify they all stopped.

        Children forked while their parent was being stopped are caught by re-reading until a pass
        finds nothing new. On failure or cancellation every group of the batch is resumed (and
        FreezeError raised for a failure).
        """
        t0 = time.perf_counter()
        todo = [g for g in groups if not g.frozen and g.pid is not None]
        results = {g.name: Freeze(g.name, vanished=g.pid is None) for g in groups}
        sent: dict[str, list[int]] = {g.name: [] for g in todo}
        already: dict[str, set[int]] = {g.name: set() for g in todo}
        fds: dict[str, dict[int, int]] = {g.name: {} for g in todo}
        try:
            await self._stop_and_verify(todo, keep, sent, already, fds, t0 + timeout, timeout)
        except BaseException:
            self._resume_all(todo, sent, already, fds)
            raise
        elapsed = time.perf_counter() - t0
        for g in todo:
            g.frozen = True
            g.extra["sent"] = sent[g.name]
            g.extra["stopped"] = already[g.name]
            g.extra["pidfds"] = fds[g.name]
            r = results[g.name]
            r.pids = len(sent[g.name])
            r.stopped = list(sent[g.name])
            r.vanished = not sent[g.name]
            r.seconds = elapsed
        return [results[g.name] for g in groups]

    async def _stop_and_verify(
        self,
        todo: list[Group],
        keep: frozenset[int],
        sent: dict[str, list[int]],
        already: dict[str, set[int]],
        fds: dict[str, dict[int, int]],
        deadline: float,
        timeout: float,
    ) -> None:
        """SIGSTOP every process of `todo` through a pidfd (recording each in `sent` and `fds`
        before its signal) and wait until all have stopped, then look again: a process inside
        fork() when its SIGSTOP came stops after the fork, with a child that the signal missed.
        Only a look taken once every process signalled has stopped finds nothing new for certain
        (the `keep` pids, a region's owner, run on: children they fork are stopped in the next
        pass, as before). Raises FreezeError; the caller resumes."""
        for _ in range(64):
            snap = _Snapshot()
            fresh = False
            for g in todo:
                done = set(sent[g.name])
                for pid in _members(snap, g):
                    if pid in keep or pid in done:
                        continue
                    fresh = True
                    fd = _pidfd(pid)
                    if fd is None:  # gone since the snapshot
                        continue
                    fds[g.name][pid] = fd
                    if snap.procs[pid].state in _STOPPED:
                        already[g.name].add(pid)
                    else:
                        self._stopping([pid])  # before the signal: the guard must know first
                    sent[g.name].append(pid)
                    _signal_fds(fds[g.name], [pid], signal.SIGSTOP)
            if not fresh:
                return
            await _until_stopped(sent, deadline, timeout)
        raise FreezeError(",".join(sent), "process tree kept growing while being stopped")

    def _resume_all(
        self,
        groups: list[Group],
        sent: dict[str, list[int]],
        already: dict[str, set[int]],
        fds: dict[str, dict[int, int]],
    ) -> None:
        for g in groups:
            pids = [p for p in sent[g.name] if p not in already[g.name]]
            _signal_fds(fds[g.name], pids, signal.SIGCONT)
            _close_fds(fds[g.name])
            self._resumed(pids)

    async def thaw(self, group: Group) -> float:
        t0 = time.perf_counter()
        if not group.frozen:
            return 0.0
        sent: list[int] = list(group.extra.pop("sent", []))  # type: ignore[call-overload]
        already: set[int] = group.extra.pop("stopped", set())  # type: ignore[assignment]
        fds: dict[int, int] = group.extra.pop("pidfds", {})  # type: ignore[assignment]
        if group.extra.pop("launched_stopped", False) and group.pid is not None:
            # The launch shell stops itself: a SIGCONT that comes before its `kill -STOP $$` is
            # lost and the command would stay stopped forever. Wait (bounded) until it stopped;
            # a shell slower than that is resumed in the background once it has.
            deadline = time.perf_counter() + 1.0
            while _state(group.pid) not in (None, "Z", "X", *_STOPPED) and time.perf_counter() < deadline:
                await asyncio.sleep(0.0005)
            if _state(group.pid) in (None, "Z", "X", *_STOPPED):
                # the leader: the daemon has not reaped it, so its pid is still its own
                _signal([group.pid], signal.SIGCONT)
                self._resumed([group.pid])
            else:
                task = asyncio.get_running_loop().create_task(self._resume_launch(group, group.pid))
                self._late.add(task)
                task.add_done_callback(self._late.discard)
        resumed = [p for p in sent if p not in already]
        _signal_fds(fds, resumed, signal.SIGCONT)
        _close_fds(fds)
        self._resumed(resumed)
        group.frozen = False
        return time.perf_counter() - t0

    async def _resume_launch(self, group: Group, pid: int) -> None:
        """SIGCONT the launch shell `pid` once it has stopped itself (not while a later freeze of
        the group holds it); done when it is gone or got past its stop (it is no longer the
        launch shell). The pid cannot be reused meanwhile: the daemon has not reaped it."""
        try:
            while (st := _state(pid)) not in (None, "Z", "X") and _is_launch_shell(pid):
                if st in _STOPPED and not group.frozen:
                    _signal([pid], signal.SIGCONT)
                    break
                await asyncio.sleep(0.002)
        finally:
            self._resumed([pid])

    async def set_cores(
        self,
        group: Group,
        cpus: frozenset[int] | None,
        *,
        pids: list[int] | None = None,
        exclusive: bool = False,
    ) -> None:
        target = cpus if cpus is not None else self.all_cpus
        if pids is None:
            group.cores = cpus
            pids = self.pids(group)
        for pid in pids:
            set_affinity(pid, target)

    async def kill(self, group: Group, sig: int = signal.SIGKILL) -> None:
        """Signal the process group and every process of the tree (a stopped one acts on SIGKILL at
        once, on other signals only once thawed)."""
        if group.pid is None:
            return
        pids = self.pids(group)
        try:
            os.killpg(group.pid, sig)
        except OSError:
            pass
        _signal(pids, sig)

    async def remove(self, group: Group) -> None:
        forget: list[int] = list(group.extra.get("sent", []))  # type: ignore[call-overload]
        if group.pid is not None:
            forget.append(group.pid)
        self._resumed(forget)  # dead now (killed while stopped): nothing to resume
        _close_fds(group.extra.get("pidfds", {}))  # type: ignore[arg-type]
        group.extra.clear()

    async def close(self) -> None:
        for task in list(self._late):
            task.cancel()
        if self.guard is not None:
            self.guard.close()
            self.guard = None
