"""The daemon's drain check on a GPU device, on real processes: after freezing the siblings, the
region reads which of them hold a GPU device file and grants `synced` when none does, else
`pending` (the owner verifies; with no GPU library imported it reports `unverified`, never clean).

CI has no GPU: the daemon runs with one device of vendor `nvidia` and no vendor library, and the
GPU device prefixes point at a temporary directory, where a sibling opens a file to "hold" it.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from krex_async import Client

from ..conftest import PY, private_cgroup_root, remove_cgroup_tree
from ..security.helpers import config_daemon

LAUNCH = r"""
import os, sys
import msgspec
from krex_async.daemon import server
from krex_async.daemon import config
from krex_async.devices import Node
from krex_async.devices.base import Device
from krex_async.runtime import quiesce
cfg, prefix = sys.argv[1], sys.argv[2]
quiesce.GPU_PREFIXES = (prefix,)
cpus = frozenset(os.sched_getaffinity(0))
server.open_node = lambda spec: Node(devices=[Device(index=0, key="nvidia0", vendor="nvidia",
                                                     name="no GPU here", cpus=cpus)], notes=[])
sys.exit(server.run(msgspec.json.decode(cfg, type=config.ServeConfig)))
"""

OWNER = (
    "from krex_async import region\n"
    "with region('t') as r:\n    pass\n"
    "print(r.report.drain, len(r.report.frozen))\n"
)
# Shells, not Python: a Python command would run krex's in-command runtime, be asked to quiesce,
# and acknowledge (after synchronising), which is `synced` as well.
IDLE = ["/bin/sh", "-c", "echo held; exec sleep 60"]


def holder(path: Path) -> list[str]:
    return ["/bin/sh", "-c", f"exec 3>{path}; echo held; exec sleep 60"]


@contextlib.asynccontextmanager
async def _gpu_daemon(**config: Any) -> AsyncIterator[tuple[Client, str]]:
    """A daemon with one stand-in nvidia device whose device files live in a temporary directory
    (a sibling "holds" the GPU by opening one there): its client and that directory."""
    cg = private_cgroup_root()
    backend = {"isolation": "cgroup", "cgroup_root": cg} if cg else {"isolation": "signal"}
    try:
        with tempfile.TemporaryDirectory(prefix="krexdev-") as devdir:
            async with config_daemon(
                launch=LAUNCH, launch_args=[devdir + "/"], region_cores=0, settle_ms=0, **config, **backend
            ) as d:
                async with await d.client() as c:
                    yield c, devdir
    finally:
        if cg:
            remove_cgroup_tree(cg)


async def _owner_beside(c: Client, siblings: list[list[str]], owner: str) -> str:
    """Run `owner` (Python) on the device once every sibling has opened its file (or not); its
    stdout. The siblings are killed after."""
    sibs = [await c.submit(argv, device="nvidia0") for argv in siblings]
    for s in sibs:  # each has opened its file (or not) before the region is asked for
        async for _, data in s.output():
            if b"held" in data:
                break
    res = await c.run([PY, "-c", owner], device="nvidia0")
    for s in sibs:
        await s.cancel(9)
        await s.wait()
    assert res.returncode == 0, res.stderr.decode()
    return res.stdout.decode()


async def _drain_with(c: Client, siblings: list[list[str]]) -> tuple[str, int]:
    drain, frozen = (await _owner_beside(c, siblings, OWNER)).split()
    return drain, int(frozen)


async def test_drain_is_synced_only_when_no_frozen_sibling_holds_a_gpu_file():
    async with _gpu_daemon(quiesce_timeout=0.02) as (c, devdir):
        assert await _drain_with(c, []) == ("not-needed", 0)
        assert await _drain_with(c, [IDLE, IDLE]) == ("synced", 2)
        # one holder among idle siblings: the owner must verify, and with nothing to verify with
        # it says so (unverified), never a clean `synced`
        held = holder(Path(devdir) / "nvidia0")
        assert await _drain_with(c, [IDLE, held]) == ("unverified", 2)


# An owner whose torch is a stand-in with instant round trips: its drain check passes as soon as
# the window has passed, so the time it took shows the window it was given.
FAKE_TORCH_OWNER = """
import sys, types
cuda = types.SimpleNamespace(is_initialized=lambda: True, is_available=lambda: True, synchronize=lambda: None)
torch = types.ModuleType("torch")
torch.cuda, torch.float16 = cuda, "f16"
torch.randn = lambda *a, **k: object()
torch.matmul = lambda a, b: None
sys.modules["torch"] = torch
from krex_async import region
with region('t') as r:
    pass
print(r.report.drain, r.report.drain_s, r.report.drain_window_s)
"""


async def test_the_drain_check_runs_for_the_window_the_daemon_gives() -> None:
    """--drain-window reaches the owner with the grant: its check passes after that long (not the
    runtime's 20 ms default), and the region's report says which window it had."""
    for window in (0.02, 0.4):
        # a long timeout: on a loaded machine a preemption longer than the bar (250 us) restarts
        # the window, and a 0.4 s window went unfinished within the default 2 s
        async with _gpu_daemon(drain_window=window, drain_timeout=10.0) as (c, devdir):
            out = await _owner_beside(c, [holder(Path(devdir) / "nvidia0")], FAKE_TORCH_OWNER)
        drain, took, given = out.split()
        assert drain == "idle-verified" and float(given) == window, out
        # at least the window given (0.4 s, not the runtime's 20 ms); the upper bound only guards
        # against a check that never ends: a loaded 2-core machine took 0.8 s for 0.4
        assert window <= float(took) < 10.0, (window, took)
