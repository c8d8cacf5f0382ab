"""A sibling that cannot be frozen (a thread in uninterruptible sleep) no longer refuses every region
on its device: the region is granted with that sibling left running, fenced off the region cores,
named in `unheld` with the freezer's reason, and the region tainted (issue 20 item 10).

The D-state sibling is real: it mounts a FUSE filesystem whose server never answers (it holds
/dev/fuse open and never reads it), in a private mount namespace so nothing else on the machine can
trip over the mount, and a child stats a file in it: FUSE waits for its INIT answer in a killable
sleep (state D), which the cgroup freezer cannot stop and SIGKILL still ends."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import time
from pathlib import Path

import pytest

from ..conftest import PY, is_frozen, proc_state, py_env, run_daemon

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: cgroups, FUSE mounts"),
    pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="no /dev/fuse"),
    pytest.mark.skipif(shutil.which("unshare") is None, reason="unshare (util-linux) missing"),
]

# argv[1]: a file the D-state child's pid is written to once it is about to block; argv[2]: an
# empty directory to mount on (in the command's private mount namespace).
HUNG = """
import ctypes, os, sys, time
mnt = sys.argv[2]
fd = os.open("/dev/fuse", os.O_RDWR)
libc = ctypes.CDLL(None, use_errno=True)
opts = f"fd={fd},rootmode=40000,user_id=0,group_id=0".encode()
if libc.mount(b"krex-hung", mnt.encode(), b"fuse", 0, opts) != 0:
    sys.exit(f"mount: {os.strerror(ctypes.get_errno())}")
pid = os.fork()
if pid == 0:
    open(sys.argv[1], "w").write(str(os.getpid()))
    os.stat(os.path.join(mnt, "x"))  # never answered: D state until killed
    os._exit(0)
os.waitpid(pid, 0)
"""

OWNER = """
import sys, msgspec
from krex_async import region
with region("timing") as r:
    import time; open(sys.argv[1], "w").write("1"); time.sleep(0.6)
sys.stdout.write(msgspec.json.encode(r.report).decode())
"""

TICKER = """
import time
while True:
    time.sleep(0.001)
"""


def mnt(tmp_path: Path) -> str:
    d = tmp_path / "mnt"
    d.mkdir(exist_ok=True)
    return str(d)


async def test_a_hung_sibling_is_fenced_and_the_region_tainted(script, tmp_path: Path) -> None:
    pidfile = tmp_path / "hung.pid"
    hung = script("hung.py", HUNG)
    async with run_daemon(
        "--hold", "freeze", "--freeze", "all", "--freeze-timeout", "0.3", "--region-cores", "1"
    ) as d:
        async with await d.client() as c:
            hh = await c.submit(
                ["unshare", "-m", "--propagation", "private", PY, hung, str(pidfile), mnt(tmp_path)],
                env=py_env(),
            )
            deadline = time.monotonic() + 10
            while not (pidfile.exists() and pidfile.read_text()):
                assert time.monotonic() < deadline, "the hung sibling did not start"
                await asyncio.sleep(0.01)
            child = int(pidfile.read_text())
            while proc_state(child) != "D":
                assert time.monotonic() < deadline, f"the child is {proc_state(child)}, not D"
                await asyncio.sleep(0.01)
            ht = await c.submit([PY, script("ticker.py", TICKER)], env=py_env())
            await asyncio.sleep(0.3)
            t0 = time.monotonic()
            marker = tmp_path / "granted"
            run = asyncio.ensure_future(c.run([PY, script("owner.py", OWNER), str(marker)], env=py_env()))
            while not marker.exists() and not run.done():
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.1)
            aff = os.sched_getaffinity(child)
            res = await run
            took = time.monotonic() - t0
            assert res.returncode == 0, res.stderr
            rep = json.loads(res.stdout)
            assert not is_frozen(child) and proc_state(child) == "D"
            # the next region does not try it again while it still hangs: no timeout paid
            again = await c.run([PY, script("owner.py", OWNER), str(tmp_path / "g2")], env=py_env())
            rep2 = json.loads(again.stdout)
            await hh.cancel(9)
            assert (await asyncio.wait_for(hh.wait(), 10)).report.state == "cancelled"
            await ht.cancel(9)
    assert rep["outcome"] == "released", rep
    assert rep["frozen"] == [ht.command], "the healthy sibling is still frozen"
    assert list(rep["unheld"]) == [hh.command] and "not frozen after" in rep["unheld"][hh.command]
    assert rep["tainted"] and hh.command in rep["taint"][0] and "could not be held" in rep["taint"][0]
    assert rep["fenced"] == [hh.command]
    assert took < 5, f"the region took {took:.1f} s"
    assert rep["enter_s"] >= 0.3, "the first region tried to freeze it"
    assert "still in uninterruptible sleep" in rep2["unheld"][hh.command], rep2
    assert rep2["enter_s"] < 0.2 and rep2["tainted"] and rep2["frozen"] == [ht.command], rep2
    assert rep["cores"] and not aff & set(rep["cores"]), f"the hung sibling ran on {aff}"


async def test_a_hung_sibling_under_the_signal_backend(script, tmp_path: Path) -> None:
    """The signal backend names a failed freeze by its pids: the culprit is still found."""
    pidfile = tmp_path / "hung.pid"
    hung = script("hung.py", HUNG)
    async with run_daemon(
        "--isolation", "signal", "--hold", "freeze", "--freeze", "all", "--freeze-timeout", "0.3"
    ) as d:
        async with await d.client() as c:
            hh = await c.submit(
                ["unshare", "-m", "--propagation", "private", PY, hung, str(pidfile), mnt(tmp_path)],
                env=py_env(),
            )
            deadline = time.monotonic() + 10
            while (
                not (pidfile.exists() and pidfile.read_text()) or proc_state(int(pidfile.read_text())) != "D"
            ):
                assert time.monotonic() < deadline, "the hung sibling did not start"
                await asyncio.sleep(0.01)
            ht = await c.submit([PY, script("ticker.py", TICKER)], env=py_env())
            await asyncio.sleep(0.3)
            res = await c.run([PY, script("owner.py", OWNER), str(tmp_path / "g")], env=py_env())
            await hh.cancel(9)
            await ht.cancel(9)
    assert res.returncode == 0, res.stderr
    rep = json.loads(res.stdout)
    assert rep["frozen"] == [ht.command] and list(rep["unheld"]) == [hh.command], rep
    assert rep["tainted"]


COUNTER = """
import sys, time
n = 0
while True:
    n += 1
    with open(sys.argv[1], "w") as f:
        f.write(str(n))
    time.sleep(0.005)
