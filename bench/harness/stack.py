"""A `krex serve` (and a `krex gateway` over it) as a benchmark's subprocesses, and the environment
and argv of the child programs they run.

Each daemon gets a private temporary directory: its socket and its state dir, so a daemon's start-up
sweep never touches another daemon's state. Start and stop are available both ways: `with` /
start()/stop() for scripts, `async with` for asyncio benchmarks. A stop sends SIGTERM, then SIGKILL
to the process group after `grace` s, and removes the directory; a daemon or gateway still running
when the interpreter exits is stopped by an atexit hook, so an exception or Ctrl-C anywhere in a
benchmark leaves no daemon behind.

As root, gateway jobs run as the user `krexbench` (created if missing, with its own group, which
becomes the daemon's --socket-group, so regions in jobs reach the daemon), never as root; the
directories on the way are made passable for that user. Elsewhere jobs run as the caller.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import grp
import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parents[2]
JOB_USER = "krexbench"

_LIVE: set[_Proc] = set()


def bench_env(extra_path: Sequence[str] = (), **set_vars: str) -> dict[str, str]:
    """This environment for a child: the repository first on PYTHONPATH (then `extra_path`, then
    the inherited one), no KREX_SOCKET (a child under a benchmark's daemon gets its own), plus
    `set_vars`."""
    env = dict(os.environ)
    env.pop("KREX_SOCKET", None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), *extra_path, os.environ.get("PYTHONPATH")]))
    env.update(set_vars)
    return env


def module_argv(module: str, *args: str, python: str = sys.executable) -> list[str]:
    """`python -m MODULE ARGS`: how benchmarks start their child programs (bench.workload.*,
    bench.gpu.*), run with the repository as cwd or on PYTHONPATH (bench_env)."""
    return [python, "-m", module, *args]


def ensure_job_user(name: str = JOB_USER) -> str | None:
    """The gateway jobs' user (created as a system user with its own group), or None when not root."""
    if os.geteuid() != 0:
        return None
    try:
        pwd.getpwnam(name)
    except KeyError:
        subprocess.run(
            ["useradd", "--system", "--user-group", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
            check=True,
        )
    grp.getgrnam(name)
    return name


def job_python(user: str | None, python: str = sys.executable) -> str:
    """`python` if the jobs' user can run it, else the system's python3 (a venv under root's private
    home is out of that user's reach); said on stderr when it falls back."""
    if user is None:
        return python
    try:
        subprocess.run([python, "-c", ""], user=user, check=True, capture_output=True, timeout=60, cwd="/")
        return python
    except (OSError, subprocess.SubprocessError):
        other = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin") or "/usr/bin/python3"
        print(f"harness: {user} cannot run {python}; jobs use {other}", file=sys.stderr)
        return other


def gateway_token(state: Path, explicit: str | None = None) -> str | None:
    """The bearer token to send: `explicit`, $KREX_GATEWAY_TOKEN, a "token" in the gateway's
    gateway.json, or the first file named *token* in its state dir."""
    if explicit:
        return explicit
    if os.environ.get("KREX_GATEWAY_TOKEN"):
        return os.environ["KREX_GATEWAY_TOKEN"]
    try:
        info = json.loads((state / "gateway.json").read_text())
        if info.get("token"):
            return str(info["token"])
    except (OSError, ValueError):
        pass
    for p in sorted(state.glob("*token*")):
        if p.is_file():
            return p.read_text().strip() or None
    return None


class _Proc:
    """A subprocess with a log file, stopped by SIGTERM and then SIGKILL to its process group."""

    proc: subprocess.Popen[bytes] | None = None
    name = "process"

    def __init__(self, log: Path, grace: float) -> None:
        self.log, self.grace = log, grace
        self._logf: IO[bytes] | None = None

    def _spawn(self, argv: list[str], env: dict[str, str], cwd: Path, log_mode: str = "wb") -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self._logf = open(self.log, log_mode)
        self.proc = subprocess.Popen(
            argv, stdout=self._logf, stderr=subprocess.STDOUT, env=env, cwd=str(cwd), start_new_session=True
        )
        _LIVE.add(self)

    def tail(self, n: int = 2000) -> str:
        with contextlib.suppress(OSError):
            return self.log.read_bytes()[-n:].decode("utf-8", "replace")
        return ""

    def stop(self) -> None:
        self._terminate()

    def exited(self) -> bool:
        return self.proc is not None and self.proc.poll() is not None

    def _terminate(self) -> None:
        p = self.proc
        if p is not None and p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
            try:
                p.wait(self.grace)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        if self._logf is not None:
            self._logf.close()
            self._logf = None
        _LIVE.discard(self)


class Daemon(_Proc):
    """`krex serve --socket DIR/s --state-dir DIR/state [--policy P] ARGS` in a fresh directory
    under `parent`. Ready when its socket accepts a connection (`ready_s` at most, else RuntimeError
    with the log's tail). The log goes to `log` (default DIR/daemon.log; DIR is removed at stop
    unless `keep`)."""

    name = "daemon"

    def __init__(
        self,
        args: Sequence[str] = (),
        *,
        policy: str | None = None,
        python: str = sys.executable,
        log: Path | None = None,
        parent: str | Path = "/tmp",
        prefix: str = "krex-bench-",
        env: dict[str, str] | None = None,
        ready_s: float = 30.0,
        grace: float = 15.0,
        keep: bool = False,
        log_mode: str = "wb",
    ) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix=prefix, dir=str(parent)))
        self.socket = str(self.dir / "s")
        self.state_dir = self.dir / "state"
        super().__init__(log or self.dir / "daemon.log", grace)
        self.argv = [
            python,
            "-m",
            "krex_async",
            "serve",
            "--socket",
            self.socket,
            *(["--policy", policy] if policy else []),
            "--state-dir",
            str(self.state_dir),
            *args,
        ]
        self.env = env if env is not None else bench_env()
        self.ready_s, self.keep, self.log_mode = ready_s, keep, log_mode

    def _accepts(self) -> bool:
        with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX) as s:
            s.connect(self.socket)
            return True
        return False

    def _check(self, deadline: float) -> None:
        if self.exited():
            rc = self.proc.returncode if self.proc else None
            why = f"daemon exited with {rc}: {self.tail()}"  # read before stop() removes the log
        elif time.monotonic() > deadline:
            why = f"daemon socket {self.socket} not up in {self.ready_s}s: {self.tail()}"
        else:
            return
        self.stop()
        raise RuntimeError(why)

    def start(self) -> Daemon:
        """Start it and wait until its socket accepts. Raises RuntimeError (stopped) otherwise."""
        self._spawn(self.argv, self.env, ROOT, self.log_mode)
        deadline = time.monotonic() + self.ready_s
        while not self._accepts():
            self._check(deadline)
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self._terminate()
        if not self.keep:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> Daemon:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def __aenter__(self) -> Daemon:
        self._spawn(self.argv, self.env, ROOT, self.log_mode)
        deadline = time.monotonic() + self.ready_s
        while not await asyncio.to_thread(self._accepts):
            self._check(deadline)
            await asyncio.sleep(0.05)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.to_thread(self.stop)


