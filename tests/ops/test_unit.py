"""packaging/krex.service: passes `systemd-analyze verify`, says what krex needs of systemd, and
keeps what recovery needs: a daemon killed under the unit's directories is recovered by the next."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from krex_async import Client
from krex_async.daemon.config import load_config

from ..conftest import PY, ROOT, proc_state, stop_all, until
from ..faults.test_daemon_death import tree
from ..faults.test_lost_commands import until_serving

UNIT = ROOT / "packaging" / "krex.service"
GATEWAY_UNIT = ROOT / "packaging" / "krex-gateway.service"
EXAMPLE = ROOT / "packaging" / "krex.toml.example"  # what install-node.sh writes to /etc/krex/krex.toml
# Where systemd puts each kind of unit directory for a system service (systemd.exec(5)).
UNIT_DIRS = {
    "RuntimeDirectory": "/run",
    "StateDirectory": "/var/lib",
    "CacheDirectory": "/var/cache",
    "LogsDirectory": "/var/log",
    "ConfigurationDirectory": "/etc",
}


def directives(unit: Path = UNIT) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in unit.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith(("#", ";", "[")) and "=" in line:
            k, v = line.split("=", 1)
            out.setdefault(k.strip(), []).append(v.strip())
    return out


@pytest.mark.parametrize("source", [UNIT, GATEWAY_UNIT], ids=["daemon", "gateway"])
def test_systemd_analyze_verify(tmp_path, source):
    exe = shutil.which("systemd-analyze")
    if exe is None:
        pytest.skip("systemd-analyze is not installed (apt-get install systemd)")
    # verify checks that ExecStart= programs exist: point them at an executable that does.
    krex = tmp_path / "krex"
    krex.write_text(f"#!{sys.executable}\n")
    krex.chmod(0o755)
    unit = tmp_path / source.name
    unit.write_text(source.read_text().replace("/usr/local/bin/krex", str(krex)))
    p = subprocess.run(
        [exe, "verify", str(unit)],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, SYSTEMD_LOG_LEVEL="notice"),
    )
    # verify returns 0 even for unknown keys and bad values; those show up as lines naming the unit.
    complaints = [ln for ln in (p.stdout + p.stderr).splitlines() if source.name in ln]
    assert p.returncode == 0 and not complaints, p.stdout + p.stderr
    broken = tmp_path / "broken.service"
    broken.write_text(unit.read_text().replace("Restart=on-failure", "Restar=on-failure"))
    p = subprocess.run([exe, "verify", str(broken)], capture_output=True, text=True, timeout=60)
    assert "Unknown key" in p.stdout + p.stderr  # the check above can fail


def test_unit_says_what_krex_needs():
    d = directives()
    assert d["Type"] == ["notify"] and d["NotifyAccess"] == ["main"]
    assert d["WatchdogSec"] and d["Delegate"] == ["yes"] and d["KillMode"] == ["mixed"]
    assert d["RuntimeDirectory"] == ["krex"] and d["StateDirectory"] == ["krex"]
    assert any("cleanup" in v for v in d["ExecStopPost"])
    assert not d["ExecStopPost"][0].startswith("-")  # a failed cleanup must show in the journal
    assert d["ExecStart"][0].split()[1] == "serve"
    for bad in (
        "ProtectControlGroups",
        "PrivateDevices",
        "DevicePolicy",
        "DeviceAllow",
        "ProtectKernelModules",
        "ProtectKernelTunables",
        "PrivateTmp",
        "ProtectClock",
        "MemoryDenyWriteExecute",
    ):
        assert bad not in d, f"{bad} breaks cgroup writes, BPF or GPU access for commands"
    assert d["ProtectSystem"] != ["strict"]


def test_the_gateway_unit_runs_jobs_as_the_installs_job_user_on_the_daemons_socket():
    """What install-node.sh writes (its defaults substituted into the same text): jobs as the
    unprivileged user it creates in the socket group, tokens from a 0600 file (never argv), the
    installed environment's interpreter for jobs, and the socket the installed daemon serves."""
    d = directives(GATEWAY_UNIT)
    argv = d["ExecStart"][0].split()
    opt = {argv[i]: argv[i + 1] for i in range(2, len(argv) - 1) if argv[i].startswith("--")}
    assert argv[:2] == ["/usr/local/bin/krex", "gateway"]
    assert "--token" not in argv and "--no-auth" not in argv
    assert opt["--token-file"] == "/etc/krex/gateway.token" and opt["--job-python"] == "/opt/krex/bin/python"
    assert opt["--socket"] == load_config(str(EXAMPLE), {}, {}).resolved().socket
    assert opt["--state-dir"] == "/var/lib/" + d["StateDirectory"][0]
    script = (ROOT / "scripts/install-node.sh").read_text()
    assert f"JOB_USER={opt['--run-as']} " in script and "GROUP=krex " in script
    assert opt["--listen"].startswith("127.0.0.1:")  # loopback unless the operator says otherwise


