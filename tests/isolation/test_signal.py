"""SignalBackend on real processes (no root needed)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import pytest

from krex_async.isolation.signal import SignalBackend

from ..testcgroups import new_name
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
        assert marker.exists(), (
            f"the command never ran (leader state {state(p.pid) if p.poll() is None else 'gone'})"
        )
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


async def test_a_freeze_cancelled_while_it_verifies_resumes_what_it_stopped():
    """Entry.isolate cancels a freeze still in flight when another step fails (or at
    shutdown): the processes it had stopped must run again, and its group must not read frozen."""
    from .cgroup_util import v1_freezer

    mnt = v1_freezer()
    if os.geteuid() != 0 or mnt is None:
        pytest.skip("needs root and a v1 freezer to hold a process unstoppable (state D)")
    b = SignalBackend()
    sleeper = subprocess.Popen(["sleep", "30"])
    held = subprocess.Popen(["sleep", "30"])
    path = os.path.join(mnt, new_name("sig"))
    os.mkdir(path)
    try:
        with open(os.path.join(path, "cgroup.procs"), "w") as f:
            f.write(str(held.pid))
        with open(os.path.join(path, "freezer.state"), "w") as f:
            f.write("FROZEN")
        assert wait_for(lambda: state(held.pid) == "D")
        g1, g2 = await b.create("one"), await b.create("two")
        await b.started(g1, sleeper.pid)
        await b.started(g2, held.pid)
        task = asyncio.ensure_future(b.freeze_many([g1, g2], timeout=5.0))
        await asyncio.sleep(0.2)
        assert not task.done()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for g in (g1, g2):  # what Entry.release does with every group it marked
            await b.thaw(g)
        assert not g1.frozen and not g2.frozen
        assert wait_for(lambda: state(sleeper.pid) == "S"), f"left stopped: {state(sleeper.pid)}"
    finally:
        with open(os.path.join(path, "freezer.state"), "w") as f:
            f.write("THAWED")
        for p in (sleeper, held):
            reap(p)
        wait_for(lambda: not open(os.path.join(path, "cgroup.procs")).read().split())
        os.rmdir(path)
        await b.close()


PID_REUSE = r"""
import asyncio, ctypes, os, signal, subprocess, sys, time
from krex_async.isolation.signal import SignalBackend

def state(pid):
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]

async def main():
    ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: orphans come to us
    b = SignalBackend()
    g = await b.create("reuse")
    # the leader leaves an orphan in its session: after a kill, we reap it and its pid is free
    lead = subprocess.Popen(["/bin/sh", "-c", "(sleep 300 &); exec sleep 300"], start_new_session=True)
    await b.started(g, lead.pid)
    def ppid(pid):
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    for _ in range(500):  # the orphaned sleep, once its subshell has exited and it is ours
        orphans = [p for p in b.pids(g) if p != lead.pid]
        if len(orphans) == 1 and ppid(orphans[0]) == os.getpid():
            break
        time.sleep(0.01)
    else:
        sys.exit(f"no orphan came to us: {orphans}")
    (victim,) = orphans
    await b.freeze_many([g])
    assert state(victim) == "T" and state(lead.pid) == "T"
    os.kill(victim, signal.SIGKILL)
    os.waitpid(victim, 0)
    newcomer = None
    for _ in range(50):  # the next pid the kernel hands out: the victim's (others may fork too)
        with open("/proc/sys/kernel/ns_last_pid", "w") as f:
            f.write(str(victim - 1))
        p = subprocess.Popen(["sleep", "300"])
        if p.pid == victim:
            newcomer = p
            break
        p.kill(); p.wait()
    if newcomer is None:
        print("SKIP the victim's pid was never handed out again"); return
    os.kill(newcomer.pid, signal.SIGSTOP)  # stopped by its owner, not by krex
    for _ in range(2000):
        if state(newcomer.pid) == "T":
            break
        time.sleep(0.001)
    await b.thaw(g)
    time.sleep(0.2)
    print("newcomer", state(newcomer.pid), "leader", state(lead.pid))
    for q in (newcomer, lead):
        q.kill(); q.wait()
    await b.close()