class Gateway(_Proc):
    """`krex gateway --listen 127.0.0.1:0 --socket DAEMON --max-running N ARGS` with its state in
    DIR/gw (DIR fresh under `parent`, removed at stop: the jobs' files; the log is `log`). Ready
    when it has written gateway.json; `url` and `token` are then set. `user` (ensure_job_user()):
    jobs run as that user with an interpreter it can run."""

    name = "gateway"

    def __init__(
        self,
        daemon: Daemon,
        max_running: int,
        *,
        args: Sequence[str] = (),
        python: str = sys.executable,
        log: Path | None = None,
        user: str | None = None,
        token: str | None = None,
        env: dict[str, str] | None = None,
        parent: str | Path = "/tmp",
        prefix: str = "krex-gw-",
        ready_s: float = 60.0,
        grace: float = 20.0,
    ) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix=prefix, dir=str(parent)))
        if user:
            for d in {Path(parent), self.dir, daemon.dir} - {Path("/tmp")}:
                d.chmod(0o711)  # the jobs' user passes through to its job directory and the socket
        self.state = self.dir / "gw"
        super().__init__(log or self.dir / "gateway.log", grace)
        run_as = ["--run-as", user, "--job-python", job_python(user, python)] if user else []
        self.argv = [
            python,
            "-m",
            "krex_async",
            "gateway",
            "--listen",
            "127.0.0.1:0",
            "--state-dir",
            str(self.state),
            "--socket",
            daemon.socket,
            "--max-running",
            str(max_running),
            *run_as,
            *args,
        ]
        # The jobs inherit it: this package and this interpreter's packages (msgspec for regions).
        self.env = {**bench_env([sysconfig.get_paths()["purelib"]]), **(env or {})}
        self.ready_s, self.explicit_token = ready_s, token
        self.url = ""
        self.token: str | None = None

    def _ready(self) -> bool:
        if (self.state / "gateway.json").exists():
            return True
        if self.exited() or time.monotonic() > self._deadline:
            why = "gateway did not start: " + self.tail()  # read before stop() removes the log
            self.stop()
            raise RuntimeError(why)
        return False

    def _read_info(self) -> None:
        self.url = json.loads((self.state / "gateway.json").read_text())["url"]
        self.token = gateway_token(self.state, self.explicit_token)

    def start(self) -> Gateway:
        self._spawn(self.argv, self.env, ROOT)
        self._deadline = time.monotonic() + self.ready_s
        while not self._ready():
            time.sleep(0.02)
        time.sleep(0.05)
        self._read_info()
        return self

    def stop(self) -> None:
        self._terminate()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> Gateway:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def __aenter__(self) -> Gateway:
        self._spawn(self.argv, self.env, ROOT)
        self._deadline = time.monotonic() + self.ready_s
        while not self._ready():
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.05)
        self._read_info()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.to_thread(self.stop)

    def client(self, **kw: Any) -> Any:
        """A krex_async.gateway.client.GatewayClient for this gateway."""
        from krex_async.gateway.client import GatewayClient

        return GatewayClient(self.url, self.token, **kw)