class UnitLayout:
    """The unit's directories (RuntimeDirectory=, StateDirectory=, ...) re-rooted under `root`, with
    what systemd does to them at start (create, with their Mode) and at stop (remove the runtime
    ones unless RuntimeDirectoryPreserve=yes; the others stay)."""

    def __init__(self, root: str) -> None:
        d = directives()
        self.root = root
        self.dirs: dict[str, tuple[str, int]] = {}  # path on the node -> (kind, mode)
        for kind, base in UNIT_DIRS.items():
            mode = int((d.get(kind + "Mode") or ["0755"])[-1], 8)
            for v in d.get(kind, []):
                for name in v.split():
                    self.dirs[os.path.join(base, name.split(":")[0])] = (kind, mode)
        self.preserve = (d.get("RuntimeDirectoryPreserve") or ["no"])[-1]

    def map(self, path: str) -> str:
        """`path` on the node, inside this layout; it must lie in one of the unit's directories."""
        for top in self.dirs:
            if path == top or path.startswith(top + "/"):
                return self.root + path
        raise AssertionError(f"{path} is in none of the unit's directories {sorted(self.dirs)}")

    def start(self) -> None:
        for top, (_kind, mode) in self.dirs.items():
            os.makedirs(self.root + top, exist_ok=True)
            os.chmod(self.root + top, mode)

    def stop(self) -> None:
        for top, (kind, _mode) in self.dirs.items():
            if kind == "RuntimeDirectory" and self.preserve != "yes":
                shutil.rmtree(self.root + top, ignore_errors=True)


def unit_daemon(sock: str, state: str, log: Path) -> subprocess.Popen[bytes]:
    """`krex serve --config <the installed config>` at the unit's paths (re-rooted)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("KREX_SOCKET", None)
    argv = [PY, "-m", "krex_async", "serve", "--config", str(EXAMPLE), "--socket", sock]
    argv += ["--state-dir", state, "--isolation", "signal", "--probes", "off", "--log-format", "json"]
    with open(log, "ab") as f:
        return subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env)


@pytest.mark.skipif(os.geteuid() != 0, reason="the unit runs the daemon as root: root's defaults")
async def test_a_daemon_killed_under_the_units_layout_is_recovered_by_the_next() -> None:
    """The unit's ExecStart with the installed config, as root: its socket and state dir are root's
    defaults, which must lie in directories the unit manages. A daemon SIGKILLed while a command
    runs, the leftovers killed and the unit's stop applied (its RuntimeDirectory removed unless
    preserved): the next daemon reports the command `lost` with the output it had spooled. With a
    state dir under /run/krex (the unit before StateDirectory=) the records went with the stop."""
    cfg = load_config(str(EXAMPLE), {}, {}).resolved()
    root = tempfile.mkdtemp(prefix="krexu-", dir="/tmp")
    layout = UnitLayout(root)
    sock, state = layout.map(cfg.socket), layout.map(cfg.state_dir)
    log = Path(root) / "daemon.log"
    procs: list[subprocess.Popen[bytes]] = []
    pids: list[int] = []
    try:
        layout.start()
        procs.append(unit_daemon(sock, state, log))
        await until_serving(procs[0], sock, str(log))
        async with await Client.connect(sock) as c:
            h = await c.submit(["/bin/sh", "-c", "echo first-line; exec sleep 60"], on_disconnect="keep")
            async for _ in h.output():  # the first line is out: the command runs
                break
            cid = h.command
            leader = next(x["pid"] for x in (await c.status())["commands"] if x["command"] == cid)
        pids = tree(leader)
        spool = Path(state, "spool", f"{cid}.stdout")
        await until(lambda: spool.exists() and spool.stat().st_size >= len("first-line\n"), "the spool")
        procs[0].kill()  # SIGKILL: no shutdown path runs
        procs[0].wait()
        for p in pids:  # KillMode=mixed: systemd SIGKILLs what is left in the unit's cgroup
            os.kill(p, signal.SIGKILL)
        await until(lambda: all(proc_state(p) in (None, "Z") for p in pids), "the command's end")
        layout.stop()
        layout.start()  # Restart=: the next start makes the unit's directories again
        procs.append(unit_daemon(sock, state, log))
        await until_serving(procs[1], sock, str(log))
        async with await Client.connect(sock) as c:
            res = await (await c.attach(cid)).wait()
        assert res.report.state == "lost", res.report
        assert res.stdout == b"first-line\n" and Path(res.report.stdout_spool).read_bytes() == b"first-line\n"
    finally:
        stop_all(procs)
        for pid in pids:
            if proc_state(pid) not in (None, "Z"):
                os.kill(pid, signal.SIGKILL)
        await asyncio.to_thread(shutil.rmtree, root, True)
