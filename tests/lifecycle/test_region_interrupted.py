"""A region request interrupted by an exception (a signal handler's, KeyboardInterrupt) while it
waits for its grant is withdrawn: the process does not hold the device without knowing it."""

from __future__ import annotations

import asyncio

from ..conftest import PY, py_env, run_daemon

HOLDER = """
import time
from krex_async import region
with region("a"):
    print("in", flush=True)
    time.sleep(1.0)
time.sleep(8)
"""

# A benchmark harness's timeout (SIGALRM raising) fires while the region is being waited for; the
# program handles it and goes on with other work.
IMPATIENT = """
import signal, time
from krex_async import region
def expire(signum, frame):
    raise TimeoutError("harness timeout")
signal.signal(signal.SIGALRM, expire)
signal.setitimer(signal.ITIMER_REAL, 0.3)
try:
    with region("b"):
        print("held", flush=True)
except TimeoutError:
    print("gave up", flush=True)
time.sleep(8)
"""

NEXT = "from krex_async import region\nwith region('c'):\n    pass\n"


async def test_a_region_wait_interrupted_by_an_exception_is_withdrawn(script):
    async with run_daemon("--freeze", "device-holders", "--region-timeout", "60") as d:
        async with await d.client() as c:
            a = await c.submit([PY, script("a.py", HOLDER)], env=py_env())
            async for _, _data in a.output():
                break
            b = await c.submit([PY, script("b.py", IMPATIENT)], env=py_env())
            said = b""
            async for _, data in b.output():  # its first line (a write may arrive in pieces)
                said += data
                if b"\n" in said:
                    break
            assert said == b"gave up\n", said
            res = await asyncio.wait_for(c.run([PY, script("c.py", NEXT)], env=py_env()), 20)
            [region] = res.report.regions
            # Granted once A released (about 0.7 s from now), not once B ended (8 s from now).
            assert region.wait_s < 4.0, region
            for h in (a, b):
                await h.cancel(9)
                await h.wait()
