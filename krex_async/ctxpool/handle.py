"""The pool's side of its worker processes (worker.py is the process itself). `Worker` is one as the
pool sees it: started, sent a command, heard warm, started or exited, and dead (what waited on it is
settled then); `Workers` is the set of them, with their channel readers, ended at close.

A worker is started with a fresh interpreter (exec, never a fork of a process that holds a context) in
its own session, with stdin/stdout on /dev/null, the daemon's stderr, and one end of a SOCK_SEQPACKET
socketpair (channel.py). Its death is learnt from its pidfd, not from the channel. What each message
means for the pool is upkeep.py's: this module hands them over in order.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from krex_async.ctxpool import channel, forms
from krex_async.ctxpool.base import WORKER_CWD, WORKER_MODULE, PoolConfig
from krex_async.ctxpool.homes import cgroup_homes
from krex_async.ctxpool.procs import home_by_pool
from krex_async.ctxpool.procs import kill as _kill
from krex_async.ctxpool.procs import kill_leftovers as _kill_leftovers
from krex_async.ctxpool.procs import memory as _memory
from krex_async.devices.base import Device
from krex_async.linux.spawn import ExitStatus, Launched, LaunchSpec, watch_pid


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
    homes: dict[str, str | None] | None = None  # its own cgroups' procs files, where the pool moves it
    accepted: asyncio.Future[Launched | str] | None = None  # an adoption's answer: started or why not
    surplus: bool = False  # came back one too many: leaves once not kept (Upkeep._trim: keep_s, resume())
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

    def run(
        self,
        spec: LaunchSpec,
        max_uses: int,
        hooked: bool,
        adopt: dict[str, Any] | None = None,
        fds: list[int] | None = None,
    ) -> Launched:
        """Send it `spec` to run: its fds 0/1/2, or an adopter's pidfd in `fds` and world in `adopt`
        (adopted.py); `hooked`: the pool's cgroup hook puts it in the command's cgroup. It is busy
        from here. Raises OSError when its channel is gone."""
        self.state, self.submit_ts, self.reserved = "busy", time.monotonic(), False
        self.uses += 1
        self.joined = bool(spec.cgroup_procs)
        self.form = (forms.parse(spec.argv) or forms.Form("?", "", [])).kind
        self.done = self.exited if max_uses <= 1 else asyncio.get_running_loop().create_future()
        msg: dict[str, Any] = {
            "t": "run",
            "spec": {
                "argv": spec.argv,
                "cwd": spec.cwd,
                "env": spec.env,
                "cgroup_procs": None if hooked else spec.cgroup_procs,
                "cgroup_hook": hooked,
            },
        }
        if adopt is not None:
            msg["spec"].update(adopt=adopt, orig_argv=adopt.get("orig_argv"))
        channel.send(self.sock, msg, fds or [spec.stdin_fd, spec.stdout_fd, spec.stderr_fd])
        self.launched = Launched(pid=self.pid, _done=self.done, via="pool")
        return self.launched

    def warm(self, msg: dict[str, Any]) -> dict[str, Any] | None:
        """It said "ready": warm, its context made (if asked). Returns what it said of its
        interpreter (flags, options, start-up environment), if it said it."""
        self.state, self.warmed, self.home = "warm", True, bool(msg.get("home", True))
        if self.homes is None and home_by_pool():  # read before any command ran in it
            self.homes = cgroup_homes(self.pid)
        self.ready.set()
        if "hexversion" not in msg:
            return None
        return {k: msg[k] for k in ("hexversion", "flags", "xoptions", "warnoptions", "init_env") if k in msg}

    def started(self, msg: dict[str, Any]) -> float:
        """It said "started": its command runs. Returns the start latency (from the hand-over)."""
        assert self.launched is not None
        self.answer(self.launched)
        lat = max(0.0, msg["ts"] - self.submit_ts)
        self.launched.start_latency_s = lat
        self.rusage0 = (msg.get("user_s", 0.0), msg.get("system_s", 0.0))
        return lat

    def finished(self, msg: dict[str, Any]) -> str:
        """It said "exited" (max_uses > 1): its command's exit status, with the CPU time of the
        command alone. Returns why it retires ("" when it resets for another command; what the
        command left running in it is killed first)."""
        assert self.done is not None
        retire = str(msg.get("retire") or "")
        if not retire and self.launched is not None:
            self.launched.lives_on = True
            _kill_leftovers(self.pid)  # before it can take another command and fork for it
            retire = self._go_home()
        self.done.set_result(
            ExitStatus(
                msg["code"],
                user_s=msg["user_s"] - self.rusage0[0],
                system_s=msg["system_s"] - self.rusage0[1],
            )
        )
        self.launched = None
        if not retire:
            self.state = "starting"  # until its "ready" after the reset
            self.ready.clear()
        return retire

    def _go_home(self) -> str:
        """Back into its own cgroups, moved by the pool (home_by_pool()): the command is over, and
        its reset and health check ran in the command's cgroups. Why not, or ""."""
        for path in (self.homes or {}).values():
            if path is None:
                continue
            try:
                with open(path, "w") as f:
                    f.write(str(self.pid))
            except OSError as e:
                _kill(self.pid)  # it would reset and say "ready"; it is not to serve again
                return f"cannot go back to {path}: {e.strerror}"
        return ""

    def returns(self, max_uses: int, hooked: bool, more: int = 0) -> bool:
        """Whether it comes back to the pool after its command (after `more` commands yet)."""
        joins = hooked or self.joined
        return self.uses + more < max_uses and (self.home or not joins)

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
            WORKER_MODULE,
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
            "--home-by-pool",
            "1" if home_by_pool() else "0",
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


