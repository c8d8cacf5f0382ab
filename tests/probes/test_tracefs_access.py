"""A daemon that is not root meets root's tracefs (mode 0700): its probes say tracefs is not
readable by its user, not that tracefs is not mounted (it is: the mount table says so)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import time

import pytest

from krex_async.linux import procfs
from krex_async.probes.tracefs import ROOTS

from ..security.helpers import USER_PY, make_users, user_env


def test_a_daemon_that_may_not_read_tracefs_says_so() -> None:
    alice = next(make_users())["alice"]
    mounted = [m.point for m in procfs.mounts("tracefs") if m.point in ROOTS]
    if not mounted:
        pytest.skip("tracefs is not mounted here")
    if any(os.stat(r).st_mode & 0o005 == 0o005 for r in mounted):
        pytest.skip("tracefs is readable by every user here")
    d = tempfile.mkdtemp(prefix="krex-tfs-", dir="/tmp")
    os.chown(d, alice.uid, alice.gid)
    log = os.path.join(d, "log")
    with open(log, "wb") as out:
        p = subprocess.Popen(
            [USER_PY, "-m", "krex_async", "serve", "--socket", f"{d}/s", "--state-dir", f"{d}/state"]
            + ["--isolation", "signal", "--probes", "tracefs", "--log-format", "json"],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=user_env(),
            cwd="/tmp",
            user=alice.uid,
            group=alice.gid,
        )
    try:
        deadline = time.monotonic() + 30
        while '"event": "probes"' not in open(log).read():
            assert p.poll() is None and time.monotonic() < deadline, open(log).read()
            time.sleep(0.01)
        line = next(json.loads(x) for x in open(log) if '"event": "probes"' in x)
        assert "not readable by this user" in line["reason"] and "not mounted" not in line["reason"], line
        assert f"uid {alice.uid}" in line["reason"], line
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait(30)
        subprocess.run(["rm", "-rf", d])
