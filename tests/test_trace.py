"""`krex trace` subscribers and the timeline ring see region boundaries and freezes as they happen."""

from __future__ import annotations

import asyncio

from .conftest import PY, py_env, run_daemon
from .test_strays import device, entered  # noqa: F401  (the fixture: a watched private device node)


async def test_trace_stream_and_timeline(script):
    owner = script(
        "o.py",
        """
        import time
        from krex_async import region
        with region("timing"):
            time.sleep(0.1)
    """,
    )
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


async def test_trace_cli_reads_like_a_bcc_tool_and_says_when_the_daemon_stops(script, tmp_path):
    """`krex trace`: a header and 'Ctrl-C to stop' before any event, fixed columns (the REGION
    column where the header puts it), durations rounded; filters by command and kind; when the
    daemon stops, a line saying so and exit 1."""
    import subprocess
    import sys

    from .conftest import ROOT

    owner = script(
        "o.py",
        """
        import time
        from krex_async import region
        time.sleep(0.5)
        with region("timing"):
            time.sleep(0.1)
    """,
    )
    async with run_daemon() as d:
        env = py_env(KREX_SOCKET=d.socket)
        out = open(tmp_path / "out", "wb")
        err = open(tmp_path / "err", "wb")
        both = subprocess.Popen(
            [sys.executable, "-m", "krex_async", "trace"], stdout=out, stderr=err, env=env, cwd=ROOT
        )
        kinds = subprocess.Popen(
            [sys.executable, "-m", "krex_async", "trace", "--kind", "region_grant", "--json"],
            stdout=subprocess.PIPE,
            env=env,
        )
        await asyncio.sleep(1.5)
        head = (tmp_path / "out").read_text().splitlines()
        assert head and head[0].split() == ["TIME", "KIND", "DEVICE", "COMMAND", "PID", "REGION", "DETAIL"], (
            head
        )
        assert "Ctrl-C to stop" in (tmp_path / "err").read_text()
        async with await d.client() as c:
            sib = await c.submit(["sleep", "30"])
            res = await c.run([PY, owner], env=py_env())
            await sib.cancel(9)
            await sib.wait()
        await asyncio.sleep(0.5)
    # the daemon stopped: both traces end by themselves, saying so
    assert await asyncio.to_thread(both.wait, 20) == 1
    assert await asyncio.to_thread(kinds.wait, 20) == 1
    assert res.returncode == 0
    lines = (tmp_path / "out").read_text().splitlines()
    assert "closed the connection" in (tmp_path / "err").read_text()
    col = lines[0].index("REGION")
    grant = next(x for x in lines if " region_grant " in x)
    assert (
        grant.split()[3] == res.report.command and grant[col:].split()[0] == res.report.regions[0].region
    ), grant
    assert "enter_s=" in grant and "ms" in grant.split("enter_s=")[1].split()[0]
    assert "0000" not in grant.split("enter_s=")[1].split()[0], "durations must be rounded"
    freeze = next(x for x in lines if " freeze " in x)
    assert "seconds=" in freeze and freeze.split("seconds=")[1].split()[0].endswith("ms")
    assert all(len(x.split()) >= 6 for x in lines[1:]), lines
    import json

    objs = [json.loads(x) for x in kinds.stdout.read().splitlines()]
    assert [o["kind"] for o in objs] == ["region_grant"], objs
    assert "type" not in objs[0] and "id" not in objs[0] and objs[0]["region"]


