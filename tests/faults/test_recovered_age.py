"""`krex status` of commands a dead daemon left: their AGE counts from their start (their record's),
not from the new daemon's recovery; a record with no start time shows AGE `?`."""

from __future__ import annotations

import asyncio
import glob
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time

from ..conftest import PY, py_env, run_daemon

PAUSE = 3.0  # between the first daemon's death and the second's start


async def _row(socket: str, command: str) -> str:
    """`krex status --all`'s row of `command` (an earlier daemon's commands show only with --all)."""
    p = await asyncio.to_thread(
        subprocess.run,
        [PY, "-m", "krex_async", "status", "--all", "--socket", socket],
        capture_output=True,
        text=True,
        env=py_env(),
        timeout=30,
    )
    return next(x for x in p.stdout.splitlines() if x.startswith(command))


async def test_a_recovered_commands_age_counts_from_its_start() -> None:
    top = tempfile.mkdtemp(prefix="krex-age-", dir="/tmp")
    try:
        await _recover_twice(os.path.join(top, "state"))
    finally:
        shutil.rmtree(top, ignore_errors=True)


async def _recover_twice(state: str) -> None:
    args = ("--isolation", "signal", "--state-dir", state)  # the second daemon finds the first's records
    async with run_daemon(*args) as d:
        async with await d.client() as c:
            t0 = time.monotonic()
            done = await c.run(["true"])  # ended: its record holds its report
            kept = await c.submit(["sleep", "60"], on_disconnect="keep")  # lost with its daemon
            while (await c.status())["commands"][-1]["state"] != "running":
                await asyncio.sleep(0.05)
            d.stop(signal.SIGKILL)
    [unknown] = [p for p in glob.glob(f"{state}/commands/*") if kept.command in p]
    await asyncio.sleep(PAUSE)
    async with run_daemon(*args) as d:
        async with await d.client() as c:
            ages = {x["command"]: x["age_s"] for x in (await c.status())["commands"]}
        lived = time.monotonic() - t0
        assert PAUSE <= ages[done.report.command] <= lived + 0.5, (ages, lived)
        assert PAUSE <= ages[kept.command] <= lived + 0.5, (ages, lived)
        row = await _row(d.socket, kept.command)
        assert row.split()[5].endswith("s") and not row.split()[5].endswith("ms"), row  # AGE
        d.stop()
    # A record without its start time (a damaged one): the age is not known, and said so.
    rec = json.load(open(unknown))
    rec["started_at"] = 0.0
    with open(unknown, "w") as f:
        json.dump(rec, f)
    async with run_daemon(*args) as d:
        async with await d.client() as c:
            ages = {x["command"]: x["age_s"] for x in (await c.status())["commands"]}
        assert ages[kept.command] is None and ages[done.report.command] >= PAUSE, ages
        row = await _row(d.socket, kept.command)
        assert row.split()[4:6] == ["?", "?"], row  # STARTED and AGE: not known
