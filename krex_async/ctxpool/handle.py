"""The daemon's handle on one warm worker process (worker.py is the process itself): starting it, its
state as the pool sees it, reading its channel, and settling what waits on it when it dies.

A worker is started with a fresh interpreter (exec, never a fork of a process that holds a context) in
its own session, with stdin/stdout on /dev/null, the daemon's stderr, and one end of a SOCK_SEQPACKET
socketpair (channel.py). Its death is learnt from its pidfd, not from the channel. What each message
means for the pool is pool.py's: this module hands them over in order.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from krex_async.ctxpool import channel
from krex_async.ctxpool.base import WORKER_CWD, PoolConfig
from krex_async.devices.base import Device
from krex_async.linux.spawn import ExitStatus, Launched, watch_pid


class BrokenWorker(Exception):
    """A worker could not do what it was started for; the message carries the worker's own words."""


class WorkerStartError(BrokenWorker):
    """Warming failed: an import or the device context raised (traceback attached) or it died."""


@dataclass(eq=False)
class Worker:
    pid: int
    sock: Any
    exited: asyncio.Future[ExitStatus]
    state: str = "starting"  # starting, warm, busy, retired
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    launched: Launched | None = None
    done: asyncio.Future[ExitStatus] | None = None  # the running command's (max_uses > 1)
    submit_ts: float = 0.0
    form: str = ""
    rusage0: tuple[float, float] = (0.0, 0.0)
    error: str = ""
    uses: int = 0
    joined: bool = False  # its command joins a cgroup (spec.cgroup_procs)
    warmed: bool = False  # was warm once: leaving now is retiring, not failing to start
    home: bool = True  # can go back from a command's cgroups (else a command joining one retires it)
    accepted: asyncio.Future[Launched | str] | None = None  # an adoption's answer: started or why not
    surplus: bool = False  # came back surplus while the device was paused: retired at resume()
    reserved: bool = False  # offered to an adopter by take(), not handed over yet
    rx: channel.Receiver = field(default_factory=channel.Receiver)  # its channel's reassembly

    async def read(self, on_message: Callable[[Worker, dict[str, Any]], None]) -> None:
        """Hand each message on the channel to `on_message` until it closes or the worker dies."""
        loop = asyncio.get_running_loop()
        try:
            while True:
                got = self.rx.feed(await loop.sock_recv(self.sock, channel.CHUNK + 1), [])
                if got is not None:
                    on_message(self, got[0])
        except (EOFError, OSError):
            pass  # closed, or the worker died: its pidfd tells the rest

    def answer(self, answer: Launched | str) -> None:
        """Resolve the adoption handed to it: its Launched, or why it did not start the program."""
        if self.accepted is not None and not self.accepted.done():
            self.accepted.set_result(answer)
        self.accepted = None

    def died(self, on_message: Callable[[Worker, dict[str, Any]], None]) -> ExitStatus:
        """Its process is gone: answer what waited on it, close its channel, return its status.

        Its exit and its last message wake the loop together, in either order: a "started" still in
        the socket answered as a death would make the adopter run its program a second time, so
        what it said about an adoption or a command is handed to `on_message` first."""
        status = self.exited.result()
        if self.accepted is not None or self.launched is not None:
            self._last_words(on_message)
        self.answer(f"worker died before it started: returncode {status.returncode}")
        if self.done is not None and self.done is not self.exited and not self.done.done():
            self.done.set_result(status)  # died running a command it would have reported
        if self.launched is not None and self.done is self.exited and self.rusage0 != (0.0, 0.0):
            status.user_s -= self.rusage0[0]
            status.system_s -= self.rusage0[1]
        self.sock.close()
        return status

    def _last_words(self, on_message: Callable[[Worker, dict[str, Any]], None]) -> None:
        """What a dead worker sent that the reader has not read yet, of its answers."""
        while True:
            try:
                packet = self.sock.recv(channel.CHUNK + 1)
                got = self.rx.feed(packet, [])
            except (OSError, EOFError):  # BlockingIOError: nothing left
                return
            if got is not None and got[0].get("t") in ("started", "declined", "failed"):
                on_message(self, got[0])


def spawn(
    python: str,
    env: dict[str, str],
    device: Device,
    config: PoolConfig,
    user: tuple[int, int, list[int]] | None,
) -> Worker:
    """Start a worker of `python` for `device`, as `user` (None: the daemon's). Raises OSError
    when the process or its socketpair cannot be made (nothing is left open then)."""
    loop = asyncio.get_running_loop()
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        # a device env that narrows the GPUs (CUDA_, HIP_, ROCR_VISIBLE_DEVICES) leaves one: 0
        narrowed = any(k.endswith("VISIBLE_DEVICES") for k in device.env)
        ordinal = 0 if narrowed else device.index
        argv = [
            python,
            "-m",
            "krex_async.ctxpool.worker",
            "--fd",
            str(theirs.fileno()),
            "--preload",
            ",".join(config.preload),
            "--vendor",
            device.vendor,
            "--init-modules",
            ",".join(config.init_modules),
            "--ordinal",
            str(ordinal),
            "--init-context",
            "1" if config.init_context else "0",
            "--max-uses",
            str(max(1, config.max_uses)),
            "--lc-ctype-coerced",
            "0" if {"LC_ALL", "LC_CTYPE"} & env.keys() else "1",
        ]
        proc = subprocess.Popen(
            argv,
            cwd=WORKER_CWD,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            pass_fds=[theirs.fileno()],
            start_new_session=True,
            restore_signals=True,
            user=user[0] if user else None,
            group=user[1] if user else None,
            extra_groups=user[2] if user else None,
        )
    except BaseException:
        mine.close()
        raise
    finally:
        theirs.close()
    proc.returncode = 0  # we reap it through its pidfd, not Popen
    mine.setblocking(False)
    return Worker(pid=proc.pid, sock=mine, exited=watch_pid(loop, proc.pid))
