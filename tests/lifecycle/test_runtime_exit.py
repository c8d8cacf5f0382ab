"""The in-command runtime's listener thread is gone before the interpreter is torn down.

A daemon thread that wakes while the interpreter finalises (its connect or recv returning, a module
it is loading being cleared) can crash the program at exit; the runtime's atexit handler must leave
none behind, however early the program ends."""

from __future__ import annotations

import asyncio

from ..conftest import PY, py_env, run_daemon

# Runs the exit handlers at once (the runtime's among them), then counts this process's threads.
# A thread whose interpreter state is gone may still be in the kernel for some microseconds (its C
# exit path, harmless): the count is read for up to 0.3 s. A listener left behind stays in its
# recv for as long as the process lives.
EARLY_EXIT = """
import atexit, os, time
atexit._run_exitfuncs()
deadline = time.monotonic() + 0.3
while len(os.listdir('/proc/self/task')) > 1 and time.monotonic() < deadline:
    time.sleep(0.001)
print(len(os.listdir('/proc/self/task')))
"""


async def test_no_listener_thread_outlives_the_exit_handlers():
    async with run_daemon("--isolation", "signal") as d:
        async with await d.client() as c:
            results = await asyncio.gather(*(c.run([PY, "-c", EARLY_EXIT], env=py_env()) for _ in range(12)))
    counts = [r.stdout.strip().decode() or r.stderr.decode() for r in results]
    assert counts == ["1"] * len(counts), counts
