"""A reused warm worker of an unprivileged --pool-user, under the cgroup backend of a root daemon.

The worker joins each command's cgroups (the daemon moves it there). It cannot leave them by itself:
their common ancestor's cgroup.procs is root's. So the daemon moves it back once the command is over
(ctxpool/procs.py home_by_pool). Before, every such worker retired after its first command, and
--pool-max-uses bought nothing for a gateway's --run-as user.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from tests.conftest import private_cgroup_root, run_daemon
from tests.ctxpool.test_adopt import MARK, warm, write
from tests.security.helpers import USER_PY, USER_PYTHONPATH

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: a daemon that runs workers as nobody")


def _nobody_runs(env: dict[str, str]) -> bool:
    try:
        subprocess.run(
            [USER_PY, "-c", "import msgspec, krex_async"],
            user="nobody",
            env=env,
            check=True,
            capture_output=True,
            timeout=60,
            cwd="/",
        )
        return True
    except (OSError, subprocess.SubprocessError):
        return False


def _cgroups(pid: int) -> str:
    return Path(f"/proc/{pid}/cgroup").read_text()


async def test_a_reused_worker_of_another_user_comes_back_for_the_next_command() -> None:
    """--pool-user nobody --pool-max-uses 3: two commands of nobody's run in one worker, each in
    its command's cgroups, and between them the worker is back in its own, warm, not retired."""
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": USER_PYTHONPATH, "LANG": "C.UTF-8"}
    if private_cgroup_root() is None:
        pytest.skip("no cgroup v2 tree of our own here: the cgroup backend cannot run")
    if not _nobody_runs(env):
        pytest.skip(f"nobody cannot import krex with {USER_PY} and PYTHONPATH={USER_PYTHONPATH}")
    nobody = pwd.getpwnam("nobody").pw_uid
    d = Path(tempfile.mkdtemp(prefix="krex-reuse-", dir="/tmp"))
    d.chmod(0o755)
    job = "import os\nprint(_M, os.getpid(), open('/proc/self/cgroup').read().replace(chr(10), ' '))\n"
    write(d, "job.py", MARK + job)
    args = ("--pool-size", "1", "--pool-max-uses", "3", "--pool-preload", "colorsys", "--isolation", "cgroup")
    mine = ("--pool-user", "nobody", "--socket-group", str(pwd.getpwnam("nobody").pw_gid))
    try:
        async with run_daemon(*args, *mine, env=env, python=USER_PY) as dm:
            os.chmod(os.path.dirname(dm.socket), 0o755)  # its interpreters reach the daemon to be adopted
            async with await dm.client() as c:
                st = await warm(c)
                (worker,) = [w["pid"] for w in st["workers"]]
                home = _cgroups(worker)
                runs = []
                for _ in range(2):
                    r = await c.run(
                        ["/bin/sh", "-c", f"{USER_PY} job.py"], env=env, cwd=str(d), run_as=nobody
                    )
                    assert r.returncode == 0 and r.report.pool_adopted == 1, (r.stdout, r.stderr)
                    runs.append(r.stdout.decode().split(" ", 2))
                    st = await warm(c)  # back, warm again
                    assert st["retired"] == 0 and [w["pid"] for w in st["workers"]] == [worker], st
                    assert _cgroups(worker) == home
    finally:
        shutil.rmtree(d, ignore_errors=True)
    assert [(m, int(pid)) for m, pid, _ in runs] == [("True", worker)] * 2, runs
    # each ran in its own command's cgroups, not the worker's
    assert runs[0][2] != runs[1][2] and home.replace("\n", " ") not in (runs[0][2], runs[1][2]), (home, runs)


def test_a_worker_knows_whether_it_can_write_itself_back_into_its_cgroups() -> None:
    """A worker says at once whether it can go home after a command (homes.can_go_home), so the pool
    warms its replacement ahead where it cannot. Those files existing is not enough: as nobody, in
    root's cgroups, they are there and not writable."""
    from krex_async.ctxpool import homes

    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": USER_PYTHONPATH, "LANG": "C.UTF-8"}
    if not _nobody_runs(env):
        pytest.skip(f"nobody cannot import krex with {USER_PY} and PYTHONPATH={USER_PYTHONPATH}")
    mine = homes.cgroup_homes()
    if not mine or not all(mine.values()):
        pytest.skip(f"not every cgroup hierarchy of this process is mounted where it sees it: {mine}")
    assert homes.can_go_home(mine)  # root: it may write its own cgroups' procs files
    code = (
        "from krex_async.ctxpool import homes; h = homes.cgroup_homes(); "
        "print(all(h.values()), homes.can_go_home(h))"
    )
    p = subprocess.run(
        [USER_PY, "-c", code], user="nobody", env=env, capture_output=True, text=True, timeout=60, cwd="/"
    )
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["True", "False"], p.stdout  # the files are there, not nobody's to write
    assert not homes.can_go_home({**mine, "": None})  # a hierarchy not mounted here: no way home
