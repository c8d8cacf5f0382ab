"""--freeze device-holders (here through --freeze auto with the lock): a sibling that opens a GPU
device after the region chose whom to hold, while its entry is still under way, is frozen into the
region before the grant. Before, only an open during the held region froze its command: one
between the choice and the grant left the sibling running (and submitting) through the region.

The entry is made long by a pool worker's context creation in flight (3 s with the fake libcuda),
which a region waits for; the sibling opens its stand-in "/dev/nvidia0" 0.3 s into that wait."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest

from ..conftest import PY
from .fakecuda import Fake, build
from .test_hold_pool import _fd_targets, _probes_or_skip, env, pool_daemon, pytestmark  # noqa: F401


@pytest.fixture(scope="module")
def fake(tmp_path_factory: pytest.TempPathFactory) -> Fake:
    return build(tmp_path_factory.mktemp("fakecuda"))


# Writes argv[1] (the sibling's cue), then takes a region and counts the sibling's ticks (lines
# of argv[2]) over 0.5 s inside it.
OWNER = """
import json, sys, time, msgspec
from krex_async import region
def ticks():
    with open(sys.argv[2]) as f:
        return sum(1 for _ in f)
open(sys.argv[1], "w").write("1")
with region("timing") as r:
    n0 = ticks(); time.sleep(0.5); n1 = ticks()
print(json.dumps({"report": msgspec.to_builtins(r.report), "ticks": n1 - n0}))
"""


async def test_a_sibling_opening_the_gpu_during_the_entry_is_frozen_before_the_grant(
    fake: Fake, script, tmp_path: Path
) -> None:
    _probes_or_skip()
    mods = tmp_path / "mods"
    mods.mkdir()
    cue, ticks, late = tmp_path / "cue", tmp_path / "ticks", tmp_path / "late.pid"
    ticks.write_text("")
    sibling = fake.with_gpu_file(
        [
            "sh",
            "-c",
            f"while [ ! -e {cue} ]; do sleep 0.01; done; sleep 0.3; exec 3</dev/nvidia0; "
            f"echo $$ > {late}; while :; do echo t >> {ticks}; sleep 0.01; done",
        ]
    )
    async with pool_daemon(fake, mods, FAKE_CUDA_CTX_MS="3000") as d:
        async with await d.client() as c:
            deadline = time.monotonic() + 30
            creating = False
            while not creating:  # a worker's context creation is in flight: the entry waits for it
                creating = any(
                    w["state"] == "starting" and "/dev/nvidia0" in _fd_targets(w["pid"])
                    for w in (await c.status())["pools"]["cpu"]["workers"]
                )
                assert time.monotonic() < deadline, "the worker did not start creating its context"
                await asyncio.sleep(0.02)
            hs = await c.submit(sibling, env=env(fake, mods))
            res = await asyncio.wait_for(
                c.run([PY, script("owner.py", OWNER), str(cue), str(ticks)], env=env(fake, mods)), 30
            )
            await hs.cancel(9)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    rep = out["report"]
    assert late.exists(), "the sibling never opened its GPU file"
    assert rep["pool_wait_s"] > 0.5, f"the entry was not long enough to test anything: {rep}"
    assert rep["frozen"] == [hs.command], f"the late opener was not frozen: {rep}"
    assert hs.command not in rep.get("fenced", []), rep
    assert out["ticks"] <= 1, f"the sibling ran {out['ticks']} ticks inside the region"
