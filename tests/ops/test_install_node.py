"""The node install route (docs/install.md): scripts/install-node.sh puts krex in its own virtual
environment built from an interpreter every user can run, `krex` on PATH, the units and the config
in place, and a gateway whose jobs run as an unprivileged user in the daemon's socket group. Run
into a temporary tree (the same script, other paths) that other users can enter, with a python3
first on PATH that only root can run (as pyenv's under /root), as root, and checked as other users."""

from __future__ import annotations

import asyncio
import grp
import json
import os
import pwd
import shlex
import shutil
import stat
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from krex_async import Client
from krex_async.gateway.client import GatewayClient

from ..conftest import ROOT, private_cgroup_root, remove_cgroup_tree, until
from ..faults.test_lost_commands import until_serving

pytestmark = pytest.mark.slow
SCRIPT = str(ROOT / "scripts/install-node.sh")
EXAMPLE = ROOT / "packaging/krex.toml.example"


@dataclass
class Install:
    tree: Path  # prefix, bin, units and config under it
    private: Path  # a 0700 directory holding a python3 that only root can run
    env: dict[str, str]  # PATH with that python3 first
    args: list[str]
    job_user: str
    group: str
    proc: subprocess.CompletedProcess[str]


def private_python(d: Path) -> Path:
    """A python3 in a directory only root can enter: a copy of this host's, which finds its standard
    library by its compiled-in prefix, as pyenv's interpreter under a 0700 /root does."""
    real = os.path.realpath(shutil.which("python3", path="/usr/bin:/usr/local/bin") or "/usr/bin/python3")
    (d / "bin").mkdir(parents=True)
    d.chmod(0o700)
    shutil.copy2(real, d / "bin/python3")
    return d / "bin/python3"


