"""`krex trace` subscribers and the timeline ring see region boundaries and freezes as they happen."""

from __future__ import annotations

import asyncio
import re

from .conftest import PY, py_env, run_daemon, until
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
    # fields named *_s and seconds are seconds, rounded to the microsecond (they read 0.514ms)
    enter = grant.split("enter_s=")[1].split()[0]
    assert re.fullmatch(r"\d+(\.\d{1,6})?s", enter), grant
    assert abs(float(enter[:-1]) - res.report.regions[0].enter_s) < 1e-5, (grant, res.report.regions[0])
    assert "region_name=timing" in grant, grant  # the name the code gave, beside the id
    freeze = next(x for x in lines if " freeze " in x)
    assert re.fullmatch(r"\d+(\.\d{1,6})?s", freeze.split("seconds=")[1].split()[0]), freeze
    assert f"frozen={sib.command}" in freeze, freeze  # whom it froze, not only the owner
    start = next(x for x in lines if " command_start " in x and res.report.command in x)
    assert f"argv={PY} {owner}" in start, start
    assert all(len(x.split()) >= 6 for x in lines[1:]), lines
    import json

    objs = [json.loads(x) for x in kinds.stdout.read().splitlines()]
    assert [o["kind"] for o in objs] == ["region_grant"], objs
    assert "type" not in objs[0] and "id" not in objs[0] and objs[0]["region"]


async def test_trace_filters_pick_by_command_pid_device() -> None:
    import argparse

    from krex_async import protocol as P
    from krex_async.ops.tracecli import line, wanted

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
    assert "owner=1-2" in text and "comm=nvidia-smi" in text and "seconds=0.001836s" in text
    # Real ids (a boot id and numbers in the hundreds) keep DETAIL in its column, under the header.
    from krex_async.ops.tracecli import HEADER

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


async def test_trace_sums_strays_per_region_and_comm_refuses_unknown_ids_and_stops_on_duration(
    device,  # noqa: F811 - the fixture
    script,
    tmp_path,
):
    """Strays were one line per ioctl (147 for a 1.5 s region): by default `krex trace` now sums
    them, one STRAYS line per (region, command, comm) before the region's release line, naming
    the region's name; --strays lines keeps one line each. --command with an id this node does not
    have is refused (it waited silently forever), as --device is; --duration S ends it with 0."""
    import os
    import subprocess
    import sys
    import time

    from .conftest import ROOT
    from .test_strays import IOCTLS

    marker = tmp_path / "inside"
    ioctls = script("io.py", IOCTLS)
    owner = script(
        "owner.py",
        f"""
        import time
        from krex_async import region
        with region("timing"):
            open({str(marker)!r}, "w").close()
            time.sleep(1.5)
    """,
    )
    prefix = os.path.dirname(device) + "/"
    async with run_daemon("--probes", "ioctl", "--probe-prefixes", prefix) as d:
        env = py_env(KREX_SOCKET=d.socket)
        krex = [sys.executable, "-m", "krex_async", "trace"]
        files = {m: open(tmp_path / m, "wb") for m in ("summary", "lines")}
        traces = {
            m: subprocess.Popen(
                [*krex, *([] if m == "summary" else ["--strays", "lines"]), "--duration", "60"],
                stdout=files[m],
                stderr=subprocess.PIPE,
                env=env,
                cwd=ROOT,
            )
            for m in files
        }
        await until(lambda: all((tmp_path / m).read_bytes().startswith(b"TIME") for m in files), "headers")
        await asyncio.sleep(0.3)  # the subscriptions are made after the header is printed
        async with await d.client() as c:
            h = await c.submit([PY, owner], env=py_env())
            await until(marker.exists, "the owner in its region")
            outside = await asyncio.to_thread(
                subprocess.run, [PY, ioctls, device, "40"], capture_output=True, text=True, timeout=30
            )
            res = await h.wait()
        await until(lambda: b"region_release" in (tmp_path / "summary").read_bytes(), "the release")
        for p in traces.values():
            p.send_signal(2)
            await asyncio.to_thread(p.wait, 30)
        nosuch = await asyncio.to_thread(
            subprocess.run,
            [*krex, "--command", "nosuch-1"],
            capture_output=True,
            text=True,
            env=env,
            timeout=30,
        )
        t0 = time.monotonic()
        short = await asyncio.to_thread(
            subprocess.run, [*krex, "--duration", "1"], capture_output=True, text=True, env=env, timeout=30
        )
        took = time.monotonic() - t0
    assert res.returncode == 0 and outside.returncode == 0, (res.stderr, outside.stderr)
    pid = outside.stdout.strip()
    summary = (tmp_path / "summary").read_text().splitlines()
    lines = (tmp_path / "lines").read_text().splitlines()
    mine = [x for x in summary if x.split()[1:2] == ["STRAYS"] and f" {pid} " in x]
    assert len(mine) == 1, summary
    # its open and its 40 ioctls
    assert "count=41" in mine[0] and "calls=TCGETS:40," in mine[0], mine[0]
    assert "region_name=timing" in mine[0] and f"owner={h.command}" in mine[0], mine[0]
    assert not [x for x in summary if x.split()[1:2] == ["STRAY"]], summary
    release = next(i for i, x in enumerate(summary) if " region_release " in x)
    assert summary.index(mine[0]) < release, summary
    assert len([x for x in lines if x.split()[1:2] == ["STRAY"] and f" {pid} " in x]) == 41, lines
    assert nosuch.returncode == 2 and "--command nosuch-1: no such command" in nosuch.stderr, nosuch.stderr
    assert short.returncode == 0 and short.stdout.startswith("TIME") and took < 20, (short, took)


async def test_perfetto_names_command_tracks_and_regions(script) -> None:
    """The exported timeline's command track names the command's label and argv, and its region
    slices carry the name the code gave (`timing`) beside the id (they were ids only)."""
    import json
    import subprocess
    import sys

    from .conftest import ROOT

    owner = script(
        "o.py",
        """
        import time
        from krex_async import region
        with region("timing"):
            time.sleep(0.05)
    """,
    )
    async with run_daemon() as d:
        async with await d.client() as c:
            res = await c.run([PY, owner], env=py_env(), label="agent-7")
        out = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "krex_async", "export", "--socket", d.socket, "--perfetto", "-"],
            capture_output=True,
            text=True,
            env=py_env(),
            cwd=ROOT,
            timeout=60,
        )
    assert res.returncode == 0 and out.returncode == 0, (res.stderr, out.stderr)
    evs = json.loads(out.stdout)["traceEvents"]
    cid, rid = res.report.command, res.report.regions[0].region
    tracks = [e["args"]["name"] for e in evs if e["ph"] == "M" and e["name"] == "thread_name"]
    assert f"command {cid} agent-7: {PY} {owner}" in tracks, tracks
    names = {e["name"] for e in evs if e["ph"] == "X"}
    assert f"{rid} timing" in names and f"{cid}:{rid} timing" in names, names