class Workers:
    """A pool's worker processes: each started with its channel read (`on_message`) and its death
    heard (`on_exit`), its pid told to `on_start`, all ended at close. Iterating gives those not yet
    heard dead."""

    def __init__(
        self,
        on_message: Callable[[Worker, dict[str, Any]], None],
        on_exit: Callable[[Worker], None],
        on_start: Callable[[int], None] = lambda pid: None,
    ) -> None:
        self._all: set[Worker] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._on_message, self._on_exit, self._on_start = on_message, on_exit, on_start

    def __iter__(self) -> Iterator[Worker]:
        return iter(self._all)

    def start(
        self,
        python: str,
        env: dict[str, str],
        device: Device,
        config: PoolConfig,
        user: tuple[int, int, list[int]] | None,
    ) -> None:
        """spawn() one more. Raises OSError as spawn() does, with nothing added."""
        w = spawn(python, env, device, config, user)
        self._all.add(w)
        w.exited.add_done_callback(lambda _f: self._on_exit(w))
        self.task(w.read(self._on_message))
        self._on_start(w.pid)

    def task(self, coro: Any) -> None:
        """Run `coro` as a task of the pool's, cancelled at close()."""
        t = asyncio.ensure_future(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    def kept(self, max_uses: int, hooked: bool) -> int:
        """Those that count towards the pool's size: warm, warming, or busy (or reserved by take())
        and coming back: a reused one with uses left that can leave its command's cgroups. One that
        will retire is not waited for: its replacement warms while it runs (or, reserved, while it
        waits to be handed over)."""
        return sum(
            w.returns(max_uses, hooked, 1)
            if w.reserved
            else w.state in ("starting", "warm") or (w.state == "busy" and w.returns(max_uses, hooked))
            for w in self._all
        )

    def warming(self) -> bool:
        return any(w.state == "starting" for w in self._all)

    def describe(self) -> list[dict[str, Any]]:
        """Each one's pid, state and host memory (RSS, PSS from smaps_rollup), by pid."""
        return [
            {"pid": w.pid, "state": w.state, **_memory(w.pid)} for w in sorted(self._all, key=lambda w: w.pid)
        ]

    def discard(self, w: Worker) -> None:
        self._all.discard(w)

    async def close(self, timeout: float) -> None:
        """Every worker gets EOF and the tasks end; the idle and starting ones are waited for, then
        SIGKILLed after `timeout`. Busy ones run their commands on (their Launched still resolves)."""
        idle = [w for w in self._all if w.state != "busy"]
        for w in self._all:
            w.sock.close()
        for t in list(self._tasks):
            t.cancel()
        if idle:
            await asyncio.wait([w.exited for w in idle], timeout=timeout)
        for w in idle:
            if not w.exited.done():
                _kill(w.pid)
        if idle:
            await asyncio.wait([w.exited for w in idle], timeout=timeout)