def run_install(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([SCRIPT, *args], capture_output=True, text=True, timeout=900, cwd="/", env=env)


def as_user(user: str, *argv: str) -> subprocess.CompletedProcess[str]:
    """argv run as `user` with its groups (runuser: initgroups), from /."""
    return subprocess.run(
        ["runuser", "-u", user, "--", *argv], capture_output=True, text=True, timeout=120, cwd="/"
    )


def _remove_user(name: str, group: str) -> None:
    subprocess.run(["userdel", name], capture_output=True, check=False)
    for g in (name, group):  # useradd --user-group made the first
        subprocess.run(["groupdel", g], capture_output=True, check=False)


@pytest.fixture(scope="module")
def installed() -> Iterator[Install]:
    if os.geteuid() != 0:
        pytest.skip("the node install creates a user and a group, and checks as other users: root")
    for tool in ("runuser", "useradd", "groupadd", "systemd-analyze"):
        if shutil.which(tool) is None:
            pytest.skip(f"no {tool} here")
    tree = Path(tempfile.mkdtemp(prefix="krexi-", dir="/tmp"))
    tree.chmod(0o755)  # other users reach the prefix, as /opt
    py = private_python(tree / "private")
    tag = str(os.getpid())
    job_user, group = f"kxjob{tag}", f"kxsock{tag}"
    args = [
        *("--prefix", str(tree / "opt"), "--bin", str(tree / "bin"), "--unit-dir", str(tree / "units")),
        *("--conf-dir", str(tree / "etc"), "--no-bcc", "--extras", "metrics"),
        *("--job-user", job_user, "--socket-group", group),
    ]
    env = dict(os.environ, PATH=f"{py.parent}:{os.environ.get('PATH', '/usr/bin:/bin')}")
    env.pop("PYTHON", None)
    # What the old script left: an environment made from that python3, which others cannot run.
    subprocess.run([str(py), "-m", "venv", "--without-pip", str(tree / "opt")], check=True, timeout=300)
    try:
        yield Install(tree, tree / "private", env, args, job_user, group, run_install(args, env))
    finally:
        _remove_user(job_user, group)
        shutil.rmtree(tree, ignore_errors=True)


def test_help_prints_the_usage() -> None:
    p = subprocess.run([SCRIPT, "--help"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "install-node.sh [--prefix" in p.stdout and "--python PATH" in p.stdout
    assert "set -euo" not in p.stdout and "#" not in p.stdout.splitlines()[0], p.stdout


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--prefix"], "--prefix needs a value"),
        (["--prefix", "opt/krex"], "--prefix must be an absolute path"),
        (["--job-user", "Bad#name"], "Bad#name is not a user or group name"),
        (["--socket-group", "a&b"], "a&b is not a user or group name"),
        (["--listen", "8000"], "--listen 8000 must be HOST:PORT"),
        (["--bin", "/tmp/a#b"], "unusual characters in path /tmp/a#b"),
        (["--frobnicate"], "unknown argument --frobnicate"),
    ],
)
def test_bad_arguments_are_refused_before_anything_is_done(args: list[str], says: str) -> None:
    p = subprocess.run([SCRIPT, *args], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and says in p.stderr, p.stderr


def test_an_interpreter_other_users_cannot_run_is_refused_by_name(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("a directory root can enter and others cannot: run as root")
    py = private_python(tmp_path / "private")
    prefix = tmp_path / "opt"
    p = run_install(["--python", str(py), "--prefix", str(prefix), "--no-bcc"], dict(os.environ))
    assert p.returncode == 2, p.stderr
    assert f"--python {py} cannot serve every user" in p.stderr and "mode 0700" in p.stderr, p.stderr
    assert "e.g. /usr/bin/python3" in p.stderr and not prefix.exists()


def test_the_installed_krex_runs_for_every_user(installed: Install) -> None:
    """python3 first on PATH lives under a 0700 directory, and an older install made the environment
    from it: the install takes another interpreter every user can run (and says so), rebuilds the
    environment from it, and checks as `nobody` that `krex` runs."""
    p = installed.proc
    assert p.returncode == 0, p.stdout + p.stderr
    assert f"not {installed.private}/bin/python3" in p.stderr and "mode 0700" in p.stderr, p.stderr
    assert f"rebuilding {installed.tree}/opt" in p.stderr, p.stderr  # an older install's environment
    real = os.path.realpath(installed.tree / "opt/bin/python")
    assert not real.startswith(str(installed.private)), real
    v = as_user("nobody", str(installed.tree / "bin/krex"), "--version")
    assert v.returncode == 0 and v.stdout.startswith("krex "), v.stdout + v.stderr


def test_the_install_gives_units_systemd_accepts_and_keeps_a_config(installed: Install) -> None:
    t = installed.tree
    assert installed.proc.returncode == 0, installed.proc.stderr
    unit = (t / "units/krex.service").read_text()
    assert f"ExecStart={t}/bin/krex serve --config {t}/etc/krex.toml" in unit
    want = EXAMPLE.read_text().replace('socket_group = ""', f'socket_group = "{installed.group}"')
    want = want.replace('pool_user = ""', f'pool_user = "{installed.job_user}"')
    assert (t / "etc/krex.toml").read_text() == want
    assert not (t / "opt").joinpath("src").exists()  # the installed copy runs without this checkout
    units = [str(t / "units/krex.service"), str(t / "units/krex-gateway.service")]
    ok = subprocess.run(
        ["systemd-analyze", "verify", *units],
        capture_output=True,
        text=True,
        cwd="/",
        env=dict(os.environ, SYSTEMD_LOG_LEVEL="notice"),
    )
    assert ok.returncode == 0 and ".service" not in ok.stdout + ok.stderr, ok.stdout + ok.stderr
    # again: idempotent, and an edited config and the token are kept
    edited = f'policy = "command"\nsocket_group = "{installed.group}"\n'
    (t / "etc/krex.toml").write_text(edited)
    token = (t / "etc/gateway.token").read_text()
    try:
        again = run_install(installed.args, installed.env)
        assert again.returncode == 0, again.stderr
        assert (t / "etc/krex.toml").read_text() == edited
        assert (t / "etc/gateway.token").read_text() == token
        assert 'pool_user = ""' in again.stderr and "will not serve the gateway's jobs" in again.stderr
        # a kept config whose socket group the jobs' user is not in: refused, with the fix
        (t / "etc/krex.toml").write_text('socket_group = ""\n')
        bad = run_install(installed.args, installed.env)
        assert bad.returncode == 1 and f'set socket_group = "{installed.group}"' in bad.stderr, bad.stderr
    finally:
        (t / "etc/krex.toml").write_text(want)  # the installed one, for the other tests


CONNECT = """
import asyncio, sys
import krex_async.client.region  # what KREX_AUTO_REGION=1 imports in a job
from krex_async import Client

async def main(path):
    async with await Client.connect(path, timeout=10) as c:
        await c.status()
    print("connected")

asyncio.run(main(sys.argv[1]))
"""


def unit_argv(unit: str, **override: str) -> list[str]:
    """The ExecStart= of a unit's text as argv, with `--flag value` pairs replaced (flag=value)."""
    line = next(ln for ln in unit.splitlines() if ln.startswith("ExecStart="))
    argv = shlex.split(line.removeprefix("ExecStart="))
    for flag, value in override.items():
        argv[argv.index("--" + flag.replace("_", "-")) + 1] = value
    return argv


async def gateway_job_enters_a_region(t: Path, sock: str, d: Path) -> dict[str, Any]:
    """The installed gateway unit's command (state, socket and port changed to the test's) starts
    with no warning and its dev job enters a region through the daemon. Returns the job's result."""
    state, log = d / "gw" / "state", d / "gateway.log"
    state.parent.mkdir(mode=0o711)
    argv = unit_argv((t / "units/krex-gateway.service").read_text(), state_dir=str(state), socket=sock)
    argv = [*argv, "--listen", "127.0.0.1:0"]  # a later flag wins: any free port
    with open(log, "wb") as f:
        gw = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, cwd="/")
    try:
        await until(lambda: (state / "gateway.json").exists() or gw.poll() is not None, "the gateway")
        assert gw.poll() is None, log.read_text()
        await until(lambda: "listening on" in log.read_text(), "the gateway's start line")
        assert "WARNING" not in log.read_text(), log.read_text()
        url = json.loads((state / "gateway.json").read_text())["url"]
        token = (t / "etc/gateway.token").read_text().strip()
        async with GatewayClient(url, token=token) as c:
            job = await c.dev("python job.py", files={"job.py": REGION_JOB})
            done = await c.wait(job["job_id"], 120)
        assert done["status"] == "succeeded", done
        assert done["result"]["stdout"].startswith("granted True "), done
        return done["result"]  # type: ignore[no-any-return]
    finally:
        gw.terminate()
        try:
            gw.wait(15)
        except subprocess.TimeoutExpired:
            gw.kill()
            gw.wait()


REGION_JOB = """
import sys
adopted = "colorsys" in sys.modules  # the pool preloads it: only a warm worker has it already
from krex_async import region
with region("job") as r:
    pass
print("granted", r.report is not None, "adopted", adopted)
"""


async def test_the_gateways_jobs_user_runs_krex_and_reaches_the_daemon(installed: Install) -> None:
    """What the gateway unit's jobs get: a user made by the install, in the socket group of the
    installed config, which runs the job interpreter, imports krex's region client with it and
    connects to a daemon started with that config; a user outside the group cannot. The gateway
    started as its unit says starts with no warning, and a job of it enters a region."""
    t, job = installed.tree, installed.job_user
    assert installed.proc.returncode == 0, installed.proc.stderr
    pw = pwd.getpwnam(job)
    assert pw.pw_uid != 0 and installed.group in [g.gr_name for g in grp.getgrall() if job in g.gr_mem]
    gw = (t / "units/krex-gateway.service").read_text()
    want = (
        f"--token-file {t}/etc/gateway.token --run-as {job} --job-python {t}/opt/bin/python",
        "--socket /run/krex/krex.sock",
    )
    assert all(w in gw for w in want), gw
    st = (t / "etc/gateway.token").lstat()
    assert stat.S_ISREG(st.st_mode) and st.st_uid == 0 and stat.S_IMODE(st.st_mode) == 0o600
    assert len((t / "etc/gateway.token").read_text().strip()) >= 32
    d = Path(tempfile.mkdtemp(prefix="krexj-", dir="/tmp"))
    d.chmod(0o755)
    sock, log = str(d / "krex.sock"), d / "daemon.log"
    argv = [str(t / "bin/krex"), "serve", "--config", str(t / "etc/krex.toml"), "--socket", sock]
    argv += ["--state-dir", str(d / "state"), "--probes", "off"]
    cg = private_cgroup_root()  # the warm pool adopts through the cgroup backend
    pool = ["--isolation", "cgroup", "--pool-size", "1", "--pool-preload", "colorsys"]
    argv += [*pool, "--cgroup-root", cg] if cg else ["--isolation", "signal"]
    with open(log, "wb") as f:
        daemon = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, cwd="/")
    try:
        await until_serving(daemon, sock, str(log))
        got = as_user(job, str(t / "opt/bin/python"), "-c", CONNECT, sock)
        assert got.returncode == 0 and got.stdout.strip() == "connected", got.stdout + got.stderr
        out = as_user("nobody", str(t / "opt/bin/python"), "-c", CONNECT, sock)
        assert out.returncode != 0 and "connected" not in out.stdout  # the group decides
        if cg:
            await until_warm(sock)
        result = await gateway_job_enters_a_region(t, sock, d)
        if cg:  # the installed config's pool_user is the gateway's --run-as: its pool serves the jobs
            assert result["stdout"] == "granted True adopted True\n", result
            assert result["krex"]["pool_adopted"] == 1, result
    finally:
        daemon.terminate()
        try:
            daemon.wait(15)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()
        shutil.rmtree(d, ignore_errors=True)
        if cg:
            remove_cgroup_tree(cg)


async def until_warm(sock: str) -> None:
    """Until the daemon's pool has a warm worker (started as the installed config's pool_user)."""

    async def warm() -> bool:
        async with await Client.connect(sock) as c:
            return any(p["warm"] >= 1 for p in (await c.status())["pools"].values())

    deadline = time.monotonic() + 60
    while not await warm():
        assert time.monotonic() < deadline, "the pool did not warm a worker as the job user"
        await asyncio.sleep(0.05)


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze here")
@pytest.mark.skipif(os.path.exists("/usr/local/bin/krex"), reason="krex is installed on this host")
def test_the_unit_fails_verification_where_nothing_installed_krex() -> None:
    """What the install route fixes: the unit alone names a binary nothing created."""
    p = subprocess.run(
        ["systemd-analyze", "verify", str(ROOT / "packaging/krex.service")],
        capture_output=True,
        text=True,
        cwd="/",
    )
    assert p.returncode != 0 and "/usr/local/bin/krex" in p.stderr
