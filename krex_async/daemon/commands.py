"""One command's life: validate its spec, spawn it inside its isolation group, pump its output, time
it out, and build its report.

Output is read from pipes with the loop's readers and handed to every subscriber as it comes; the last
`output_tail` bytes of each stream stay with the command, so an agent that re-attaches after a
disconnect still gets them with the report. The whole output also goes to the command's spool files
(spool.py), and each spawned command gets a durable record (records.py) that a new daemon reports
it from should this one die. When the leader exits, what is left of its process tree is ended (a
command's lifetime is its leader's), after its pipes had a moment to drain.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pwd
import secrets
import shutil
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum

import msgspec

from krex_async import protocol as P
from krex_async.daemon.records import Record, Records, start_ticks
from krex_async.daemon.spool import Spool, SpoolFile, unlink
from krex_async.daemon.stdinpipe import StdinPipe
from krex_async.devices.base import VISIBILITY_VARS, Device
from krex_async.isolation.base import Backend, Group, IsolationError
from krex_async.linux.spawn import PRIVILEGED_ENV, ExitStatus, Handoff, Launched, LaunchSpec, spawn
from krex_async.scheduler import Policy

RUNTIME_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "runtime")


class SpecError(Exception):
    """The command cannot be started as asked; the message says which field and why."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def resolve_argv0(argv0: str, env: dict[str, str], cwd: str) -> str:
    """The executable a spawn would run, or SpecError naming what was looked up."""
    if "\x00" in argv0 or not argv0:
        raise SpecError("bad_spec", "argv[0] is empty or contains NUL")
    if "/" in argv0:
        path = argv0 if os.path.isabs(argv0) else os.path.join(cwd, argv0)
        if not os.path.isfile(path) or not os.access(path, os.X_OK):
            raise SpecError("bad_spec", f"argv[0] {argv0!r} is not an executable file")
        return path
    found = shutil.which(argv0, path=env.get("PATH", os.defpath))
    if not found:
        raise SpecError("bad_spec", f"argv[0] {argv0!r} not found on PATH {env.get('PATH', '')!r}")
    return found


def with_runtime(env: dict[str, str]) -> dict[str, str]:
    """env with krex's in-command runtime (runtime/sitecustomize.py) first on PYTHONPATH."""
    if os.path.exists(os.path.join(RUNTIME_DIR, "sitecustomize.py")):
        env["PYTHONPATH"] = RUNTIME_DIR + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def user_groups(uid: int, gid: int) -> list[int]:
    """The supplementary groups of the submitting user, as a login would give them."""
    try:
        return os.getgrouplist(pwd.getpwuid(uid).pw_name, gid)
    except KeyError:  # a uid without a passwd entry: its primary group only
        return [gid]


@dataclass
class Subscriber:
    send: Callable[[P.Msg], bool]  # False once the connection is gone
    req_id: int
    stream: bool = True


