"""The daemon's drain check on a GPU device, on real processes: after freezing the siblings, the
region reads which of them hold a GPU device file and grants `synced` when none does, else
`pending` (the owner verifies; with no GPU library imported it reports `unverified`, never clean).

CI has no GPU: the daemon runs with one device of vendor `nvidia` and no vendor library, and the
GPU device prefixes point at a temporary directory, where a sibling opens a file to "hold" it.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

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


async def _drain_with(c: Client, siblings: list[list[str]]) -> tuple[str, int]:
    sibs = [await c.submit(argv, device="nvidia0") for argv in siblings]
    for s in sibs:  # each has opened its file (or not) before the region is asked for
        async for _, data in s.output():
            if b"held" in data:
                break
    res = await c.run([PY, "-c", OWNER], device="nvidia0")
    for s in sibs:
        await s.cancel(9)
        await s.wait()
    assert res.returncode == 0, res.stderr.decode()
    drain, frozen = res.stdout.decode().split()
    return drain, int(frozen)


async def test_drain_is_synced_only_when_no_frozen_sibling_holds_a_gpu_file():
    cg = private_cgroup_root()
    backend = {"isolation": "cgroup", "cgroup_root": cg} if cg else {"isolation": "signal"}
    try:
        with tempfile.TemporaryDirectory(prefix="krexdev-") as devdir:
            async with config_daemon(
                launch=LAUNCH,
                launch_args=[devdir + "/"],
                quiesce_timeout=0.02,
                region_cores=0,
                settle_ms=0,
                **backend,
            ) as d:
                async with await d.client() as c:
                    assert await _drain_with(c, []) == ("not-needed", 0)
                    assert await _drain_with(c, [IDLE, IDLE]) == ("synced", 2)
                    # one holder among idle siblings: the owner must verify, and with nothing to
                    # verify with it says so (unverified), never a clean `synced`
                    held = holder(Path(devdir) / "nvidia0")
                    assert await _drain_with(c, [IDLE, held]) == ("unverified", 2)
    finally:
        if cg:
            remove_cgroup_tree(cg)


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
    cg = private_cgroup_root()
    backend = {"isolation": "cgroup", "cgroup_root": cg} if cg else {"isolation": "signal"}
    try:
        with tempfile.TemporaryDirectory(prefix="krexdev-") as devdir:
            for window in (0.02, 0.4):
                async with config_daemon(
                    launch=LAUNCH,
                    launch_args=[devdir + "/"],
                    region_cores=0,
                    settle_ms=0,
                    drain_window=window,
                    **backend,
                ) as d:
                    async with await d.client() as c:
                        sib = await c.submit(holder(Path(devdir) / "nvidia0"), device="nvidia0")
                        async for _, data in sib.output():
                            if b"held" in data:
                                break
                        res = await c.run([PY, "-c", FAKE_TORCH_OWNER], device="nvidia0")
                        await sib.cancel(9)
                        await sib.wait()
                assert res.returncode == 0, res.stderr.decode()
                drain, took, given = res.stdout.decode().split()
                assert drain == "idle-verified" and float(given) == window, res.stdout
                assert window <= float(took) < window + 0.3, (window, took)
    finally:
        if cg:
            remove_cgroup_tree(cg)
