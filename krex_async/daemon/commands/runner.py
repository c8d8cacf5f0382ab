"""A command's processes: its spec checked, its isolation group made, its leader spawned into it
(or handed to a warm pool worker), its output pumped to subscribers, tails and spool files, its
timeout kept, and, when the leader exits, what is left of its tree ended after its pipes had a
moment to drain.

The whole output also goes to the command's spool files (spool.py), and each spawned command gets a
durable record (records.py) that a new daemon reports it from should this one die; report.py builds
both that record and the report its end is told with.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import stat
import time
from collections.abc import Callable

import msgspec

from krex_async import protocol as P
from krex_async.daemon.commands.report import end_report, spawn_record, start_error
from krex_async.daemon.model.command import Command, CommandState, SpecError, user_groups
from krex_async.daemon.persist.records import Records
from krex_async.daemon.persist.spool import Spool, unlink
from krex_async.isolation.base import Backend, IsolationError
from krex_async.linux.spawn import PRIVILEGED_ENV, ExitStatus, Handoff, Launched, LaunchSpec, spawn


def resolve_argv0(argv0: str, env: dict[str, str], cwd: str) -> str:
    """The executable a spawn would run, or SpecError naming what was looked up."""
    if "\x00" in argv0 or not argv0:
        raise SpecError("bad_spec", "argv[0] is empty or contains NUL")
    if "/" in argv0:
        path = argv0 if os.path.isabs(argv0) else os.path.join(cwd, argv0)
        # as the shell: a missing path is "not found" (krex run's 127, the client tells it by
        # those words); one that is there but cannot be run (a directory, no x bit) is 125
        try:
            mode: int | None = os.stat(path).st_mode
        except FileNotFoundError:
            raise SpecError("bad_spec", f"argv[0] {argv0!r} not found (no such file)") from None
        except OSError:  # ENOTDIR, EACCES on the way: there, but not runnable by us
            mode = None
        if mode is None or not stat.S_ISREG(mode) or not os.access(path, os.X_OK):
            raise SpecError("bad_spec", f"argv[0] {argv0!r} cannot be executed: not an executable file")
        return path
    found = shutil.which(argv0, path=env.get("PATH", os.defpath))
    if not found:
        raise SpecError("bad_spec", f"argv[0] {argv0!r} not found on PATH {env.get('PATH', '')!r}")
    return found


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
            self.records.write(spawn_record(cmd, self.backend, self.records.me))
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
                cmd.start_error = start_error(failed, cmd)
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
        cmd.ended_at = now
        cmd.state = CommandState.ENDED
        cmd.report = end_report(cmd, status, now)
        if self.records is not None:
            self.records.ended(cmd.id, cmd.report)
        self.on_exit(cmd)