class Tail:
    """The last `limit` bytes written to a stream, and how many were written in all."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.buf = bytearray()
        self.total = 0

    def add(self, data: bytes) -> None:
        self.total += len(data)
        self.buf += data
        if len(self.buf) > self.limit:
            del self.buf[: len(self.buf) - self.limit]


class CommandState(StrEnum):
    """Where a command is in its life (its report's `state` says how it ended)."""

    QUEUED = "queued"  # waiting for its device (policy command) or its start
    STARTING = "starting"  # its group made, its leader being spawned
    RUNNING = "running"
    ENDED = "ended"  # its report is set


@dataclass
class Command:
    id: str
    spec: P.Submit
    uid: int
    gid: int
    device: Device | None
    policy: Policy | None  # None: recovered from a record that did not name it
    tail_limit: int
    token: str = field(default_factory=lambda: secrets.token_hex(16))
    state: CommandState = CommandState.QUEUED
    group: Group | None = None
    launched: Launched | None = None
    report: P.CommandReport | None = None
    subscribers: list[Subscriber] = field(default_factory=list)
    runtimes: dict[int, Callable[[P.Msg], bool]] = field(default_factory=dict)  # pid -> send
    # interpreters whose program a pool worker runs: each waits, idle, for the worker's status
    adopters: set[int] = field(default_factory=set)
    # (time.monotonic(), signal) of every signal sent to the whole tree: an interpreter waiting for
    # a worker has them blocked, and its worker, not yet in the tree, must get them (WarmPools.adopt)
    signalled: list[tuple[float, int]] = field(default_factory=list)
    regions: list[P.RegionReport] = field(default_factory=list)
    submitted: float = field(default_factory=time.monotonic)
    started: float = 0.0
    ended_at: float = 0.0
    end_reason: str = ""
    start_error: str = ""  # why the applier could not start it (state "failed")
    # A cancel (or shutdown) that came while the command was starting: (reason, signal), acted
    # on as soon as the leader runs (Lifecycle._start).
    kill_pending: tuple[str, int] | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)
    watch_task: asyncio.Task[None] | None = None
    pipe_closers: list[Callable[[], None]] = field(default_factory=list)
    spools: dict[str, SpoolFile] = field(default_factory=dict)  # stream -> its spool file
    handoff: Handoff | None = None  # another user's command: its cwd and env, applied after the drop
    stdin_pipe: StdinPipe | None = None  # Submit.stdin_stream: fed by StdinData until it ends
    pool_env: dict[str, str] = field(default_factory=dict)  # KREX_POOL, where its interpreters may be adopted

    def __post_init__(self) -> None:
        self.out = Tail(self.tail_limit)
        self.err = Tail(self.tail_limit)

    @property
    def policy_name(self) -> str:
        """The policy as the wire, the records and the metrics spell it ("" where unknown)."""
        return self.policy.value if self.policy is not None else ""

    @property
    def device_key(self) -> str | None:
        return self.device.key if self.device else None

    @property
    def pid(self) -> int | None:
        return self.launched.pid if self.launched else None

    def publish(self, make: Callable[[int], P.Msg], *, output: bool = False) -> None:
        """Send make(request id) to every subscriber (output only to those that stream)."""
        for sub in list(self.subscribers):
            if output and not sub.stream:
                continue
            if not sub.send(make(sub.req_id)):
                self.subscribers.remove(sub)

    def publish_exit(self, report: P.CommandReport) -> None:
        """The end, to every subscriber: one that did not stream (Submit.stream=False) gets the
        output with it, as the kept tails."""
        for sub in list(self.subscribers):
            tails = (
                {} if sub.stream else {"stdout_tail": bytes(self.out.buf), "stderr_tail": bytes(self.err.buf)}
            )
            if not sub.send(P.Exited(id=sub.req_id, report=report, **tails)):
                self.subscribers.remove(sub)

    def slim(self) -> None:
        """Ended: keep what its report and an attach need. The spec's stdin (up to 8 MiB) and env
        go, argv becomes the report's own list, and the pipes' closers and runtimes' senders
        (closures over connections that may be long gone) are dropped."""
        argv = self.report.argv if self.report is not None else list(self.spec.argv)
        self.spec = msgspec.structs.replace(self.spec, stdin=None, env=None, argv=argv)
        self.pipe_closers.clear()
        self.runtimes.clear()

    def environment(self, socket: str) -> dict[str, str]:
        env = (
            dict(self.spec.env)
            if self.spec.env is not None
            else {"PATH": os.environ.get("PATH", os.defpath), "LANG": os.environ.get("LANG", "C.UTF-8")}
        )
        env.update(
            KREX_SOCKET=socket,
            KREX_COMMAND=self.id,
            KREX_TOKEN=self.token,
            KREX_DEVICE=self.device_key or "none",
        )
        if self.device is not None:
            if self.device.vendor != "cpu":
                for name in VISIBILITY_VARS:
                    env.pop(name, None)
            env.update(self.device.env)
        env.update(self.pool_env)
        return with_runtime(env)