asyncio.run(main())
"""


def test_thaw_resumes_no_process_that_took_a_stopped_ones_pid():
    """A stopped process killed and reaped during a freeze frees its pid; the process that gets
    it next (here stopped by its own owner) must not be resumed by the thaw."""
    if os.geteuid() != 0 or not os.path.exists("/proc/sys/kernel/ns_last_pid"):
        pytest.skip("choosing the next pid needs root and /proc/sys/kernel/ns_last_pid")
    out = subprocess.run([sys.executable, "-c", PID_REUSE], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    if out.stdout.startswith("SKIP"):
        pytest.skip(out.stdout.strip())
    assert out.stdout.split() == ["newcomer", "T", "leader", "S"], out.stdout + out.stderr


def test_a_cmdline_read_mid_exec_does_not_count_as_past_the_launch_stop() -> None:
    """The thaw's background resume polls the launch shell's cmdline: while an exec is loading its
    new image the cmdline reads empty, and that must not end the wait (the shell would then stop
    itself with nobody left to resume it). Its own cmdline, with the marker, is the launch shell;
    the command's, after the shell's exec, is not."""
    from krex_async.isolation.signal import _LAUNCH, _launching

    shell = b"\0".join([b"/bin/sh", b"-c", b'kill -STOP $$; exec "$@"', _LAUNCH.encode(), b"true", b""])
    assert _launching(b"")
    assert _launching(shell)
    assert not _launching(b"true\0")


# A command that detaches a worker the classic way (fork, setsid, fork; the middle one exits): the
# worker is no descendant of the leader and in no session of its; it writes its pid, then spins.
DETACH = r"""
import os, sys, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        with open(sys.argv[1] + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.rename(sys.argv[1] + ".tmp", sys.argv[1])
        while True:
            pass
    os._exit(0)
time.sleep(60)
"""


async def test_a_process_the_command_detached_with_setsid_is_held_and_killed(tmp_path):
    """--isolation signal: the detached worker is stopped by a freeze, resumed by the thaw, and
    killed with the command."""
    b = SignalBackend()
    g = await b.create("detach1")
    out = tmp_path / "worker"
    env = dict(os.environ, KREX_COMMAND="detach1")
    p = subprocess.Popen([sys.executable, "-c", DETACH, str(out)], env=env, start_new_session=True)
    worker = 0
    try:
        await b.started(g, p.pid)
        assert wait_for(out.exists, 10), "the worker never started"
        worker = int(out.read_text())
        assert worker in b.pids(g), "the detached worker is not one of the command's processes"
        await b.freeze(g)
        assert wait_for(lambda: state(worker) in "tT"), f"the worker runs on ({state(worker)})"
        await b.thaw(g)
        assert wait_for(lambda: state(worker) not in "tT"), "the worker was not resumed"
        await b.kill(g)
        assert wait_for(lambda: not os.path.exists(f"/proc/{worker}") or state(worker) == "Z", 5), (
            "the worker outlived the command's kill"
        )
    finally:
        reap(p)
        if worker and os.path.exists(f"/proc/{worker}"):
            os.kill(worker, 9)
        await b.close()


async def test_a_detached_process_of_another_command_is_not_taken(tmp_path):
    """The environment decides: a detached worker naming another command is left alone."""
    b = SignalBackend()
    g = await b.create("mine")
    out = tmp_path / "worker"
    p = subprocess.Popen(
        [sys.executable, "-c", DETACH, str(out)],
        env=dict(os.environ, KREX_COMMAND="theirs"),
        start_new_session=True,
    )
    worker = 0
    try:
        await b.started(g, p.pid)
        assert wait_for(out.exists, 10)
        worker = int(out.read_text())
        assert worker not in b.pids(g)
    finally:
        reap(p)
        if worker and os.path.exists(f"/proc/{worker}"):
            os.kill(worker, 9)
        await b.close()


async def test_cancel_kills_what_a_command_detached_under_the_signal_backend(tmp_path):
    """Through the daemon: `krex` cancel of a command that detached a worker kills the worker."""
    from ..conftest import PY, py_env, run_daemon, until

    out = tmp_path / "worker"
    async with run_daemon("--isolation", "signal") as d:
        async with await d.client() as c:
            h = await c.submit([PY, "-c", DETACH, str(out)], env=py_env())
            await until(out.exists, "the worker starts", timeout=30)
            worker = int(out.read_text())
            try:
                await c.cancel(h.command)
                await h.wait()
                await until(
                    lambda: not os.path.exists(f"/proc/{worker}") or state(worker) == "Z",
                    "the detached worker is killed with its command",
                    timeout=10,
                )
            finally:
                if os.path.exists(f"/proc/{worker}"):
                    os.kill(worker, 9)


FORKER = """
import os, time
live = set()
while True:
    while live:
        pid, _ = os.waitpid(-1, os.WNOHANG)
        if not pid:
            break
        live.discard(pid)
    if len(live) < 64:
        pid = os.fork()
        if pid == 0:
            time.sleep(0.1)
            os._exit(0)
        live.add(pid)
    else:
        live.discard(os.waitpid(-1, 0)[0])
"""


async def test_a_freeze_stops_the_child_of_a_fork_its_sigstop_came_into():
    """A process inside fork() when its SIGSTOP comes stops after the fork, with a child that the
    signal missed: the freeze looks again once all it saw have stopped, so every process of the
    command is stopped when it returns. Here a command forks without pause (64 children living
    0.1 s each); before, some freeze of the 400 left a fresh child running."""
    b = SignalBackend()
    g = await b.create("forker")
    p = subprocess.Popen([sys.executable, "-c", FORKER], start_new_session=True)
    try:
        await b.started(g, p.pid)
        assert wait_for(lambda: len(b.pids(g)) > 16, 30), "the command never forked"
        for i in range(400):
            await b.freeze(g, timeout=30)  # 64 processes to stop beside busy cores: a bound only
            running = {}
            for pid in b.pids(g):
                try:
                    st = state(pid)
                except OSError:  # gone (reaped before the freeze reached its parent)
                    continue
                if st not in "tTZX":
                    running[pid] = st
            assert not running, f"freeze {i}: {running} run on"
            await b.thaw(g)
        assert p.poll() is None, "the forker died: the freezes above had nothing to catch"
    finally:
        await b.kill(g)
        reap(p)
        await b.close()