"""

WATCHER = """
import json, sys, time, msgspec
from krex_async import region
def ticks():
    with open(sys.argv[1]) as f:
        return f.read()
with region("timing") as r:
    first = ticks()
    time.sleep(2.0)
    moved = ticks() != first
print(json.dumps({"report": msgspec.to_builtins(r.report), "moved": moved}))
"""


async def test_a_late_freeze_in_flight_at_a_release_does_not_leave_the_next_region_unheld(
    script, tmp_path: Path
) -> None:
    """Region A is held; sibling y opens the GPU late (--freeze device-holders), and A's late
    freeze of it cannot finish (a thread of y is in uninterruptible sleep) before A ends. Region B
    is next. Before, B was granted at once and skipped y as already frozen (its cgroup.freeze was
    written) while listing it frozen; A's freeze then timed out and undid itself, and y ran through
    B. Now A's release waits for its freezes in flight, and B holds y or says it could not."""
    from krex_async.probes import bcc_works

    ok, why = bcc_works()
    if not ok:
        pytest.skip(f"bcc unavailable: {why}")
    pidfile, ticks, marker = tmp_path / "hung.pid", tmp_path / "ticks", tmp_path / "granted"
    hung, counter = script("hung.py", HUNG), script("counter.py", COUNTER)
    body = (
        f"{PY} {hung} {pidfile} {mnt(tmp_path)} & {PY} {counter} {ticks} & "  # before /dev goes
        f"while [ ! -s {pidfile} ]; do sleep 0.01; done; "
        "mount -t tmpfs krex-fake /dev && : > /dev/nvidia0 || exit 9; "
        f"while [ ! -s {marker} ]; do sleep 0.01; done; sleep 0.2; exec 3</dev/nvidia0; sleep 60"
    )
    async with run_daemon(
        "--hold",
        "freeze",
        "--freeze",
        "device-holders",
        "--probes",
        "ioctl",
        "--freeze-timeout",
        "1.0",
        "--region-cores",
        "1",
    ) as d:
        async with await d.client() as c:
            hy = await c.submit(
                ["unshare", "-m", "--propagation", "private", "/bin/sh", "-c", body], env=py_env()
            )
            deadline = time.monotonic() + 15
            while not (ticks.exists() and ticks.read_text() and pidfile.exists() and pidfile.read_text()) or (
                proc_state(int(pidfile.read_text())) != "D"
            ):
                assert time.monotonic() < deadline, "sibling y did not start"
                await asyncio.sleep(0.01)
            a = asyncio.ensure_future(c.run([PY, script("owner.py", OWNER), str(marker)], env=py_env()))
            while not marker.exists():
                assert time.monotonic() < deadline and not a.done(), "region A was not granted"
                await asyncio.sleep(0.01)
            b = await c.run([PY, script("watcher.py", WATCHER), str(ticks)], env=py_env())
            ra = await a
            await hy.cancel(9)
    assert ra.returncode == 0 and b.returncode == 0, (ra.stderr, b.stderr)
    rep_a, got = json.loads(ra.stdout), json.loads(b.stdout)
    rep_b, moved = got["report"], got["moved"]
    assert hy.command not in rep_a.get("frozen", []), rep_a  # its late freeze never finished
    frozen_b = hy.command in rep_b.get("frozen", [])
    assert not (frozen_b and moved), f"B says it froze y, and y ran: {rep_b}"
    assert hy.command in rep_b.get("unheld", {}) and rep_b["tainted"], rep_b
