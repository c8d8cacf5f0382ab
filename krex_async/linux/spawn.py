"""Starting a command's leader process and waiting for it, without asyncio's child watchers.

`spawn()` forks and execs with subprocess.Popen (its own session and process group, the submitting
user's uid/gid, real fds 0/1/2 given by the caller) and returns a `Launched` whose `wait()` resolves
through a pidfd registered with the event loop, so no SIGCHLD handler or watcher thread is involved.
The ctxpool hands out the same `Launched` interface for commands it runs in warm workers.

A command of another user than the daemon's is started through `Handoff`: whatever runs with the
daemon's privileges (the cgroup join wrapper, setpriv, the fork before Popen's drop) gets
PRIVILEGED_ENV and cwd "/", nothing of the user's (the dynamic loader honours LD_PRELOAD,
LD_LIBRARY_PATH, GLIBC_TUNABLES... in any process that is not setuid, root's included). After the
drop a tiny Python program, as the user, reads the user's cwd and environment from a memfd, enters
the cwd and execs argv[0] looked up on the user's PATH, so the kernel checks both with the user's
rights. A failure there is one word on an error pipe (`cwd` or `exec`, never the errno: "not there"
and "not yours" read the same) that the daemon reads when the leader exits.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import stat
import subprocess
import sys
from dataclasses import dataclass, field

#: the whole environment of any process started with the daemon's privileges
PRIVILEGED_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C"}

# Run as the user: argv[1] the memfd (cwd NUL env...), argv[2] the error pipe, argv[3] "--".
_APPLY = """\
import errno, os, sys
a, e = int(sys.argv[1]), int(sys.argv[2])
os.set_inheritable(e, False)
buf = []
while True:
    c = os.read(a, 1 << 16)
    if not c:
        break
    buf.append(c)
os.close(a)
cwd, *pairs = b"".join(buf).split(b"\\0")
env = dict(p.split(b"=", 1) for p in pairs if p)
argv = [os.fsencode(x) for x in sys.argv[4:]]
try:
    os.chdir(cwd)
except OSError:
    os.write(e, b"cwd")
    os._exit(125)
# as execvp does: each PATH entry in turn, and a file without #! to /bin/sh
name = argv[0]
dirs = [b""] if b"/" in name else env.get(b"PATH", b"/bin:/usr/bin").split(b":")
for d in dirs:
    path = os.path.join(d or b".", name) if d or b"/" not in name else name
    try:
        os.execve(path, argv, env)
    except OSError as x:
        if x.errno == errno.ENOEXEC:
            try:
                os.execve(b"/bin/sh", [b"/bin/sh", path] + argv[1:], env)
            except OSError:
                pass
os.write(e, b"exec")
os._exit(127)
"""


def _reachable_by_all(path: str) -> bool:
    """Whether every directory on the way to `path` is searchable and the file executable by
    anyone (the user a command runs as is not known to own or share a group with any of it)."""
    d = path
    while True:
        try:
            mode = os.stat(d).st_mode
        except OSError:
            return False
        if not mode & stat.S_IXOTH:
            return False
        if d == "/":
            return True
        d = os.path.dirname(d)


def user_python() -> str:
    """An interpreter any user can run, for the applier (the daemon's may live under /root)."""
    for cand in (os.path.realpath(sys.executable), shutil.which("python3", path="/usr/bin:/bin")):
        if cand and _reachable_by_all(cand):
            return cand
    raise OSError("no Python interpreter that other users can run (for the environment handoff)")


@dataclass
class Handoff:
    """The user's cwd and environment on their way past the privileged part of a launch: `argv`
    (the applier, then the command) is what the privileged part execs after the drop."""

    argv: list[str]
    env_fd: int  # memfd: cwd, then NAME=VALUE entries, NUL separated
    err_w: int  # the applier's error pipe (the child's end)
    err_r: int  # the daemon's end, non-blocking

    @classmethod
    def make(cls, argv: list[str], cwd: str, env: dict[str, str]) -> Handoff:
        """Raises OSError (no interpreter, memfd, pipe); nothing is left open then."""
        python = user_python()
        data = b"\0".join([os.fsencode(cwd), *(os.fsencode(f"{k}={v}") for k, v in env.items())])
        fd = os.memfd_create("krex-env", os.MFD_CLOEXEC)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.lseek(fd, 0, os.SEEK_SET)
            r, w = os.pipe()
        except BaseException:
            os.close(fd)
            raise
        os.set_blocking(r, False)
        return cls([python, "-I", "-S", "-c", _APPLY, str(fd), str(w), "--", *argv], fd, w, r)

    def spawned(self) -> None:
        """The child holds its copies now: close ours (not the error pipe's read end)."""
        for fd in (self.env_fd, self.err_w):
            os.close(fd)
        self.env_fd = self.err_w = -1

    def failure(self) -> str:
        """After the leader exited: "cwd", "exec" or "" (it ran). Closes the read end."""
        if self.env_fd >= 0:
            self.spawned()
        if self.err_r < 0:
            return ""
        try:
            data = os.read(self.err_r, 64)
        except OSError:  # EAGAIN: a process of the command still holds the write end
            data = b""
        finally:
            os.close(self.err_r)
            self.err_r = -1
        return data.decode(errors="replace")


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
    pass_fds: tuple[int, ...] = ()  # inherited by the child (a Handoff's fds)


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
            done.set_result(
                ExitStatus(
                    returncode=os.waitstatus_to_exitcode(status),
                    user_s=ru.ru_utime if ru else 0.0,
                    system_s=ru.ru_stime if ru else 0.0,
                )
            )

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
        pass_fds=spec.pass_fds,
    )
    # Popen keeps a handle we never use; forget it so its __del__ does not try to reap our child.
    proc.returncode = 0
    return Launched(pid=proc.pid, _done=watch_pid(loop, proc.pid))
