"""The gate between a starting daemon and `krex cleanup`: a real unprivileged user holding the lock
the gate used to take (flock on the `krex` cgroup directory, which any user may open) delays no
daemon start and no sweep, and cannot open the gate's own lock file."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import tempfile
import time

from .helpers import USER_PY, User, run_python_as, user_env
from .test_trust import as_user

# ------------------------------------------------------------------------------------ the gate

HOLD_DIR = (
    "import fcntl, os, sys, time\n"
    "fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY)\n"
    "fcntl.flock(fd, fcntl.LOCK_EX)\n"
    "print('held', flush=True)\n"
    "time.sleep(600)\n"
)


async def test_a_user_holding_the_krex_directory_locked_delays_nobody(users: dict[str, User]) -> None:
    """alice holds the old lock (flock on the `krex` directory, which any user may open): the
    daemon's and the sweep's gate pass at once, and alice cannot open the gate's own file."""
    from krex_async.isolation.instance import GATE_WAIT_S, gate, gate_file

    alice = users["alice"]
    krex = tempfile.mkdtemp(prefix="krexgate-", dir="/tmp")
    os.chmod(krex, 0o755)  # as the cgroup tree's `krex`: root's, readable by all
    holder = subprocess.Popen(
        [USER_PY, "-c", HOLD_DIR, krex],
        stdout=subprocess.PIPE,
        text=True,
        cwd="/tmp",
        env=user_env(),
        **as_user(alice),  # type: ignore[arg-type]
    )
    path = None
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        for exclusive in (False, True):
            t0 = time.monotonic()
            with gate([krex], exclusive=exclusive):
                pass
            assert time.monotonic() - t0 < GATE_WAIT_S / 2, f"the gate waited for alice ({exclusive=})"
        path = gate_file(krex)
        assert path is not None and os.path.exists(path)
        p = await asyncio.to_thread(run_python_as, alice, "import sys; open(sys.argv[1])", path)
        assert p.returncode != 0 and "PermissionError" in p.stderr, p.stderr
    finally:
        holder.kill()
        holder.wait()
        shutil.rmtree(krex, ignore_errors=True)
        if path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
