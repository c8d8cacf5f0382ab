"""Starting a command's leader process and waiting for it, without asyncio's child watchers.

`spawn()` forks and execs with subprocess.Popen (its own session and process group, the submitting
user's uid/gid, real fds 0/1/2 given by the caller) and returns a `Launched` whose `wait()` resolves
through a pidfd registered with the event loop, so no SIGCHLD handler or watcher thread is involved.
The ctxpool hands out the same `Launched` interface for commands it runs in warm workers.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
from dataclasses import dataclass, field


@dataclass
class LaunchSpec:
    argv: list[str]
    cwd: str
    env: dict[str, str]
    stdin_fd: int
    stdout_fd: int
    stderr_fd: int
    uid: int | None = None  # run as this user (None: the daemon's)
    gid: int | None = None
    groups: list[int] | None = None
    cgroup_procs: str | None = None  # a cgroup.procs file the process joins before its first instruction
    frozen: bool = False  # start stopped (the backend's wrapper takes care of it)


@dataclass
class ExitStatus:
    """returncode as subprocess reports it: >= 0 an exit code, < 0 the signal that ended it."""

    returncode: int
    user_s: float = 0.0
    system_s: float = 0.0

    @property
    def signal(self) -> int | None:
        return -self.returncode if self.returncode < 0 else None


@dataclass
class Launched:
    """A started leader process. `wait()` may be awaited by many; it resolves once."""

    pid: int
    _done: asyncio.Future[ExitStatus] = field(repr=False)
    via: str = "exec"  # "exec" or "pool"
    start_latency_s: float | None = None  # submit to first instruction, where known (pool)
    lives_on: bool = False  # a pool worker that went back to its pool: no longer the command's

    async def wait(self) -> ExitStatus:
        return await asyncio.shield(self._done)

    @property
    def returncode(self) -> int | None:
        return self._done.result().returncode if self._done.done() else None


def watch_pid(loop: asyncio.AbstractEventLoop, pid: int) -> asyncio.Future[ExitStatus]:
    """A future for the exit of `pid`, a child of this process, reaped with wait4 on pidfd readiness."""
    done: asyncio.Future[ExitStatus] = loop.create_future()
    pidfd = os.pidfd_open(pid)

    def on_ready() -> None:
        try:
            wpid, status, ru = os.wait4(pid, os.WNOHANG)
        except ChildProcessError:  # reaped elsewhere: the status is lost, say so rather than hang
            wpid, status, ru = pid, 255 << 8, None
        if wpid == 0:
            return
        loop.remove_reader(pidfd)
        os.close(pidfd)
        if not done.done():
            done.set_result(ExitStatus(
                returncode=os.waitstatus_to_exitcode(status),
                user_s=ru.ru_utime if ru else 0.0,
                system_s=ru.ru_stime if ru else 0.0,
            ))

    loop.add_reader(pidfd, on_ready)
    return done


def spawn(spec: LaunchSpec, argv: list[str] | None = None) -> Launched:
    """Fork and exec `argv` (default spec.argv). Raises OSError (ENOENT, EACCES...) when exec fails."""
    loop = asyncio.get_running_loop()
    proc = subprocess.Popen(
        argv or spec.argv,
        cwd=spec.cwd,
        env=spec.env,
        stdin=spec.stdin_fd,
        stdout=spec.stdout_fd,
        stderr=spec.stderr_fd,
        start_new_session=True,
        close_fds=True,
        user=spec.uid,
        group=spec.gid,
        extra_groups=spec.groups,
        restore_signals=True,
    )
    # Popen keeps a handle we never use; forget it so its __del__ does not try to reap our child.
    proc.returncode = 0
    return Launched(pid=proc.pid, _done=watch_pid(loop, proc.pid))