class CommandRunner:
    """Spawns commands and watches them; calls `on_exit(cmd)` once each has ended."""

    def __init__(
        self,
        backend: Backend,
        socket: str,
        on_exit: Callable[[Command], None],
        launcher: Callable[[Command, LaunchSpec], Launched | None] | None = None,
        spool: Spool | None = None,
        records: Records | None = None,
    ) -> None:
        self.backend = backend
        self.spool = spool  # None or limit 0: output only in the tails
        self.records = records  # None: commands are not recorded (nothing to report after a crash)
        self.socket = socket
        self.on_exit = on_exit
        self.launcher = launcher  # the ctxpool, when it can take the command (it joins cmd.group)

    def check(self, cmd: Command) -> tuple[str, dict[str, str]]:
        """Validate cwd and argv before anything is created; returns (cwd, env).

        The paths are looked at here only for a command of the daemon's own user: for anyone
        else the daemon's answer would tell what that user may not see, so their cwd and argv[0]
        are checked by the kernel when the applier enters and execs them, as that user."""
        cwd = cmd.spec.cwd or "/"
        if not os.path.isabs(cwd) or "\x00" in cwd:
            raise SpecError("bad_spec", f"cwd {cwd!r} must be an absolute path")
        env = cmd.environment(self.socket)
        for k in env:
            if not k or "=" in k or "\x00" in k or "\x00" in env[k]:
                raise SpecError("bad_spec", f"environment variable name {k!r} is invalid")
        if any("\x00" in a for a in cmd.spec.argv) or not cmd.spec.argv[0]:
            raise SpecError("bad_spec", "argv[0] is empty or argv contains a NUL byte")
        if cmd.uid == os.geteuid():
            if not os.path.isdir(cwd):
                raise SpecError("bad_spec", f"cwd {cwd!r} is not a directory")
            resolve_argv0(cmd.spec.argv[0], env, cwd)
        return cwd, env

    async def start(self, cmd: Command, *, frozen: bool, cores: frozenset[int] | None) -> None:
        """Create the group, spawn the leader into it, start pumps and the timeout.

        Raises SpecError (after releasing the group) when the group cannot be made or set up, or
        the spawn fails: the caller must then end the command (it has no process to watch).
        """
        cwd, env = self.check(cmd)
        loop = asyncio.get_running_loop()
        cmd.state = CommandState.STARTING
        try:
            cmd.group = group = await self.backend.create(cmd.id)
            if cores is not None:
                await self.backend.set_cores(group, cores)
        except (OSError, IsolationError) as e:  # e.g. EAGAIN past cgroup.max.descendants
            if cmd.group is not None:
                try:
                    await self.backend.remove(cmd.group)
                except (OSError, IsolationError):
                    pass
            cmd.group = None
            raise SpecError("spawn_failed", f"cannot create the isolation group of {cmd.id}: {e}") from None
        fds: list[int] = []
        try:
            out_r, out_w = os.pipe()
            fds += (out_r, out_w)
            err_r, err_w = os.pipe()
            fds += (err_r, err_w)
            stdin_fd = cmd.stdin_pipe.reader() if cmd.stdin_pipe else self._stdin(cmd.spec.stdin)
        except OSError as e:  # out of fds, the memfd refused: nothing started, nothing kept
            for fd in fds:
                os.close(fd)
            await self.abandon(cmd)
            raise SpecError("spawn_failed", f"cannot set up the pipes of {cmd.id}: {e}") from None
        if cmd.spec.stdin is not None:  # in the memfd now: the daemon need not hold it twice
            cmd.spec = msgspec.structs.replace(cmd.spec, stdin=None)
        if self.spool is not None:
            cmd.spools = self.spool.open(cmd.id, cmd.uid, cmd.gid)
        other_user = cmd.uid != os.geteuid()
        try:
            spec = LaunchSpec(
                argv=list(cmd.spec.argv),
                cwd=cwd,
                env=env,
                stdin_fd=stdin_fd,
                stdout_fd=out_w,
                stderr_fd=err_w,
                uid=cmd.uid if other_user else None,
                gid=cmd.gid if other_user else None,
                groups=user_groups(cmd.uid, cmd.gid) if other_user else None,
                frozen=frozen,
            )
            if other_user:  # nothing of the user's reaches a process that still holds privilege
                cmd.handoff = Handoff.make(spec.argv, cwd, env)
                spec.argv, spec.cwd, spec.env = cmd.handoff.argv, "/", dict(PRIVILEGED_ENV)
                spec.pass_fds = (cmd.handoff.env_fd, cmd.handoff.err_w)
            launched = None
            if self.launcher and not frozen and not other_user:
                launched = self.launcher(cmd, spec)
            if launched is None:
                as_user = None
                if other_user and self.backend.wrapper_drops_privileges:
                    as_user = (cmd.uid, cmd.gid, spec.groups or [])
                    spec.uid = spec.gid = spec.groups = None
                argv = self.backend.launch_argv(group, spec.argv, frozen=frozen, as_user=as_user)
                launched = spawn(spec, argv)
        except (OSError, ValueError, SpecError, IsolationError) as e:
            for fd in (out_r, err_r):
                os.close(fd)
            if cmd.handoff is not None:
                cmd.handoff.failure()
                cmd.handoff = None
            await self.backend.remove(group)
            cmd.group = None
            self.release(cmd)
            raise SpecError("spawn_failed", f"cannot start {cmd.spec.argv[0]!r}: {e}") from None
        finally:
            for fd in (out_w, err_w, stdin_fd):
                os.close(fd)
            if cmd.handoff is not None and cmd.handoff.env_fd >= 0:
                cmd.handoff.spawned()
        cmd.launched = launched
        cmd.started = time.monotonic()
        cmd.state = CommandState.RUNNING
        await self.backend.started(group, launched.pid)
        if self.records is not None:
            self.records.write(_record(cmd, self.backend, self.records.me))
        pipes_done = [self._pump(loop, cmd, out_r, "stdout"), self._pump(loop, cmd, err_r, "stderr")]
        cmd.watch_task = loop.create_task(self._watch(cmd, launched, pipes_done))

    @staticmethod
    def _stdin(data: bytes | None) -> int:
        if data is None:
            return os.open(os.devnull, os.O_RDONLY)
        fd = os.memfd_create("krex-stdin", os.MFD_CLOEXEC)
        os.write(fd, data)
        os.lseek(fd, 0, os.SEEK_SET)
        return fd

    def _pump(
        self, loop: asyncio.AbstractEventLoop, cmd: Command, fd: int, stream: str
    ) -> asyncio.Future[None]:
        done: asyncio.Future[None] = loop.create_future()
        os.set_blocking(fd, False)
        tail = cmd.out if stream == "stdout" else cmd.err
        spool = cmd.spools.get(stream)

        def readable() -> None:
            try:
                data = os.read(fd, 1 << 16)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if data:
                tail.add(data)
                if spool is not None:
                    spool.write(data)
                cmd.publish(
                    lambda rid: P.Output(
                        id=rid,
                        command=cmd.id,
                        stream=stream,  # type: ignore[arg-type]
                        data=data,
                    ),
                    output=True,
                )
                return
            close()

        def close() -> None:
            if not done.done():
                loop.remove_reader(fd)
                os.close(fd)
                done.set_result(None)

        loop.add_reader(fd, readable)
        cmd.pipe_closers.append(close)
        return done

    async def _watch(self, cmd: Command, launched: Launched, pipes: list[asyncio.Future[None]]) -> None:
        try:
            status = await asyncio.wait_for(launched.wait(), cmd.spec.timeout)
        except TimeoutError:
            await self.kill(cmd, "timeout")
            status = await launched.wait()
        # Give output written just before exit a moment to arrive, then end what is left of the tree.
        await asyncio.wait(pipes, timeout=0.5)
        if cmd.group is not None:
            if launched.lives_on:  # a pool worker, back in its pool: not part of the tree now
                self.backend.leader_left(cmd.group)
            await self.backend.kill(cmd.group, signal.SIGKILL)
        await asyncio.wait(pipes, timeout=0.5)
        for close in cmd.pipe_closers:
            close()
        await self._flush(cmd)
        if cmd.handoff is not None:
            failed = cmd.handoff.failure()
            cmd.handoff = None
            if failed and not cmd.end_reason:
                cmd.end_reason = "failed"
                cmd.start_error = _start_error(failed, cmd)
        self._finish(cmd, status)

    @staticmethod
    async def _flush(cmd: Command, timeout: float = 10.0) -> None:
        """Wait (bounded) until the spool files hold everything queued and are closed; a writer
        that does not get there in time is named in the report and finishes on its own."""
        if not cmd.spools:
            return
        waits = {asyncio.wrap_future(f.finish()): f for f in cmd.spools.values()}
        _, late = await asyncio.wait(waits, timeout=timeout)
        for fut in late:
            f = waits[fut]
            f.error = f.error or f"still writing {f.path} {timeout:.0f} s after the command ended"

    async def kill(self, cmd: Command, reason: str, sig: int = signal.SIGKILL) -> None:
        """End the command's whole tree (frozen processes included) and record why."""
        if cmd.state != CommandState.RUNNING or cmd.group is None:
            return
        if cmd.launched is None or cmd.launched.returncode is None:
            # once the leader exited of itself, what is left is ended but its exit stays its own
            cmd.end_reason = cmd.end_reason or reason
        cmd.signalled.append((time.monotonic(), sig))
        await self.backend.kill(cmd.group, sig)

    async def abandon(self, cmd: Command) -> None:
        """A start that failed before its leader ran: its group (if made) and what release() frees
        go, errors removing the group aside (the start's own error is the one to report)."""
        if cmd.group is not None:
            with contextlib.suppress(Exception):
                await self.backend.remove(cmd.group)
            cmd.group = None
        self.release(cmd)

    def release(self, cmd: Command) -> None:
        """Forget a command for good (its retention ended, or it never started): its spool files
        and its record are removed. Errors are logged, never raised."""
        if cmd.stdin_pipe is not None:
            cmd.stdin_pipe.close()
        for f in cmd.spools.values():
            f.finish()
        paths = {f.path for f in cmd.spools.values()}
        if cmd.report is not None:  # a dead daemon's command has its paths only in its report
            paths |= {cmd.report.stdout_spool, cmd.report.stderr_spool}
        paths.discard("")
        if paths:
            if self.spool is not None:
                self.spool.remove(sorted(paths))
            else:
                unlink(sorted(paths))
        if self.records is not None:
            self.records.remove(cmd.id)

    def _finish(self, cmd: Command, status: ExitStatus) -> None:
        now = time.monotonic()
        out, err = cmd.spools.get("stdout"), cmd.spools.get("stderr")
        cmd.ended_at = now
        cmd.state = CommandState.ENDED
        if cmd.end_reason:
            state = cmd.end_reason
        else:
            state = "signaled" if status.signal else "exited"
        cmd.report = P.CommandReport(
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
        )
        if self.records is not None:
            self.records.ended(cmd.id, cmd.report)
        self.on_exit(cmd)


def _start_error(what: str, cmd: Command) -> str:
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


def _record(cmd: Command, backend: Backend, daemon: tuple[int, int]) -> Record:
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
        return "cancelled by its agent"
    if state == "failed":
        return cmd.start_error
    if status.signal:
        try:
            return f"killed by {signal.Signals(status.signal).name}"
        except ValueError:
            return f"killed by signal {status.signal}"
    return ""
