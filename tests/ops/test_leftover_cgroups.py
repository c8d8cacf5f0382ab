"""The test session's start-up sweep of test cgroups (tests/testcgroups.py), on real hierarchies and
processes: a dead run's leftovers go, in every hierarchy; a live run's stay, and so does a dead
run's cgroup that still holds a process."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

import pytest

from .. import testcgroups as tc
from ..conftest import ROOT, is_root, private_cgroup_root, py_env, remove_cgroup_tree

pytestmark = pytest.mark.skipif(not is_root(), reason="cgroup writes need root")

# Makes a test cgroup in each hierarchy (as a test would: named by tests/testcgroups.py), with a
# child, prints its name, then waits for a line on stdin (or EOF) and exits without removing it.
MAKER = """
import os, sys
from tests import testcgroups as tc
name = tc.new_name("leftover")
for m in tc.mounts():
    os.makedirs(os.path.join(m, name, "krex", "cmd-1"))
print(name, flush=True)
sys.stdin.readline()
"""


def make_leftover() -> tuple[subprocess.Popen[str], str]:
    p = subprocess.Popen(
        [sys.executable, "-c", MAKER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=py_env(),
        cwd=ROOT,
    )
    assert p.stdout is not None
    return p, p.stdout.readline().strip()


def paths(name: str) -> list[str]:
    return [os.path.join(m, name) for m in tc.mounts() if os.path.isdir(os.path.join(m, name))]


def test_a_dead_runs_cgroups_go_and_a_live_runs_stay() -> None:
    maker, name = make_leftover()
    try:
        assert tc.creator(name) == (maker.pid, tc._start_ticks(maker.pid)), name
        assert len(paths(name)) == len(tc.mounts()) >= 1
        assert tc.sweep_leftovers(names={name}) == []  # its maker runs: a run going elsewhere
        assert len(paths(name)) == len(tc.mounts())
        maker.communicate("\n", timeout=30)  # the run dies without cleaning up
        removed = tc.sweep_leftovers(names={name})
        assert sorted(removed) == sorted(os.path.join(m, name) for m in tc.mounts())
        assert paths(name) == []
    finally:
        if maker.poll() is None:
            maker.kill()
            maker.wait()
        for p in paths(name):
            remove_cgroup_tree(p)


def test_a_dead_runs_cgroup_holding_a_process_stays() -> None:
    maker, name = make_leftover()
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        maker.communicate("\n", timeout=30)
        v2 = tc.v2_mount()
        assert v2 is not None
        with open(os.path.join(v2, name, "krex", "cmd-1", "cgroup.procs"), "w") as f:
            f.write(str(sleeper.pid))
        assert tc.sweep_leftovers(names={name}) == []
        assert len(paths(name)) == len(tc.mounts())  # its twins stay with it
        sleeper.kill()
        sleeper.wait()
        assert len(tc.sweep_leftovers(names={name})) == len(tc.mounts())
    finally:
        sleeper.kill()
        sleeper.wait()
        for p in paths(name):
            remove_cgroup_tree(p)


def test_this_sessions_cgroups_name_this_process() -> None:
    """The daemons' private roots (and every test cgroup) say which pytest process made them;
    they were krex-test-<random> before, which no sweep could tell from a live run's."""
    root = private_cgroup_root()
    assert root is not None
    try:
        assert tc.creator_alive(os.path.basename(root)) is True, root
        assert tc.creator(os.path.basename(root))[0] == os.getpid()  # type: ignore[index]
        assert tc.sweep_leftovers(names={os.path.basename(root)}) == []
        assert os.path.isdir(root)
    finally:
        remove_cgroup_tree(root)


def test_an_old_name_goes_only_once_unchanged_for_hours() -> None:
    """A name without its creator (made before this) cannot be asked about: it goes when nothing
    in it changed for testcgroups.LEGACY_AGE_S and nothing uses it."""
    v2 = tc.v2_mount()
    assert v2 is not None
    name = f"krex-test-{uuid.uuid4().hex[:8]}"
    path = os.path.join(v2, name)
    os.makedirs(os.path.join(path, "krex"))
    try:
        assert tc.creator_alive(name) is None
        assert tc.sweep_leftovers(names={name}) == [] and os.path.isdir(path)  # young: may be in use
        old = time.time() - tc.LEGACY_AGE_S - 60
        for d in (path, os.path.join(path, "krex")):
            os.utime(d, (old, old))
        assert tc.sweep_leftovers(names={name}) == [path] and not os.path.exists(path)
    finally:
        remove_cgroup_tree(path)


async def test_a_dead_runs_root_that_a_live_daemon_still_uses_stays(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A daemon that outlived the run that started it holds no process in its root between
    commands, but owns an instance there: the root stays until that daemon is gone."""
    from krex_async.isolation.cgroup import CgroupBackend

    maker, name = make_leftover()
    maker.communicate("\n", timeout=30)
    v2 = tc.v2_mount()
    assert v2 is not None
    b = CgroupBackend(root=os.path.join(v2, name), state_dir=str(tmp_path / "state"), cpuset="none")
    try:
        assert tc.sweep_leftovers(names={name}) == []
        assert len(paths(name)) == len(tc.mounts())
    finally:
        await b.close()
    assert len(tc.sweep_leftovers(names={name})) == len(tc.mounts())


def test_another_sessions_start_leaves_a_dead_makers_fresh_cgroups_to_the_run_using_them() -> None:
    """The tests above make a dead run's cgroups on purpose (their maker exits) and then use them:
    a session starting meanwhile elsewhere (a real pytest process here) swept them from under the
    run. Now a session's start leaves those made in the last SESSION_MIN_AGE_S."""
    maker, name = make_leftover()
    try:
        maker.communicate("\n", timeout=30)
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                "--co",
                "tests/ops/test_doctor.py",
            ],
            capture_output=True,
            text=True,
            env=py_env(),
            cwd=ROOT,
            timeout=120,
        )
        assert r.returncode == 0, r.stdout + r.stderr
        assert len(paths(name)) == len(tc.mounts()), "another session's start swept a live run's cgroups"
        assert len(tc.sweep_leftovers(names={name})) == len(tc.mounts())
    finally:
        for p in paths(name):
            remove_cgroup_tree(p)
