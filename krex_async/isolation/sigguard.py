"""A guard process that resumes what the signal backend stopped when the daemon dies.

The cgroup backend's watchdog thaws cgroups; the signal backend has only pids to show for what it
stopped, and a SIGSTOPped process stays stopped forever once the daemon that would SIGCONT it is
gone. The guard is a tiny separate process (stdlib only, started with `python -I -S`) that holds a
pidfd on the daemon and is told, over a pipe, which pids are stopped right now::

    daemon                                      guard
    Guard.start() ── spawn, pipe on stdin ──►   pidfd_open(daemon), check it is our parent, "ready"
    guard.stopped(pids) ── "S pid ...\\n" ──►    pidfd_open(pid) for each (the pid cannot be reused
      ... then SIGSTOP them                       under a held pidfd)
    guard.resumed(pids) ── "R pid ...\\n" ──►    close those pidfds
    daemon dies: pidfd readable, or EOF ──►     read what is left in the pipe, SIGCONT every pid
                                                still held, exit
    guard.close() ── "Q\\n", then EOF ──►        the same (nothing should be left), exit 0

The daemon tells the guard *before* it sends SIGSTOP (write-ahead): if it dies in between, the
message is still in the pipe and the guard resumes a process that may not even have stopped, which
is harmless; the other order could leave a process stopped. SIGTERM, SIGINT and SIGHUP to the guard
also resume everything before it exits. If the guard dies, the next `stopped()` or `resumed()`
starts a new one and hands it the current set.

    guard = Guard.start()
    guard.stopped([1234, 1235]); os.kill(1234, SIGSTOP); ...
    guard.resumed([1234, 1235]); os.kill(1234, SIGCONT); ...
    guard.close()
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys

READY = b"ready\n"
_MAX_LINE = 1 << 16


# ------------------------------------------------------------------------------ the daemon's side


class GuardError(Exception):
    """The guard process could not be started or did not become ready in time."""


class Guard:
    """The daemon's handle on its guard process. Not thread-safe: call it from the event loop.

    `stopped()` and `resumed()` are one small blocking write to a pipe the guard drains at once
    (microseconds); they never raise for a dead guard: they start a new one (GuardError only if
    that fails too).
    """

    def __init__(self, proc: subprocess.Popen[bytes], wfd: int, daemon_pid: int) -> None:
        self._proc = proc
        self._wfd = wfd
        self._daemon_pid = daemon_pid
        self._stopped: set[int] = set()
        self._closed = False

    @classmethod
    def start(cls, timeout: float = 5.0) -> Guard:
        """Spawn the guard for this process and wait until it holds its pidfd on us."""
        rfd, wfd = os.pipe()
        try:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", os.path.abspath(__file__), str(os.getpid())],
                stdin=rfd,
                stdout=subprocess.PIPE,
                stderr=None,
                close_fds=True,
                start_new_session=True,
            )  # not in the daemon's process group: its signals miss it
        except OSError as e:
            os.close(wfd)
            raise GuardError(f"cannot start the signal guard: {e}") from None
        finally:
            os.close(rfd)
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], timeout)
        line = proc.stdout.readline() if ready else b""
        proc.stdout.close()
        if line != READY:
            proc.kill()
            proc.wait()
            os.close(wfd)
            raise GuardError(f"the signal guard did not become ready within {timeout} s (said {line!r})")
        return cls(proc, wfd, os.getpid())

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def alive(self) -> bool:
        return not self._closed and self._proc.poll() is None

    @property
    def stopped_pids(self) -> frozenset[int]:
        return frozenset(self._stopped)

    def stopped(self, pids: list[int] | set[int] | frozenset[int]) -> None:
        """Call before SIGSTOPping `pids`: the guard will SIGCONT them if this process dies."""
        new = [p for p in pids if p not in self._stopped]
        if new:
            self._stopped.update(new)
            self._send(b"S", new)

    def resumed(self, pids: list[int] | set[int] | frozenset[int]) -> None:
        """Call when `pids` were resumed (or died): the guard forgets them."""
        gone = [p for p in pids if p in self._stopped]
        if gone:
            self._stopped.difference_update(gone)
            self._send(b"R", gone)

    def close(self, timeout: float = 5.0) -> None:
        """Stop the guard (it resumes anything still on its list first). Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            os.write(self._wfd, b"Q\n")
        except OSError:
            pass
        os.close(self._wfd)
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()

    def _send(self, verb: bytes, pids: list[int]) -> None:
        if self._closed:
            return
        data = b"".join(
            verb + b" " + b" ".join(str(p).encode() for p in pids[i : i + 512]) + b"\n"
            for i in range(0, len(pids), 512)
        )
        try:
            os.write(self._wfd, data)
        except BrokenPipeError:
            self._restart()

    def _restart(self) -> None:
        """The guard died: reap it and hand a new one the current set."""
        os.close(self._wfd)
        self._proc.wait()
        fresh = Guard.start()
        self._proc, self._wfd = fresh._proc, fresh._wfd
        fresh._closed = True  # its handle is ours now
        if self._stopped:
            self._send(b"S", sorted(self._stopped))


