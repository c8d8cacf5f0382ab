"""A full state disk under the cgroup backend's intent record: a region that cannot record what it
would freeze or fence is refused with an answer, it does not leave its owner waiting."""

from __future__ import annotations

import asyncio
import os

from ..conftest import PY, py_env, run_daemon
from ..isolation.cgroup_util import need_cgroups

REGION = """
from krex_async import region
try:
    with region("full"):
        print("granted")
except Exception as e:
    print("refused", type(e).__name__, e)
"""


def fill(d: str) -> None:
    fd = os.open(os.path.join(d, "filler"), os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError:
        pass
    finally:
        os.close(fd)


async def test_a_region_whose_intent_cannot_be_written_is_refused_not_left_hanging(small_tmpfs):
    need_cgroups()
    state = os.path.join(small_tmpfs, "state")
    async with run_daemon("--isolation", "cgroup", "--state-dir", state) as d:
        async with await d.client() as c:
            sib = await c.submit([PY, "-c", "import time; time.sleep(30)"], env=py_env())
            fill(small_tmpfs)
            res = await asyncio.wait_for(c.run([PY, "-c", REGION], env=py_env()), 20)
            out = res.stdout.decode()
            assert out.startswith("refused") and "No space left" in out, (out, res.stderr[-2000:])
            await c.cancel(sib.command)
        assert d.proc.poll() is None
