"""Two real daemons on one cgroup root: each sweeps, watches and names only its own instance
directory, and a third on the first one's state dir refuses to start instead of thawing it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import tempfile
import time

import pytest

from krex_async import Client

from ..conftest import PY, private_cgroup_root, py_env, remove_cgroup_tree, run_daemon, v2_mount
from .test_daemon_death import OWNER, SIBLING, cgroup_frozen, tree


@pytest.fixture
def shared_root():
    root = private_cgroup_root()
    if root is None:
        pytest.skip("the cgroup backend needs root and a cgroup v2 mount")
    try:
        yield root
    finally:
        remove_cgroup_tree(root)


def cgroup_of(pid: int) -> str:
    with open(f"/proc/{pid}/cgroup") as f:
        return next(line.split(":", 2)[2].strip() for line in f if line.startswith("0::"))


async def test_daemons_sharing_a_cgroup_root_leave_each_other_alone(shared_root, script):
    owner = script("owner.py", OWNER)
    backend = ("--cgroup-root", shared_root, "--region-timeout", "120")
    async with run_daemon(*backend) as a, run_daemon(*backend) as b:
        ca, cb = await a.client(), await b.client()
        try:
            sib = await ca.submit(SIBLING)
            own = await ca.submit([PY, owner], env=py_env())
            async for _, data in own.output():
                assert b"inside" in data
                break
            sib_pid = next(c["pid"] for c in (await ca.status())["commands"] if c["command"] == sib.command)
            victims = tree(sib_pid)
            assert all(cgroup_frozen(p) for p in victims), victims
            # B, started with A's region held: its own command and cancel, ids and cgroups apart.
            mine = await cb.submit(["sleep", "30"])
            await cb.submit(["true"])
            assert mine.command != sib.command and mine.command != own.command
            assert (await cb.status())["commands"][0]["pid"]
            await mine.cancel(9)
            assert (await mine.wait()).report.state == "cancelled"
            rel_root = shared_root[len(v2_mount() or "") :]
            assert os.path.dirname(cgroup_of(sib_pid)).startswith(f"{rel_root}/krex/d-")
            # B restarts on its own state dir (its sweep runs again), then dies by SIGKILL (its
            # watchdog sweeps): A's sibling stays frozen throughout.
            b.proc.kill()
            b.proc.wait()
            state_b = os.path.join(os.path.dirname(b.socket), "state")
            with open(b.log, "ab") as log:
                b.proc = subprocess.Popen(
                    [
                        PY,
                        "-m",
                        "krex_async",
                        "serve",
                        "--socket",
                        b.socket,
                        *backend,
                        "--log-format",
                        "json",
                        "--state-dir",
                        state_b,
                        "--probes",
                        "off",
                    ],
                    env=py_env(),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            t0 = time.monotonic()
            while True:
                with contextlib.suppress(Exception):
                    async with await Client.connect(b.socket, timeout=1) as c2:
                        assert (await c2.run(["true"])).report.state == "exited"
                        break
                assert b.proc.poll() is None and time.monotonic() - t0 < 20, b.logs()
                await asyncio.sleep(0.05)
            await asyncio.sleep(1.2)  # the first B's watchdog had a second to sweep
            assert all(cgroup_frozen(p) for p in victims), (victims, b.logs())
            assert sib.command not in b.logs()
            # A third daemon on A's state dir (and root): refuses, naming the live one.
            state_a = os.path.join(os.path.dirname(a.socket), "state")
            sock = os.path.join(tempfile.mkdtemp(prefix="krex-", dir="/tmp"), "s")
            third = await asyncio.to_thread(
                subprocess.run,
                [
                    PY,
                    "-m",
                    "krex_async",
                    "serve",
                    "--socket",
                    sock,
                    *backend,
                    "--state-dir",
                    state_a,
                    "--probes",
                    "off",
                    "--log-format",
                    "json",
                ],
                env=py_env(),
                capture_output=True,
                text=True,
                timeout=30,
            )
            assert third.returncode != 0, third
            assert "another krex daemon" in third.stderr and str(a.proc.pid) in third.stderr, third.stderr
            assert not os.path.exists(sock)
            # `krex cleanup` (as ExecStopPost of another daemon's unit would run it) leaves A's
            # live instance alone, though A does not serve on the socket it checks.
            swept = await asyncio.to_thread(
                subprocess.run,
                [PY, "-m", "krex_async", "cleanup", "--root", shared_root, "--socket", sock],
                env=py_env(),
                capture_output=True,
                text=True,
                timeout=30,
            )
            assert swept.returncode == 0 and f"(pid {a.proc.pid}) is alive" in swept.stdout, swept
            assert all(cgroup_frozen(p) for p in victims), victims
            # A's own region ends: A thaws its sibling.
            await own.cancel(9)
            await own.wait()
            t1 = time.monotonic()
            while any(cgroup_frozen(p) for p in victims):
                assert time.monotonic() - t1 < 5
                await asyncio.sleep(0.02)
            await sib.cancel(9)
        finally:
            await ca.close()
            await cb.close()


async def test_an_instance_directory_removed_while_empty_is_made_again(shared_root):
    """An older `krex cleanup` (or a hand) removes every empty cgroup, the idle daemon's instance
    directory included: its next command makes it again instead of failing."""
    async with run_daemon("--cgroup-root", shared_root) as d:
        async with await d.client() as c:
            assert (await c.run(["true"])).report.state == "exited"
            krex = os.path.join(shared_root, "krex")
            t0 = time.monotonic()  # the ended command's cgroup goes just after its report
            while (
                any(sub.is_dir() for e in os.scandir(krex) if e.is_dir() for sub in os.scandir(e.path))
                and time.monotonic() - t0 < 5
            ):
                await asyncio.sleep(0.02)
            for tree in (krex, krex.replace("/unified/", "/cpuset/", 1)):
                for inst in os.listdir(tree) if os.path.isdir(tree) else []:
                    if inst.startswith("d-"):
                        os.rmdir(os.path.join(tree, inst))
            assert not [n for n in os.listdir(krex) if n.startswith("d-")]
            res = await c.run(["echo", "again"])
            assert res.report.state == "exited" and res.stdout == b"again\n", res.report
