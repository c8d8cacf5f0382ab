"""The daemon's drain check on a GPU device, on real processes: after freezing the siblings, the
region reads which of them hold a GPU device file and grants `synced` when none does, else
`pending` (the owner verifies; with no GPU library imported it reports `unverified`, never clean).

CI has no GPU: the daemon runs with one device of vendor `nvidia` and no vendor library, and the
GPU device prefixes point at a temporary directory, where a sibling opens a file to "hold" it.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from krex_async import Client
from ..conftest import PY, ROOT, Daemon, private_cgroup_root, remove_cgroup_tree, serving

LAUNCH = r"""
import json, os, sys
from krex_async import server, config
from krex_async.devices import Node
from krex_async.devices.base import Device
from krex_async.runtime import quiesce
import msgspec
prefix, cfg = sys.argv[1], sys.argv[2]
quiesce.GPU_PREFIXES = (prefix,)
cpus = frozenset(os.sched_getaffinity(0))
server.open_node = lambda spec: Node(devices=[Device(index=0, key="nvidia0", vendor="nvidia",
                                                     name="no GPU here", cpus=cpus)], notes=[])
sys.exit(server.run(msgspec.json.decode(cfg, type=config.ServeConfig)))
"""

OWNER = ("from krex_async import region\n"
         "with region('t') as r:\n    pass\n"
         "print(r.report.drain, len(r.report.frozen))\n")
# Shells, not Python: a Python command would run krex's in-command runtime, be asked to quiesce,
# and acknowledge (after synchronising), which is `synced` as well.
IDLE = ["/bin/sh", "-c", "echo held; exec sleep 60"]


def holder(path: Path) -> list[str]:
    return ["/bin/sh", "-c", f"exec 3>{path}; echo held; exec sleep 60"]


@pytest.fixture
def gpu_daemon():
    d = tempfile.mkdtemp(prefix="krexd-", dir="/tmp")
    devdir = Path(d) / "dev"
    devdir.mkdir()
    cg = private_cgroup_root()
    cfg = {"socket": os.path.join(d, "s"), "state_dir": os.path.join(d, "state"),
           "log_format": "json", "isolation": "cgroup" if cg else "signal",
           "quiesce_timeout": 0.02, "region_cores": 0, "settle_ms": 0}
    if cg:
        cfg["cgroup_root"] = cg
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("KREX_SOCKET", None)
    log = Path(d) / "daemon.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen([PY, "-c", LAUNCH, str(devdir) + "/", json.dumps(cfg)], stdout=f,
                                stderr=subprocess.STDOUT, env=env)
    try:
        with serving(Daemon(cfg["socket"], proc, log)) as daemon:
            yield daemon, devdir
    finally:
        shutil.rmtree(d, ignore_errors=True)
        if cg:
            remove_cgroup_tree(cg)


async def _drain_with(sock: str, siblings: list[list[str]]) -> tuple[str, int]:
    async with await Client.connect(sock) as c:
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


def test_drain_is_synced_only_when_no_frozen_sibling_holds_a_gpu_file(gpu_daemon):
    daemon, devdir = gpu_daemon
    assert asyncio.run(_drain_with(daemon.socket, [])) == ("not-needed", 0)
    assert asyncio.run(_drain_with(daemon.socket, [IDLE, IDLE])) == ("synced", 2)
    held = holder(devdir / "nvidia0")
    # one holder among idle siblings: the owner must verify, and with nothing to verify with it
    # says so (unverified), never a clean `synced`
    assert asyncio.run(_drain_with(daemon.socket, [IDLE, held])) == ("unverified", 2)
