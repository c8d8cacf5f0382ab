"""`krex trace` subscribers and the timeline ring see region boundaries and freezes as they happen."""

from __future__ import annotations

import asyncio

from .conftest import PY, py_env, run_daemon


async def test_trace_stream_and_timeline(script):
    owner = script("o.py", """
        import time
        from krex_async import region
        with region("timing"):
            time.sleep(0.1)
    """)
    async with run_daemon() as d:
        async with await d.client() as watcher, await d.client() as c:
            seen: list = []

            async def watch() -> None:
                async for ev in watcher.trace():
                    seen.append(ev)
                    if ev.kind == "command_end" and ev.command == target[0]:
                        return

            target = [""]
            sib = await c.submit(["sleep", "5"])
            await asyncio.sleep(0.2)
            task = asyncio.create_task(watch())
            await asyncio.sleep(0.1)
            h = await c.submit([PY, owner], env=py_env())
            target[0] = h.command
            res = await h.wait()
            await asyncio.wait_for(task, 10)
            timeline = await c.timeline()
            await sib.cancel(9)
    assert res.returncode == 0
    kinds = [e.kind for e in seen if e.command == h.command]
    for k in ("command_start", "region_grant", "region_release", "command_end"):
        assert k in kinds, (k, kinds)
    freezes = [e for e in seen if e.kind == "freeze" and e.command == h.command]
    assert freezes and freezes[0].detail["groups"] >= 1
    assert [e.kind for e in timeline if e.command == h.command][:1] == ["command_start"]
    grant = next(e for e in seen if e.kind == "region_grant")
    assert sib.command in grant.detail["frozen"]
