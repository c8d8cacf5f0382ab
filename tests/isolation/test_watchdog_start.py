"""The watchdog whose daemon goes away while it starts: its "ready" meets a closed pipe, and it
still guards (sweeps when the daemon's pid ends) instead of dying in a BrokenPipeError traceback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from krex_async.isolation.cgroup import CgroupBackend

from ..conftest import ROOT, is_root, py_env
from .cgroup_util import SPIN, CgRoot, reap, wait_for

pytestmark = pytest.mark.skipif(not is_root(), reason="cgroup writes need root")


async def test_a_watchdog_whose_ready_finds_no_reader_still_guards(tmp_path) -> None:
    r = CgRoot()
    b = CgroupBackend(root=r.v2, state_dir=str(tmp_path / "state"), cpuset_root=r.v1)
    standin = subprocess.Popen(["sleep", "60"])  # the daemon, whose death the watchdog awaits
    g = await b.create("wd")
    p = subprocess.Popen(b.launch_argv(g, SPIN, frozen=False))
    try:
        await b.started(g, p.pid)
        assert wait_for(lambda: p.pid in b.pids(g))
        out_r, out_w = os.pipe()
        os.close(out_r)  # nobody reads "ready": the daemon that started it is gone
        argv = [sys.executable, "-m", "krex_async.isolation.watchdog", "--pid", str(standin.pid)]
        argv += ["--v2", r.v2, "--cpuset", b.cores.mode, "--state-dir", b.state_dir, "--base", b.base]
        argv += ["--v1", r.v1] if r.v1 else []
        wd = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=out_w, stderr=subprocess.PIPE, env=py_env(), cwd=ROOT
        )
        os.close(out_w)
        await b.freeze(g)
        assert b.v2.events(g.top)["frozen"] == 1
        standin.send_signal(signal.SIGKILL)
        _, err = wd.communicate(timeout=10)
        assert wd.returncode == 0 and b"Traceback" not in err, err.decode()
        assert b.v2.events(g.top)["frozen"] == 0, err.decode()  # it swept
    finally:
        reap(standin)
        reap(p)
        await b.remove(g)
        await b.close()
        r.cleanup()
