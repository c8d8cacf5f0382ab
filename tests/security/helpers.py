"""Helpers for the security and fault suites (tests/faults imports them too): a daemon started from
a full ServeConfig (for options the command line does not expose), other users to connect as, and
raw-socket framing."""

from __future__ import annotations

import contextlib
import grp
import json
import os
import pwd
import shutil
import signal
import socket
import struct
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from krex_async import protocol as P

from ..conftest import PY, ROOT, Daemon, serving

# Other users cannot reach this interpreter (it lives under root's private home): they run the
# system's python of the same minor version, with this venv's packages on their path.
USER_PY = shutil.which("python3", path="/usr/bin:/bin") or "/usr/bin/python3"
USER_PYTHONPATH = os.pathsep.join([str(ROOT), sysconfig.get_paths()["purelib"]])

LAUNCH = (
    "import sys, msgspec; from krex_async.daemon import server, config; "
    "sys.exit(server.run(msgspec.json.decode(sys.argv[1], type=config.ServeConfig)))"
)


@contextlib.asynccontextmanager
async def config_daemon(
    dir_mode: int = 0o700, launch: str = LAUNCH, launch_args: Sequence[str] = (), **cfg: object
) -> AsyncIterator[Daemon]:
    """A real daemon subprocess run from `ServeConfig(**cfg)` on a fresh short socket path.

    The socket's directory gets `dir_mode` (0755 lets other users reach the socket, whose own mode
    then decides). The daemon is stopped with SIGTERM (SIGKILL after 15 s) and the directory removed.
    `launch`: the daemon's `python -c` program (given the config's JSON, then `launch_args`).
    """
    d = tempfile.mkdtemp(prefix="krexs-", dir="/tmp")
    os.chmod(d, dir_mode)
    sock = str(cfg.get("socket") or os.path.join(d, "s"))
    log = Path(d) / "daemon.log"
    full = {
        "socket": sock,
        "state_dir": os.path.join(d, "state"),
        "log_format": "json",
        "isolation": "signal",
        **{**cfg, "socket": sock},
    }
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("KREX_SOCKET", None)
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            [PY, "-c", launch, json.dumps(full), *launch_args], stdout=f, stderr=subprocess.STDOUT, env=env
        )
    try:
        with serving(Daemon(sock, proc, log)) as daemon:
            yield daemon
    finally:
        shutil.rmtree(d, ignore_errors=True)


@dataclass
class User:
    name: str
    uid: int
    gid: int
    groups: list[int]

    def run_py(self, code: str, *args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
        """Run Python `code` as this user (uid, gid and supplementary groups), package importable."""
        return subprocess.run(
            [USER_PY, "-c", code, *args],
            user=self.uid,
            group=self.gid,
            extra_groups=self.groups,
            env=user_env(),
            cwd="/tmp",
            capture_output=True,
            text=True,
            timeout=timeout,
        )


def user_env() -> dict[str, str]:
    """The environment for processes run as a test user (and for commands they submit)."""
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "PYTHONPATH": USER_PYTHONPATH,
        "HOME": "/tmp",
        "LANG": "C.UTF-8",
    }


def run_python_as(
    user: User,
    code: str,
    *args: str,
    input: str | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 60,
) -> subprocess.CompletedProcess[str]:
    """Run `code` (python -c) as `user` with the test users' environment (and `env`), from /tmp;
    `timeout`: a bound for a program that hangs, not a measure."""
    return subprocess.run(
        [USER_PY, "-c", code, *args],
        user=user.uid,
        group=user.gid,
        extra_groups=user.groups,
        env={**user_env(), **(env or {})},
        cwd="/tmp",
        capture_output=True,
        text=True,
        timeout=timeout,
        input=input,
    )


def python_as(user: User, code: str, *args: str, input: str | None = None) -> str:
    """run_python_as's stdout; fails the test, with the program's stderr, when it exits non-zero."""
    p = run_python_as(user, code, *args, input=input)
    assert p.returncode == 0, p.stderr
    return p.stdout


def _ensure_group(name: str) -> int:
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        subprocess.run(["groupadd", name], check=True)
        return grp.getgrnam(name).gr_gid


def _ensure_user(name: str, groups: list[str]) -> User:
    try:
        pw = pwd.getpwnam(name)
    except KeyError:
        subprocess.run(["useradd", "-M", "-s", "/usr/sbin/nologin", name], check=True)
        pw = pwd.getpwnam(name)
    if groups:
        subprocess.run(["usermod", "-a", "-G", ",".join(groups), name], check=True)
    gids = os.getgrouplist(name, pw.pw_gid)
    return User(name, pw.pw_uid, pw.pw_gid, [g for g in gids if g != pw.pw_gid])


def make_users() -> Iterator[dict[str, User]]:
    """Unprivileged test users (created once, root only): `alice` and `mallory` are in the socket
    group krexg, `admin` in krexg and the admin group krexadm, `outsider` in neither."""
    if os.geteuid() != 0:
        pytest.skip("needs root to create test users and run clients as them")
    probe = subprocess.run(
        [USER_PY, "-c", "import sys; print(sys.version_info[:2])"], capture_output=True, text=True
    )
    if probe.stdout.strip() != str(sys.version_info[:2]):
        pytest.skip(f"{USER_PY} is not Python {sys.version_info[:2]}: test users cannot run the client")
    if not shutil.which("useradd"):
        pytest.skip("useradd is not installed")
    _ensure_group("krexg")
    _ensure_group("krexadm")
    yield {
        "alice": _ensure_user("krextest", ["krexg"]),
        "mallory": _ensure_user("krextest2", ["krexg"]),
        "admin": _ensure_user("krextest3", ["krexg", "krexadm"]),
        "outsider": _ensure_user("krextest4", []),
    }


def raw(path: str, timeout: float = 5) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    s.connect(path)
    return s


def recv(s: socket.socket) -> P.Reply | None:
    """The next reply, or None when the daemon closed the connection."""
    head = b""
    while len(head) < 4:
        try:
            chunk = s.recv(4 - len(head))
        except ConnectionResetError:
            return None
        if not chunk:
            return None
        head += chunk
    (n,) = struct.unpack(">I", head)
    body = bytearray()
    while len(body) < n:
        chunk = s.recv(n - len(body))
        if not chunk:
            return None
        body += chunk
    return P.decode_reply(bytes(body))


def hello(s: socket.socket) -> P.Welcome:
    s.sendall(P.encode(P.Hello(id=1)))
    w = recv(s)
    assert isinstance(w, P.Welcome), w
    return w


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for {pid}")


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def kill_quietly(pid: int, sig: int = signal.SIGKILL) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)