async def test_trace_filters_pick_by_command_pid_device() -> None:
    import argparse

    from krex_async import protocol as P
    from krex_async.node.tracecli import line, wanted

    ns = argparse.Namespace(kind=[], command=[], pid=[], device=[], no_probes=False)
    ev = P.TraceEvent(
        id=0,
        ts=1.0,
        kind="stray",
        device="cpu",
        command="",
        region="r-1",
        pid=42,
        detail={"owner": "1-2", "name": "X", "comm": "nvidia-smi", "seconds": 0.0018357850000256803},
    )
    assert wanted(ev, ns)
    assert wanted(ev, argparse.Namespace(**{**vars(ns), "command": ["1-2"]}))  # its region's owner
    assert not wanted(ev, argparse.Namespace(**{**vars(ns), "command": ["9-9"]}))
    assert wanted(ev, argparse.Namespace(**{**vars(ns), "pid": [42]}))
    assert not wanted(ev, argparse.Namespace(**{**vars(ns), "pid": [43]}))
    assert not wanted(ev, argparse.Namespace(**{**vars(ns), "device": ["nvidia0"]}))
    assert wanted(ev, argparse.Namespace(**{**vars(ns), "kind": ["probe,stray"]}))
    probe = P.TraceEvent(id=0, ts=1.0, kind="probe", pid=5)
    assert not wanted(probe, argparse.Namespace(**{**vars(ns), "no_probes": True}))
    text = line(ev)
    assert text.split()[1:6] == ["STRAY", "cpu", "-", "42", "r-1"], text
    assert "owner=1-2" in text and "comm=nvidia-smi" in text and "seconds=1.836ms" in text
    # Real ids (a boot id and numbers in the hundreds) keep DETAIL in its column, under the header.
    from krex_async.node.tracecli import HEADER

    grant = P.TraceEvent(
        id=0,
        ts=1.0,
        kind="region_grant",
        device="cpu",
        command="1065bba0-123",
        region="1065bba0-123.45",
        pid=7,
        detail={"frozen": "1065bba0-124"},
    )
    assert line(grant).index("frozen=") == HEADER.index("DETAIL"), (HEADER, line(grant))
    # A stray's comm is any process's text: escaped, never sent raw to the terminal.
    odd = P.TraceEvent(id=0, ts=1.0, kind="stray", device="cpu", pid=9, detail={"comm": "a\x1b]0;t\x07\nb"})
    assert "\x1b" not in line(odd) and "\n" not in line(odd) and "comm=a\\x1b]0;t\\x07\\nb" in line(odd)


async def test_trace_names_the_stray_process_and_the_owners_own_region(device, script, tmp_path):  # noqa: F811 - the fixture
    """With the probes on: a process outside krex touching the device during a region is a STRAY
    line naming itself (no command, its comm) and the region's owner; the owner's own ioctls in
    its region carry the region; a --no-probes subscriber gets the stray but no plain probe events."""
    import os
    import subprocess

    from .test_strays import IOCTLS

    marker = tmp_path / "inside"
    ioctls = script("io.py", IOCTLS)
    owner = script(
        "owner.py",
        f"""
        import fcntl, os, time
        from krex_async import region
        fd = os.open({device!r}, os.O_RDWR)
        with region("timing") as r:
            for _ in range(5):
                try:
                    fcntl.ioctl(fd, 0x5401, bytes(64))
                except OSError:
                    pass
            open({str(marker)!r}, "w").close()
            time.sleep(1.0)
    """,
    )
    prefix = os.path.dirname(device) + "/"
    async with run_daemon("--probes", "ioctl", "--probe-prefixes", prefix) as d:
        async with await d.client() as all_, await d.client() as quiet, await d.client() as c:
            seen: dict[str, list] = {"all": [], "quiet": []}

            async def watch(cl, key, probes) -> None:
                async for ev in cl.trace(probes=probes):
                    seen[key].append(ev)

            tasks = [
                asyncio.create_task(watch(all_, "all", True)),
                asyncio.create_task(watch(quiet, "quiet", False)),
            ]
            await asyncio.sleep(0.3)
            h = await c.submit([PY, owner], env=py_env())
            await entered(marker)
            outside = await asyncio.to_thread(
                subprocess.run, [PY, ioctls, device, "3"], capture_output=True, text=True, timeout=30
            )
            res = await h.wait()
            await asyncio.sleep(1.0)
            for t in tasks:
                t.cancel()
    assert res.returncode == 0, res.stderr
    rid = res.report.regions[0].region
    stray = [e for e in seen["all"] if e.kind == "stray" and e.pid == int(outside.stdout)]
    assert stray, [(e.kind, e.pid) for e in seen["all"]]
    assert stray[0].command == "" and stray[0].region == rid
    assert stray[0].detail["owner"] == h.command and stray[0].detail["comm"].startswith("python")
    own = [
        e
        for e in seen["all"]
        if e.kind == "probe" and e.command == h.command and e.detail.get("probe") == "ioctl"
    ]
    assert own and all(e.region == rid for e in own), own
    assert not [e for e in seen["quiet"] if e.kind == "probe"]
    assert [e for e in seen["quiet"] if e.kind == "stray"]
