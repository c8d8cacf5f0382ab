"""A real gateway subprocess on 127.0.0.1 (any free port) in front of a real daemon."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

from krex_async.gateway.client import GatewayClient
from tests.conftest import ROOT, run_daemon

PY = sys.executable


class Gateway:
    def __init__(self, proc: subprocess.Popen[bytes], state: Path, url: str, log: Path,
                 token: str | None) -> None:
        self.proc, self.state, self.url, self.log, self.token = proc, state, url, log, token

    def client(self) -> GatewayClient:
        return GatewayClient(self.url, token=self.token)

    def logs(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout)


def start_gateway(socket: str, state: Path, *args: str, env: dict[str, str] | None = None,
                  token: str | None = None, listen: str = "127.0.0.1:0") -> Gateway:
    """Start `python -m krex_async.gateway` and wait until its gateway.json names its pid."""
    state.mkdir(parents=True, exist_ok=True)
    log = state.parent / f"{state.name}.{time.monotonic_ns()}.log"
    e = dict(os.environ, **(env or {}))
    e.pop("KREX_SOCKET", None)
    e.pop("KREX_GATEWAY_TOKEN", None)
    e["PYTHONPATH"] = str(ROOT) + os.pathsep + e.get("PYTHONPATH", "")
    with open(log, "wb") as f:
        proc = subprocess.Popen([PY, "-m", "krex_async.gateway", "--listen", listen,
                                 "--state-dir", str(state), "--socket", socket, *args],
                                stdout=f, stderr=subprocess.STDOUT, env=e)
    info = state / "gateway.json"
    deadline = time.monotonic() + 20
    while True:
        try:
            meta = json.loads(info.read_text())
            if meta["pid"] == proc.pid:
                return Gateway(proc, state, meta["url"], log, token)
        except (OSError, ValueError, KeyError):
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"gateway exited {proc.returncode}: {log.read_text()}")
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"gateway did not start: {log.read_text()}")
        time.sleep(0.02)


@contextlib.asynccontextmanager
async def stack(tmp_path: Path, *gateway_args: str, daemon_args: tuple[str, ...] = (),
                **kw: object) -> AsyncIterator[tuple[object, Gateway, GatewayClient]]:
    """A daemon, a gateway on it, and a client of the gateway; all stopped after."""
    async with run_daemon(*daemon_args) as daemon:
        gw = start_gateway(daemon.socket, tmp_path / "gw", *gateway_args, **kw)  # type: ignore[arg-type]
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
