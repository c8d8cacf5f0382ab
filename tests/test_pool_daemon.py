"""The daemon runs Python commands in warm pool workers, indistinguishably from plain processes."""

from __future__ import annotations

import asyncio
import sys

from .conftest import PY, py_env, run_daemon


async def test_python_commands_run_in_the_pool_and_match_plain_runs(script):
    src = script("p.py", """
        import os, sys
        from krex_async import region
        print(sys.argv[1:], os.environ.get("KREX_DEVICE"), flush=True)
        with region("timing") as r:
            pass
        print(r.report.outcome, file=sys.stderr)
        raise SystemExit(3)
    """)
    env = py_env()
    async with run_daemon("--pool-size", "2", "--pool-preload", "json", env=env) as d:
        async with await d.client() as c:
            for _ in range(100):  # wait for a warm worker
                st = await c.status()
                if st["pools"]["cpu"]["warm"] >= 1:
                    break
                await asyncio.sleep(0.1)
            pooled = await c.run([PY, src, "a", "b"], env=env)
            plain = await c.run([PY, "-X", "dev", src, "a", "b"], env=env)  # flags: never pooled
    assert pooled.report.via == "pool" and plain.report.via == "exec"
    assert pooled.report.start_latency_s is not None
    for res in (pooled, plain):
        assert res.returncode == 3
        assert res.stdout == b"['a', 'b'] cpu\n"
        assert res.stderr.strip().endswith(b"released")
        assert res.report.regions[0].outcome == "released"
