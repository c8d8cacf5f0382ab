"""The region cores' fence reaches a real daemon's warm pool workers in no command, through the pool's
on_unsettled hook (daemon/commands/warmpools.py to daemon/regions/fence.py): a worker that comes back
from its command during another command's region resets and waits off the region's cores, and gets
the daemon's CPUs back at the release. tests/isolation/test_fence_workers.py calls the fence itself;
this is the wiring, end to end."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest

from krex_async import Client

from .conftest import PY, py_env, run_daemon, until, until_async
from .isolation.test_fence_workers import _affinities
from .test_pool_daemon import _backend_args, _wait_pool

# Runs in the pool's worker (in-process: its pid is the worker's) while the region is asked for and
# held: says its pid, waits for its cue, then widens its own affinity to all the daemon's CPUs (as a
# runtime pinning its threads may) and ends; the worker goes back to the pool and resets.
JOB = """
import os, sys, time
pidfile, go, cpus = sys.argv[1], sys.argv[2], sys.argv[3]
with open(pidfile + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.replace(pidfile + ".tmp", pidfile)
while not os.path.exists(go):
    time.sleep(0.005)
try:
    os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})
except OSError:
    pass  # a cpuset narrower than that: it keeps what it has
"""

# The region's owner (a plain process): holds its region until its cue.
OWNER = """
import os, sys, time
from krex_async import region
with region("timing") as r:
    while not os.path.exists(sys.argv[1]):
        time.sleep(0.005)
print(r.report.outcome, r.report.cores)
"""


async def _region(c: Client) -> dict[str, Any] | None:
    """The region held on the (only) device, None when none is."""
    r = (await c.status())["devices"][0]["region"]
    return r if r is not None and r["state"] == "held" else None


@pytest.mark.parametrize("backend", ["signal", "cgroup"])
async def test_worker_back_from_its_command_during_a_region_is_fenced_then_given_the_cpus_back(
    backend: str, script: Any, tmp_path: Path
) -> None:
    """A worker whose command ends while another command's region holds a region core resets and
    idles with every thread off that core (its command had widened the worker's affinity to all
    CPUs); the release gives it the daemon's CPUs back. --freeze device-holders: the worker's
    command, holding no GPU file, runs on through the region (fenced), so it can end during it."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 CPUs: one region core, one left for the rest")
    env = py_env()
    job, owner = script("job.py", JOB), script("owner.py", OWNER)
    pidfile, go, leave = tmp_path / "pid", tmp_path / "go", tmp_path / "leave"
    args = ("--pool-size", "1", "--pool-max-uses", "3", "--freeze", "device-holders")
    args += ("--region-cores", "1", "--region-timeout", "300", *_backend_args(backend))
    async with run_daemon(*args, env=env) as d:
        cpus = frozenset(os.sched_getaffinity(d.proc.pid))  # the daemon's: what a worker starts with
        async with await d.client() as c:
            [worker] = [w["pid"] for w in (await _wait_pool(c, {"warm": 1}))["workers"]]
            assert _affinities(worker) == {cpus}, "the worker did not start on the daemon's CPUs"
            hj = await c.submit([PY, job, str(pidfile), str(go), ",".join(map(str, sorted(cpus)))], env=env)
            await until(pidfile.exists, "the job did not start", 30)
            assert int(pidfile.read_text()) == worker, "the job was not run by the warm worker"
            ho = await c.submit([PY, "-X", "dev", owner, str(leave)], env=env)  # flags: never pooled
            held: dict[str, Any] = {}

            async def is_held() -> bool:
                held.update(await _region(c) or {})
                return bool(held)

            await until_async(is_held, "the owner's region was not held", 60)
            cores = frozenset(held["cores"])
            assert cores and cores < cpus, held
            go.touch()  # the job ends inside the region
            done = await asyncio.wait_for(hj.wait(), 30)
            assert (done.returncode, done.report.via) == (0, "pool"), (done.returncode, done.report)
            st = await _wait_pool(c, {"warm": 1, "busy": 0, "retired": 0})  # back, reset and idle
            assert [w["pid"] for w in st["workers"]] == [worker], st["workers"]
            during = _affinities(worker)
            still = await _region(c)
            assert still is not None and still["region"] == held["region"], "the region ended first"
            assert during == {cpus - cores}, f"its threads on {during} during a region on {sorted(cores)}"
            leave.touch()
            res = await asyncio.wait_for(ho.wait(), 30)
            assert res.stdout.split(maxsplit=1)[0] == b"released", res.stdout
            await until(
                lambda: _affinities(worker) == {cpus},
                lambda: f"the worker's threads kept {_affinities(worker)} after the release",
                30,
            )
