"""`krex cleanup` running while a daemon starts on the same state dir: the daemon must neither be
refused by cleanup's look at its owner lock nor have its instance directory swept from under it
(made, or taken over from a dead daemon, after cleanup looked). Real cgroups, a real cleanup
process sweeping in a loop, and the daemon's own start-up on the state dir (CgroupBackend: claim,
instance directory) repeated in this process."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from krex_async.isolation.cgroup import CgroupBackend
from krex_async.isolation.cgroupfs import CgroupFileError
from krex_async.isolation.instance import InstanceBusy, claim_instance, instance_name

from ..conftest import PY, ROOT, cmdline, is_root, py_env
from ..isolation.cgroup_util import CgRoot

pytestmark = pytest.mark.skipif(not is_root(), reason="cgroup writes need root")

# Sweeps the given roots until the stop file appears; prints how many sweeps it made.
SWEEPER = """
import os, sys
from krex_async.ops import cleanup
stop, roots = sys.argv[1], sys.argv[2:]
n = 0
print("ready", flush=True)
while not os.path.exists(stop):
    cleanup.cleanup(roots)
    n += 1
print(n, flush=True)
"""

STARTS = 150


def start_sweeper(stop: Path, roots: list[str]) -> subprocess.Popen[str]:
    p = subprocess.Popen(
        [PY, "-c", SWEEPER, str(stop), *roots], stdout=subprocess.PIPE, text=True, env=py_env(), cwd=ROOT
    )
    assert p.stdout is not None and p.stdout.readline() == "ready\n"
    return p


def stop_sweeper(p: subprocess.Popen[str], stop: Path) -> int:
    """Sweeps it made (0 when it had to be killed)."""
    stop.touch()
    try:
        out, _ = p.communicate(timeout=30)
        return int(out.split()[-1])
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


async def test_daemon_starts_survive_a_concurrent_cleanup(tmp_path: Path) -> None:
    """Before: cleanup's probe (a shared flock of the owner file) made a daemon claiming it at that
    instant refuse to start ("another krex daemon"), and an instance found dead at cleanup's
    snapshot was removed after a new daemon had taken it over. Each start here leaves a command
    cgroup behind (as a daemon that died would), so every next start takes over a dead instance
    that the sweeper is trying to remove."""
    r = CgRoot()
    state = str(tmp_path / "state")
    stop = tmp_path / "stop"
    roots = [r.v2] + ([r.v1] if r.v1 else [])
    base = os.path.join(r.v2, "krex", instance_name(state))
    refused: list[str] = []
    broken: list[str] = []
    removed = 0
    sweeps = 0
    try:
        sweeper = start_sweeper(stop, roots)
        for i in range(STARTS):
            try:
                b = CgroupBackend(root=r.v2, state_dir=state, cpuset_root=r.v1)
            except InstanceBusy as e:  # cleanup's look at the lock taken for a live daemon
                refused.append(str(e))
                continue
            except CgroupFileError as e:  # its instance swept while it was making it
                broken.append(str(e))
                continue
            try:
                time.sleep(0.002)  # a sweep that took this instance for a dead one acts now
                removed += not os.path.isdir(base)
                await b.create(f"c{i}")  # left behind: the next start takes over a dirty instance
            except CgroupFileError as e:
                broken.append(str(e))
            finally:
                await b.close()
        sweeps = stop_sweeper(sweeper, stop)
    finally:
        await asyncio.to_thread(r.cleanup)
    print(f"{sweeps} sweeps; refused {len(refused)}, removed {removed}, broken {len(broken)}")
    assert sweeps > STARTS, f"the sweeper ran {sweeps} times: too few to overlap the starts"
    assert not refused, f"{len(refused)} of {STARTS} starts refused, e.g. {refused[0]}"
    assert not removed, f"the live instance directory was swept away in {removed} of {STARTS} starts"
    assert not broken, f"{len(broken)} of {STARTS} starts lost cgroups to the sweep, e.g. {broken[0]}"


def test_krex_serve_starts_while_krex_cleanup_sweeps(tmp_path: Path) -> None:
    """The same through the real processes: `krex serve` on one state dir, started and SIGKILLed
    (its instance left dirty for the sweeper) a few times while a sweeper loops; each start serves
    with its instance directory in place."""
    r = CgRoot()
    state, stop = tmp_path / "state", tmp_path / "stop"
    base = os.path.join(r.v2, "krex", instance_name(str(state)))
    try:
        sweeper = start_sweeper(stop, [r.v2] + ([r.v1] if r.v1 else []))
        for i in range(4):
            sock, log = tmp_path / f"s{i}", tmp_path / f"log{i}"
            with open(log, "wb") as out:
                p = subprocess.Popen(
                    [PY, "-m", "krex_async", "serve", "--socket", str(sock), "--state-dir", str(state)]
                    + ["--cgroup-root", r.v2, "--probes", "off", "--log-format", "json"],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=py_env(),
                    cwd=ROOT,
                )
            try:
                deadline = time.monotonic() + 30
                while not sock.exists():
                    assert p.poll() is None, log.read_text()
                    assert time.monotonic() < deadline, log.read_text()
                    time.sleep(0.01)
                time.sleep(0.05)
                assert os.path.isdir(base), log.read_text()
            finally:
                p.kill()
                p.wait()
            with contextlib.suppress(OSError):  # a dead daemon's command cgroup, for the sweeper
                os.makedirs(os.path.join(base, f"cmd-dead{i}", "run"))
        assert stop_sweeper(sweeper, stop) > 0
    finally:
        r.cleanup()


# A daemon's start on the state dir (its instance and watchdog), then nothing until it is killed.
OLD_DAEMON = """
import sys
from krex_async.isolation.cgroup import CgroupBackend
b = CgroupBackend(root=sys.argv[1], state_dir=sys.argv[2], cpuset="none")
b.start_watchdog()
print(b.watchdog.pid, flush=True)
sys.stdin.readline()
"""


async def test_a_dead_daemons_watchdog_leaves_a_restarted_one_alone(tmp_path: Path) -> None:
    """A daemon restarted on the state dir of one just killed (systemd's Restart=) can own the
    instance before the dead one's watchdog sweeps it (held up here by SIGSTOP): that sweep thawed
    the new daemon's region and removed its fresh command cgroup. Now the watchdog sees the new
    owner and leaves the instance to it."""
    r = CgRoot()
    state = str(tmp_path / "state")
    old = subprocess.Popen(
        [PY, "-c", OLD_DAEMON, r.v2, state], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=py_env()
    )
    b = None
    try:
        assert old.stdout is not None
        watchdog = int(old.stdout.readline())
        os.kill(watchdog, signal.SIGSTOP)
        old.kill()
        old.wait()
        b = CgroupBackend(root=r.v2, state_dir=state, cpuset="none")  # the restart
        g = await b.create("new")
        await b.freeze(g)  # a region of the new daemon
        os.kill(watchdog, signal.SIGCONT)
        deadline = time.monotonic() + 10
        while os.path.exists(f"/proc/{watchdog}") and b"watchdog" in cmdline(watchdog):
            assert time.monotonic() < deadline, "the old watchdog did not finish"
            time.sleep(0.01)
        assert b.v2.exists(g.run), "the old watchdog removed the new daemon's command cgroup"
        assert b.v2.events(g.top)["frozen"] == 1, "the old watchdog thawed the new daemon's region"
        await b.thaw(g)
        await b.remove(g)
    finally:
        if old.poll() is None:
            old.kill()
            old.wait()
        if b is not None:
            await b.close()
        await asyncio.to_thread(r.cleanup)


# Pins the state dir's owner lock as a sweep does (instance.pin_instance), says so, then hangs.
STUCK_SWEEP = """
import sys, time
from krex_async.isolation.instance import pin_instance
assert pin_instance(sys.argv[1])[0] >= 0
print("pinned", flush=True)
time.sleep(600)
"""


def test_a_start_refused_by_a_stuck_sweep_names_it(tmp_path: Path) -> None:
    """A sweep that holds the owner lock past the wait (a Ctrl-Z'd `krex cleanup`, a dead daemon's
    watchdog stuck in a driver unlock) refuses the start; the refusal blamed `krex cleanup`
    whoever it was. It names the holding process now, so that the right one is ended."""
    state = str(tmp_path / "state")
    os.close(claim_instance(state, "krex/test"))  # the owner file a daemon leaves
    sweep = subprocess.Popen([PY, "-c", STUCK_SWEEP, state], stdout=subprocess.PIPE, text=True, env=py_env())
    try:
        assert sweep.stdout is not None and sweep.stdout.readline() == "pinned\n"
        with pytest.raises(InstanceBusy) as e:
            claim_instance(state, "krex/test", wait_s=0.2)
        assert f"pid {sweep.pid}: {PY} -c" in str(e.value), e.value
    finally:
        sweep.kill()
        sweep.wait()
    os.close(claim_instance(state, "krex/test", wait_s=0.2))  # ended: the start goes on
