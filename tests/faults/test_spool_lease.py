"""A user's file lease cannot stall a daemon's start-up: the spool files are the daemon's (the user
reads them through an ACL and cannot lease them), and the start-up's reads never wait on a lease
held anyway (a file from an older daemon the user owns). A real F_SETLEASE from the real user."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator

import pytest

from krex_async import Client

from ..conftest import stop_all
from ..security.helpers import USER_PY, User, make_users, user_env
from .test_lost_commands import agent, launch, until_serving

HOLD = r"""
import errno, fcntl, json, os, signal, sys, time
signal.signal(signal.SIGIO, signal.SIG_IGN)  # a lease break asks; this holder never answers
got, fds = {}, []
for path in sys.argv[1:]:
    try:
        fd = os.open(path, os.O_RDONLY)
        fds.append(fd)
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)
        got[path] = "write-lease"
    except OSError as e:
        got[path] = errno.errorcode.get(e.errno, str(e.errno))
print(json.dumps(got), flush=True)
time.sleep(120)
"""


@pytest.fixture(scope="module")
def users() -> Iterator[dict[str, User]]:
    yield from make_users()


async def test_a_users_lease_on_a_spool_file_does_not_stall_start_up(users):
    alice = users["alice"]
    if open("/proc/sys/fs/leases-enable").read().strip() != "1":
        pytest.skip("file leases are disabled on this host (fs.leases-enable)")
    d = tempfile.mkdtemp(prefix="krexl-", dir="/tmp")
    os.chmod(d, 0o755)
    sock, log = os.path.join(d, "s"), os.path.join(d, "daemon.log")
    cfg: dict[str, object] = {
        "socket": sock,
        "state_dir": os.path.join(d, "state"),
        "log_format": "json",
        "isolation": "signal",
        "probes": "off",
        "socket_group": "krexg",
        "retention": 120,
    }
    procs = [launch(cfg, log)]
    holder = None
    try:
        await until_serving(procs[0], sock, log)
        cid = (await asyncio.to_thread(agent, alice, sock, "keep", "echo out-line; echo err-line >&2"))[
            "command"
        ]
        async with await Client.connect(sock) as root:
            rep = (await (await root.attach(cid)).wait()).report
        out, err = rep.stdout_spool, rep.stderr_spool
        assert out and err and rep.state == "exited", rep
        assert await asyncio.to_thread(agent, alice, sock, "read", out) == {"read": "out-line\n"}
        procs[0].terminate()  # a clean stop: the records keep the result for the next daemon
        procs[0].wait(15)
        # err as an older daemon left it: owned by the user, who can lease it.
        os.chown(err, alice.uid, alice.gid)
        with contextlib.suppress(OSError):
            os.removexattr(err, "system.posix_acl_access")
        holder = subprocess.Popen(
            [USER_PY, "-c", HOLD, out, err],
            user=alice.uid,
            group=alice.gid,
            extra_groups=alice.groups,
            env=user_env(),
            cwd="/tmp",
            stdout=subprocess.PIPE,
            text=True,
        )
        assert holder.stdout is not None
        got = json.loads(await asyncio.to_thread(holder.stdout.readline))
        assert got[out] in ("EACCES", "EPERM"), got  # not hers: no lease
        assert got[err] == "write-lease", got  # hers: leased, and SIGIO ignored
        t0 = time.monotonic()
        procs.append(launch(cfg, log))
        await until_serving(procs[1], sock, log)
        took = time.monotonic() - t0
        assert took < 10, f"start-up took {took:.1f} s with a lease held"
        res = await asyncio.to_thread(agent, alice, sock, "attach", cid)
        assert res["state"] == "exited" and res["stdout"] == "out-line\n", res
        assert '"spool_leased"' in open(log).read()
    finally:
        if holder is not None:
            holder.kill()
            holder.wait()
        stop_all(procs)
        shutil.rmtree(d, ignore_errors=True)
