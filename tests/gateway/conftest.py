"""A real gateway subprocess on 127.0.0.1 (any free port) in front of a real daemon.

The gateway runs with its default trust model: a token generated into <state>/token (the client
reads it). As root, `stack` runs jobs as the test user krextest (--run-as), a member of the daemon's
--socket-group krexg so that regions in its jobs reach the daemon, as a node would be set up. Its
state lives in a fresh /tmp directory that other users may traverse (pytest's tmp_path is private to
root), beside a world-writable `scratch` directory where jobs leave what a test wants to see.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest

from krex_async.gateway.client import GatewayClient
from tests.conftest import run_daemon
from tests.security.helpers import USER_PY, USER_PYTHONPATH, _ensure_group, _ensure_user

PY = sys.executable
JOB_USER, SOCKET_GROUP = "krextest", "krexg"


@pytest.fixture(scope="session", autouse=True)
def _test_users() -> None:
    """As root: the security suite's users (krextest in the socket group krexg runs the jobs)."""
    if os.geteuid() != 0:
        return
    if not shutil.which("useradd"):
        pytest.skip("needs useradd: a gateway started as root runs its jobs as another user")
    _ensure_group(SOCKET_GROUP)
    _ensure_group("krexadm")
    for name, groups in (("krextest", [SOCKET_GROUP]), ("krextest2", [SOCKET_GROUP])):
        _ensure_user(name, groups)


@functools.cache
def job_python() -> str:
    """An interpreter `nobody` can run (this venv's may sit under root's private home)."""
    if os.geteuid() != 0:
        return PY
    try:
        subprocess.run([PY, "-c", ""], user="nobody", check=True, capture_output=True, timeout=30, cwd="/")
        return PY
    except (OSError, subprocess.SubprocessError):
        return USER_PY


@contextlib.contextmanager
def gateway_home() -> Iterator[Path]:
    """A fresh directory for a gateway's state (`gw`) and a `scratch` directory for its jobs."""
    base = Path(tempfile.mkdtemp(prefix="krexgw-", dir="/tmp"))
    base.chmod(0o711)
    (base / "scratch").mkdir(mode=0o777)
    (base / "scratch").chmod(0o1777)
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


class Gateway:
    def __init__(
        self, proc: subprocess.Popen[bytes], state: Path, url: str, log: Path, token: str | None
    ) -> None:
        self.proc, self.state, self.url, self.log, self.token = proc, state, url, log, token
        self.scratch = state.parent / "scratch"

    def client(self) -> GatewayClient:
        return GatewayClient(self.url, token=self.token)

    def logs(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout)


async def stopped_daemon_socket() -> str:
    """The socket path of a daemon started and stopped again: a gateway on it finds no daemon
    (its jobs stay queued) until a test serves there."""
    async with run_daemon() as daemon:
        return daemon.socket


def start_gateway(
    socket: str,
    state: Path,
    *args: str,
    env: dict[str, str] | None = None,
    token: str | None = None,
    listen: str = "127.0.0.1:0",
    launcher: tuple[str, ...] = ("-m", "krex_async.gateway"),
    preexec_fn: Callable[[], None] | None = None,
) -> Gateway:
    """Start `python -m krex_async.gateway` (or `python *launcher`) and wait until its
    gateway.json names its pid. The client uses `token`, else the one the gateway wrote to
    <state>/token."""
    state.parent.mkdir(parents=True, exist_ok=True)
    log = state.parent / f"{state.name}.{time.monotonic_ns()}.log"
    e = dict(os.environ)
    e.pop("KREX_SOCKET", None)
    e.pop("KREX_GATEWAY_TOKEN", None)
    e.update(env or {})  # a test's own KREX_GATEWAY_TOKEN stays
    e["PYTHONPATH"] = os.pathsep.join([USER_PYTHONPATH, e.get("PYTHONPATH", "")])
    if "--job-python" not in args:
        args = (*args, "--job-python", job_python())
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            [
                PY,
                *launcher,
                "--listen",
                listen,
                "--state-dir",
                str(state),
                "--socket",
                socket,
                *args,
            ],
            stdout=f,
            stderr=subprocess.STDOUT,
            env=e,
            preexec_fn=preexec_fn,
        )
    info = state / "gateway.json"
    deadline = time.monotonic() + 20
    while True:
        try:
            meta = json.loads(info.read_text())
            if meta["pid"] == proc.pid:
                if (
                    token is None
                    and not {"--no-auth", "--token-file"} & set(args)
                    and "KREX_GATEWAY_TOKEN" not in e
                ):
                    token = (state / "token").read_text().split()[-1]
                return Gateway(proc, state, meta["url"], log, token)
        except (OSError, ValueError, KeyError):
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"gateway exited {proc.returncode}: {log.read_text()}")
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"gateway did not start: {log.read_text()}")
        time.sleep(0.02)


@pytest.fixture
def gwhome() -> Iterator[Path]:
    """gateway_home() for a test that starts gateways itself: state in `gw`, jobs' `scratch`."""
    with gateway_home() as home:
        yield home


@contextlib.asynccontextmanager
async def stack(
    tmp_path: Path,
    *gateway_args: str,
    daemon_args: tuple[str, ...] = (),
    as_test_user: bool = True,
    **kw: object,
) -> AsyncIterator[tuple[object, Gateway, GatewayClient]]:
    """A daemon, a gateway on it, and a client of the gateway; all stopped after (tmp_path is
    unused: the gateway's state must be reachable by its jobs' user, see gateway_home)."""
    root = os.geteuid() == 0
    if root and "--socket-group" not in daemon_args:
        daemon_args = (*daemon_args, "--socket-group", SOCKET_GROUP)
    if root and as_test_user and "--run-as" not in gateway_args:
        gateway_args = (*gateway_args, "--run-as", JOB_USER)
    async with run_daemon(*daemon_args) as daemon, contextlib.AsyncExitStack() as stack_:
        if root:
            os.chmod(os.path.dirname(daemon.socket), 0o711)  # the job user reaches the socket
        home = stack_.enter_context(gateway_home())
        gw = start_gateway(daemon.socket, home / "gw", *gateway_args, **kw)  # type: ignore[arg-type]
        client = gw.client()
        try:
            yield daemon, gw, client
        finally:
            await client.close()
            try:
                gw.stop()
            except subprocess.TimeoutExpired:
                gw.proc.kill()
                gw.proc.wait()


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
