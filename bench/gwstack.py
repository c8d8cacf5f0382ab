"""A daemon and a krex gateway in front of it, set up as a node runs them (bench/gateway_jobs.py and
bench/gateway_profile_check.py use it).

As root, jobs run as the user `krexbench` (created if missing, with its own group, which is the
daemon's --socket-group, so regions in jobs reach the daemon), never as root; the stack's directory
is one that user can pass through; clients use the token the gateway wrote to <state>/token.
Elsewhere jobs run as the caller (the gateway cannot switch users).
"""

from __future__ import annotations

import grp
import json
import os
import pwd
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from krex_async.gateway.client import GatewayClient  # noqa: E402

JOB_USER = "krexbench"


def ensure_job_user(name: str = JOB_USER) -> str | None:
    """The jobs' user (created as a system user with its own group), or None when not root."""
    if os.geteuid() != 0:
        return None
    try:
        pwd.getpwnam(name)
    except KeyError:
        subprocess.run(["useradd", "--system", "--user-group", "--no-create-home", "--shell",
                        "/usr/sbin/nologin", name], check=True)
    grp.getgrnam(name)
    return name


def job_python(user: str | None) -> str:
    """This interpreter if the jobs' user can run it, else the system's python3 (a venv under
    root's private home is out of that user's reach); said on stderr when it falls back."""
    if user is None:
        return sys.executable
    try:
        subprocess.run([sys.executable, "-c", ""], user=user, check=True, capture_output=True,
                       timeout=60, cwd="/")
        return sys.executable
    except (OSError, subprocess.SubprocessError):
        other = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin") or "/usr/bin/python3"
        print(f"gwstack: {user} cannot run {sys.executable}; jobs use {other}", file=sys.stderr)
        return other


class Stack:
    """A daemon (one policy) and a gateway on it, in a fresh directory under `tmp`; `stop()` ends
    both. `gateway_args` and `env` go to the gateway (env adds to this process's environment)."""

    def __init__(self, tmp: Path, policy: str, devices: str, max_running: int,
                 gateway_args: tuple[str, ...] = (), env: dict[str, str] | None = None) -> None:
        user = ensure_job_user()
        # The jobs inherit it: this package, and this interpreter's packages (msgspec for regions).
        path = [str(ROOT), sysconfig.get_paths()["purelib"], os.environ.get("PYTHONPATH", "")]
        base = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in path if p))
        base.pop("KREX_SOCKET", None)
        self.dir = Path(tempfile.mkdtemp(prefix=f"gwb-{policy}-", dir=tmp))
        for d in (tmp, self.dir):
            d.chmod(0o711)  # the jobs' user passes through to its job directories and the socket
        sock = str(self.dir / "s")
        daemon_args = ["--socket-group", user] if user else []
        self.daemon = subprocess.Popen(
            [sys.executable, "-m", "krex_async", "serve", "--socket", sock, "--policy", policy,
             "--devices", devices, "--log-level", "warning", "--state-dir", str(self.dir / "d"),
             *daemon_args],
            stdout=open(self.dir / "daemon.log", "wb"), stderr=subprocess.STDOUT, env=base)
        while not os.path.exists(sock):
            if self.daemon.poll() is not None:
                raise SystemExit((self.dir / "daemon.log").read_text())
            time.sleep(0.02)
        run_as = ["--run-as", user, "--job-python", job_python(user)] if user else []
        self.gateway = subprocess.Popen(
            [sys.executable, "-m", "krex_async.gateway", "--listen", "127.0.0.1:0", "--state-dir",
             str(self.dir / "gw"), "--socket", sock, "--max-running", str(max_running), *run_as,
             *gateway_args],
            stdout=open(self.dir / "gateway.log", "wb"), stderr=subprocess.STDOUT,
            env={**base, **(env or {})})
        info = self.dir / "gw" / "gateway.json"
        while not info.exists():
            if self.gateway.poll() is not None:
                raise SystemExit((self.dir / "gateway.log").read_text())
            time.sleep(0.02)
        time.sleep(0.05)
        self.url = json.loads(info.read_text())["url"]
        self.token = (self.dir / "gw" / "token").read_text().split()[-1]

    def client(self) -> GatewayClient:
        return GatewayClient(self.url, self.token)

    def log(self) -> str:
        return (self.dir / "gateway.log").read_text(errors="replace")

    def stop(self) -> None:
        for p in (self.gateway, self.daemon):
            p.terminate()
            p.wait(30)
