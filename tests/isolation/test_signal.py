"""SignalBackend on real processes (no root needed)."""

from __future__ import annotations

import asyncio
import subprocess
import time

from krex_async.isolation.signal import SignalBackend

from .cgroup_util import reap, state, wait_for


async def test_thaw_before_a_slow_launch_stopped_itself_still_lets_it_run(tmp_path):
    """The launch shell stops itself (`kill -STOP $$`); a thaw that comes before it did must not
    be lost, however long the shell takes to get there (here 1.5 s: a start-up on a loaded host;
    the thaw's own wait is bounded at 1 s)."""
    b = SignalBackend()
    g = await b.create("slow")
    marker = tmp_path / "ran"
    argv = b.launch_argv(g, ["/bin/sh", "-c", f"touch {marker}"], frozen=True)
    # the same pid reaches the launch shell 1.5 s late (a start-up on a loaded host)
    p = subprocess.Popen(["/bin/sh", "-c", 'sleep 1.5; exec "$@"', "slow-start", *argv])
    try:
        await b.started(g, p.pid)
        t0 = time.monotonic()
        await b.thaw(g)
        assert time.monotonic() - t0 < 1.3, "thaw must stay bounded"
        assert not g.frozen
        for _ in range(400):  # on the loop: the backend may finish the thaw in the background
            if marker.exists():
                break
            await asyncio.sleep(0.01)
        assert marker.exists(), \
            f"the command never ran (leader state {state(p.pid) if p.poll() is None else 'gone'})"
        assert p.wait(timeout=2) == 0
    finally:
        reap(p)
        await b.close()


async def test_a_launch_stopped_command_thawed_in_time_runs_once(tmp_path):
    b = SignalBackend()
    g = await b.create("fast")
    marker = tmp_path / "ran"
    p = subprocess.Popen(b.launch_argv(g, ["/bin/sh", "-c", f"echo x >> {marker}"], frozen=True))
    try:
        await b.started(g, p.pid)
        assert wait_for(lambda: state(p.pid) == "T")
        assert not marker.exists()
        await b.thaw(g)
        assert p.wait(timeout=3) == 0 and marker.read_text() == "x\n"
    finally:
        reap(p)
        await b.close()