# ------------------------------------------------------------------------------ the guard process


class _Held:
    """The stopped pids the guard would resume, each with a pidfd where one could be opened."""

    def __init__(self) -> None:
        self.fds: dict[int, int | None] = {}

    def add(self, pid: int) -> None:
        if pid <= 1 or pid in self.fds:
            return
        try:
            self.fds[pid] = os.pidfd_open(pid)
        except ProcessLookupError:
            return  # already gone: nothing to resume
        except OSError:
            self.fds[pid] = None  # out of fds: fall back to the bare pid

    def drop(self, pid: int) -> None:
        fd = self.fds.pop(pid, None)
        if fd is not None:
            os.close(fd)

    def resume_all(self) -> int:
        n = 0
        for pid, fd in list(self.fds.items()):
            try:
                if fd is not None:
                    signal.pidfd_send_signal(fd, signal.SIGCONT)
                else:
                    os.kill(pid, signal.SIGCONT)
                n += 1
            except OSError:
                pass
            self.drop(pid)
        return n


def _apply(held: _Held, buf: bytearray) -> bool:
    """Apply every complete line in `buf` (consumed); True when a Q line was seen."""
    quit_ = False
    while (nl := buf.find(b"\n")) >= 0:
        line = bytes(buf[:nl]).split()
        del buf[: nl + 1]
        if not line:
            continue
        verb, args = line[0], line[1:]
        if verb == b"Q":
            quit_ = True
            continue
        for a in args:
            if not a.isdigit():
                continue
            (held.add if verb == b"S" else held.drop)(int(a))
    if len(buf) > _MAX_LINE:
        buf.clear()
    return quit_


def _drain(rfd: int, buf: bytearray) -> None:
    os.set_blocking(rfd, False)
    try:
        while data := os.read(rfd, 1 << 16):
            buf += data
    except OSError:  # EAGAIN: nothing more; EBADF etc.: nothing to read
        pass


def guard_main(daemon_pid: int, rfd: int = 0, out: int = 1) -> int:
    """The guard's loop: returns its exit status (0 after Q, 1 after the daemon's death).

    SIGTERM, SIGINT and SIGHUP only note themselves and wake the poll through a wakeup pipe: a
    handler that raised could land between reading a line and recording its pids, and the pids on
    that line would never be resumed.
    """
    told: list[int] = []
    wake_r, wake_w = os.pipe()
    for fd in (wake_r, wake_w):
        os.set_blocking(fd, False)
    signal.set_wakeup_fd(wake_w)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda signum, frame: told.append(signum))
    held = _Held()
    try:
        dfd = os.pidfd_open(daemon_pid)
    except OSError:
        return 1  # it is already gone, and told us nothing
    if os.getppid() != daemon_pid:  # the pid was reused before we could hold it
        return 1
    buf = bytearray()
    quit_ = False
    died = False
    why = f"daemon {daemon_pid} is gone"
    try:  # from here on every way out resumes what is held
        os.write(out, READY)
        os.close(out)
        poller = select.poll()
        for fd in (rfd, dfd, wake_r):
            poller.register(fd, select.POLLIN)
        while not quit_ and not told:
            events = dict(poller.poll())
            if rfd in events:
                data = os.read(rfd, 1 << 16)
                if not data:  # the daemon closed the pipe (or died: the kernel closed it)
                    died = True
                    break
                buf += data
                quit_ = _apply(held, buf)
            elif dfd in events:
                died = True
                break
        if told and not quit_:
            died, why = True, "the guard was told to stop"
    finally:
        if not quit_:  # read what the daemon wrote just before it died (or we were told to stop)
            _drain(rfd, buf)
            _apply(held, buf)
        n = held.resume_all()
        if died and n:
            print(f"krex sigguard: {why}; resumed {n} stopped processes", file=sys.stderr, flush=True)
    return 1 if died else 0


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not argv[0].isdigit():
        print("usage: python -m krex_async.isolation.sigguard DAEMON_PID  (pipe on stdin)", file=sys.stderr)
        return 2
    return guard_main(int(argv[0]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