class Stack:
    """A daemon and a gateway over it, as a node runs them: as root the daemon's --socket-group
    (and, with a pool, --pool-user) is the jobs' user. Their directories are PREFIX-NAME-* under
    `parent`; logs go to `logdir` as daemon-NAME.log and gateway-NAME.log (else inside those
    directories). `with`/`async with` start both and stop the gateway, then the daemon, on every
    path."""

    def __init__(
        self,
        daemon_args: Sequence[str],
        max_running: int,
        *,
        policy: str | None = None,
        gateway_args: Sequence[str] = (),
        python: str = sys.executable,
        logdir: Path | None = None,
        name: str = "stack",
        gateway_env: dict[str, str] | None = None,
        token: str | None = None,
        parent: str | Path = "/tmp",
        prefix: str = "krex-",
    ) -> None:
        self.user = ensure_job_user()
        group = ["--socket-group", self.user] if self.user else []
        if self.user and any(x.startswith("--pool-size") for x in daemon_args):
            group += ["--pool-user", self.user]  # a pool serves its own user's jobs only
        dlog = logdir / f"daemon-{name}.log" if logdir else None
        glog = logdir / f"gateway-{name}.log" if logdir else None
        self.daemon = Daemon(
            [*daemon_args, *group],
            policy=policy,
            python=python,
            log=dlog,
            parent=parent,
            prefix=f"{prefix}{name}-",
        )
        self.gateway = Gateway(
            self.daemon,
            max_running,
            args=gateway_args,
            python=python,
            log=glog,
            user=self.user,
            token=token,
            env=gateway_env,
            parent=parent,
            prefix=f"{prefix}{name}-gw-",
        )

    @property
    def url(self) -> str:
        return self.gateway.url

    @property
    def token(self) -> str | None:
        return self.gateway.token

    def client(self, **kw: Any) -> Any:
        return self.gateway.client(**kw)

    def start(self) -> Stack:
        try:
            self.daemon.start()
            self.gateway.start()
        except BaseException:
            self.stop()  # the gateway's directory exists from its construction on
            raise
        return self

    def stop(self) -> None:
        try:
            self.gateway.stop()
        finally:
            self.daemon.stop()

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def __aenter__(self) -> Stack:
        try:
            await self.daemon.__aenter__()
            await self.gateway.__aenter__()
        except BaseException:
            await self.__aexit__()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        try:
            await self.gateway.__aexit__()
        finally:
            await self.daemon.__aexit__()


@atexit.register
def _stop_leftovers() -> None:
    """Whatever a benchmark left running when the interpreter exits (an exception past its `with`,
    a sys.exit in a check) is stopped and its directory removed, gateways first."""
    for p in sorted(_LIVE, key=lambda p: p.name != "gateway"):
        with contextlib.suppress(Exception):
            p.stop()
