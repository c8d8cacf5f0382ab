"""A daemon's instance directory (`<root>/krex/d-<hash>`, and its v1 cpuset twin) goes with the
daemon's clean stop when empty, stays when not, and `krex cleanup` removes those of daemons that
are not running while it leaves a running daemon's alone in every tree."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess

import pytest

from krex_async.isolation.cgroup import CgroupBackend
from krex_async.isolation.instance import instance_name

from ..conftest import PY, ROOT, is_root, private_cgroup_root, py_env, remove_cgroup_tree, run_daemon
from .cgroup_util import CgRoot

pytestmark = pytest.mark.skipif(not is_root(), reason="cgroup writes need root")


def twins(root: str) -> list[str]:
    """`root/krex` and, on a hybrid host, its v1 cpuset twin (made by the daemon for a root)."""
    out = [os.path.join(root, "krex")]
    v1 = root.replace("/unified/", "/cpuset/", 1)
    if v1 != root and os.path.isdir(v1):
        out.append(os.path.join(v1, "krex"))
    return out


def instances(root: str) -> list[str]:
    trees = [t for t in twins(root) if os.path.isdir(t)]
    return sorted(os.path.join(t, d) for t in trees for d in os.listdir(t) if d.startswith("d-"))


def cleanup(root: str) -> subprocess.CompletedProcess[str]:
    roots = [a for t in twins(root) for a in ("--root", t)]
    return subprocess.run(
        [PY, "-m", "krex_async.ops.cleanup", *roots, "--socket", "/nonexistent/krex.sock"],
        capture_output=True,
        text=True,
        env=py_env(),
        cwd=ROOT,
        timeout=30,
    )


async def test_a_clean_stop_removes_the_empty_instance_directory() -> None:
    root = private_cgroup_root()
    assert root is not None
    try:
        async with run_daemon("--cgroup-root", root) as d:
            async with await d.client() as c:
                h = await c.submit(["true"])
                assert (await h.wait()).returncode == 0
            made = instances(root)
            assert made and all(os.path.basename(p).startswith("d-") for p in made)
            rc = await asyncio.to_thread(d.stop)
            assert rc == 0, d.logs()
            assert instances(root) == [], d.logs()
    finally:
        remove_cgroup_tree(root)


async def test_an_instance_directory_with_something_in_it_stays(tmp_path) -> None:
    r = CgRoot()
    try:
        state = str(tmp_path / "state")
        b = CgroupBackend(root=r.v2, state_dir=state, cpuset_root=r.v1)
        base = os.path.join(r.v2, "krex", instance_name(state))
        os.mkdir(os.path.join(base, "foreign"))  # not ours to remove: rmdir only, never recursive
        await b.close()
        assert os.path.isdir(os.path.join(base, "foreign"))
    finally:
        r.cleanup()


async def test_cleanup_leaves_a_running_daemons_instance_and_removes_a_dead_ones() -> None:
    root = private_cgroup_root()
    assert root is not None
    try:
        async with run_daemon("--cgroup-root", root) as d:
            made = instances(root)
            assert made
            live = await asyncio.to_thread(cleanup, root)
            assert live.returncode == 0, live.stderr
            assert instances(root) == made, live.stdout  # the v1 twin too
            assert "alone" in live.stdout
            d.proc.send_signal(signal.SIGKILL)  # no clean stop: the directories stay
            await asyncio.to_thread(d.proc.wait, 15)
        assert instances(root) == made
        dead = await asyncio.to_thread(cleanup, root)
        assert dead.returncode == 0, dead.stderr
        assert instances(root) == [], dead.stdout
    finally:
        remove_cgroup_tree(root)
