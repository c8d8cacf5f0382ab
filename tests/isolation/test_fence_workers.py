"""The region cores' fence reaches the warm pools' workers in no command (daemon/regions/fence.py):
no command's cpuset holds them, and the fence leaves the region cores the only idle ones, so a worker
warming (a torch import is seconds of CPU), resetting after a command or tearing down would run
there beside the timing. Real processes with threads of their own; the pool and the region are
stand-ins, the affinities the kernel's."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace
from typing import Any

import pytest

from krex_async.daemon.regions.fence import CoreFence

pytestmark = pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs: one for the region, one left"
)

# A process with three threads, each sleeping: a worker's main thread and two of its own.
THREADED = """
import threading, time
for _ in range(2):
    threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()
print("ready", flush=True)
time.sleep(3600)
"""


def _worker(cpus: set[int] | None = None) -> subprocess.Popen[str]:
    p = subprocess.Popen(
        [sys.executable, "-c", THREADED],
        stdout=subprocess.PIPE,
        text=True,
        preexec_fn=None if cpus is None else lambda: os.sched_setaffinity(0, cpus),
    )
    assert p.stdout is not None and p.stdout.readline() == "ready\n"
    return p


def _affinities(pid: int) -> set[frozenset[int]]:
    return {frozenset(os.sched_getaffinity(int(t))) for t in os.listdir(f"/proc/{pid}/task")}


class Backend:
    """The isolation backend's cpuset calls, recorded (the owner's cores are the backend's)."""

    def __init__(self) -> None:
        self.calls: list[Any] = []

    async def set_cores(self, group: Any, cpus: Any, *, pids: Any = None, exclusive: bool = False) -> None:
        self.calls.append((cpus, pids))

    def pids(self, group: Any) -> list[int]:
        return []


def _fence(unsettled: list[int], idle: tuple[int, ...] = ()) -> tuple[CoreFence, dict[str, Any]]:
    """A fence over a pool whose workers in no command are `unsettled` (warming, resetting,
    retiring) and `idle`."""
    cpus = frozenset(sorted(os.sched_getaffinity(0))[:2])
    pool = SimpleNamespace(
        outside=lambda: [(p, False) for p in [*unsettled, *idle]],
        idle_pids=lambda: list(idle),
        creator_pid=lambda: None,
    )
    core: Any = SimpleNamespace(
        config=SimpleNamespace(region_cores=1),
        all_cpus=cpus,
        device=lambda key: SimpleNamespace(cpus=cpus),
        commands={},
        pools={"cpu": pool},
        backend=Backend(),
    )
    active: dict[str, Any] = {}
    return CoreFence(core, active), active


def _region(rid: str, pid: int) -> Any:
    return SimpleNamespace(
        id=rid,
        device="cpu",
        pid=pid,
        cores=frozenset(),
        frozen=[],
        command=SimpleNamespace(group=object(), state="running"),
        report=SimpleNamespace(cores=[], cores_s=0.0),
    )


async def test_workers_in_no_command_are_kept_off_the_region_cores_and_given_the_daemons_back() -> None:
    """At the entry, each thread of an unsettled worker leaves the region cores (an idle one,
    asleep, is left alone); one the pool starts (or retires, or takes back) during the region is
    fenced as the pool says so (fence_worker), again if its affinity changed since; at the release
    each gets the daemon's CPUs back, also one first seen on its command's fence (fails on
    5434726: the workers' threads kept the region cores)."""
    here = sorted(os.sched_getaffinity(0))
    everything = frozenset(here[:2])
    warming, late, idle = _worker(set(everything)), _worker(set(everything)), _worker(set(everything))
    fenced = _worker({here[0]})  # back from a command that was fenced off the region's CPU
    try:
        fence, active = _fence([warming.pid, fenced.pid], (idle.pid,))
        r = _region("r1", os.getpid())
        active[r.id] = r
        await fence.reserve(r)
        cores = set(r.report.cores)
        assert cores and cores <= everything, r.report.cores
        for p in (warming, fenced):
            assert _affinities(p.pid) == {everything - cores}, p.pid
        assert _affinities(late.pid) == {everything} and _affinities(idle.pid) == {everything}
        fence.fence_worker(late.pid)  # started during the region (Pool.on_unsettled)
        assert _affinities(late.pid) == {everything - cores}
        os.sched_setaffinity(late.pid, everything)  # its command set it since
        fence.fence_worker(late.pid)  # back from that command
        assert _affinities(late.pid) == {everything - cores}
        await fence.restore(r)
        for p in (warming, late, fenced):
            assert _affinities(p.pid) == {everything}, p.pid
        assert fence.workers == {}
        fence.fence_worker(late.pid)  # no core reserved: nothing to fence
        assert _affinities(late.pid) == {everything}
    finally:
        for p in (warming, late, idle, fenced):
            p.kill()
            p.wait()


async def test_a_worker_that_became_a_regions_owner_is_left_to_its_region_cores() -> None:
    """A worker fenced for one region that is then the owner of another (adopted by the command
    whose region it is) keeps the affinity its region gave it: the fence's next pass skips it."""
    here = sorted(os.sched_getaffinity(0))
    everything = frozenset(here[:2])
    w = _worker(set(everything))
    try:
        fence, active = _fence([w.pid])
        r1 = _region("r1", os.getpid())
        active[r1.id] = r1
        await fence.reserve(r1)
        mine = frozenset(r1.report.cores)
        assert _affinities(w.pid) == {everything - mine}
        os.sched_setaffinity(w.pid, mine)  # as a backend gives an owner its cores
        owner = _region("r2", w.pid)
        owner.cores = mine
        active[owner.id] = owner
        fence.reserved[owner.id] = mine  # as _reserve records them
        await fence.refence()
        assert frozenset(os.sched_getaffinity(w.pid)) == mine
    finally:
        w.kill()
        w.wait()
