"""Ctrl-C on a command that a region holds frozen ends it at once (SIGKILL where it stands, never
thawed into the region) and `krex run` says why; one that is not held still gets the polite SIGINT."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import pytest

from ..conftest import PY, py_env, run_daemon

HOLDER = """
import os, sys, time
from krex_async import region
with region("timing") as r:
    print("in", flush=True)
    deadline = time.monotonic() + 30
    while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:
        time.sleep(0.05)
print("released", r.report.outcome, flush=True)
"""


async def _krex_run(socket: str, *argv: str, **env: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        PY,
        "-m",
        "krex_async",
        "run",
        "--",
        *argv,
        env=py_env(KREX_SOCKET=socket, **env),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )


async def _until(c: object, pred: object, what: str, timeout: float = 15) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        st = await c.status()  # type: ignore[attr-defined]
        if pred(st):  # type: ignore[operator]
            return st
        assert time.monotonic() < deadline, f"{what}: {st['commands']}"
        await asyncio.sleep(0.1)


@pytest.mark.parametrize("isolation", ["cgroup", "signal"])
async def test_ctrl_c_ends_a_frozen_sibling_at_once_and_a_running_one_politely(
    script, tmp_path: Path, isolation: str
):
    release = tmp_path / "release"
    async with run_daemon("--isolation", isolation, "--freeze", "all", "--region-timeout", "60") as d:
        async with await d.client() as c:
            owner = await c.submit([PY, script("hold.py", HOLDER), str(release)], env=py_env())
            async for _, data in owner.output():
                assert data.startswith(b"in"), data
                break
            sib = await _krex_run(d.socket, "sleep", "100")
            await _until(
                c,
                lambda st: any(x["argv"][0] == "sleep" and x["frozen"] for x in st["commands"]),
                "the sibling was never frozen",
            )
            t0 = time.monotonic()
            sib.send_signal(signal.SIGINT)  # Ctrl-C, as a terminal sends it to krex run
            out, err = await asyncio.wait_for(sib.communicate(), 10)
            took = time.monotonic() - t0
            # ended while the region still holds the device, not when it ends (30 s away)
            assert sib.returncode == 128 + signal.SIGKILL, (sib.returncode, err)
            assert took < 5, took
            assert b"frozen by region 'timing'" in err and b"SIGINT" in err, err
            assert b"Traceback" not in err, err
            st = await c.status()
            assert [x["state"] for x in st["commands"] if x["command"] == owner.command] == ["running"]
            assert st["devices"][0]["region"]["command"] == owner.command
            release.touch()
            res = await asyncio.wait_for(owner.wait(), 15)
            assert res.report.exit_code == 0 and [r.outcome for r in res.report.regions] == ["released"]
            assert b"released released" in res.stdout, res.stdout

            # No region now: Ctrl-C is passed on as SIGINT, as running the command directly would.
            calm = await _krex_run(d.socket, "sleep", "100")
            await _until(
                c,
                lambda st: any(x["argv"][0] == "sleep" and x["state"] == "running" for x in st["commands"]),
                "the command never ran",
            )
            calm.send_signal(signal.SIGINT)
            _, err = await asyncio.wait_for(calm.communicate(), 10)
            assert calm.returncode == 128 + signal.SIGINT, (calm.returncode, err)
            assert err == b"", err

            # A region's owner is not held (its shell is frozen, the process in the region runs):
            # Ctrl-C reaches it as SIGINT and ends the region at once.
            release.unlink()
            hold = script("hold.py", HOLDER)
            own = await _krex_run(d.socket, "sh", "-c", f"{PY} {hold} {release}; true")
            assert own.stdout is not None
            assert (await asyncio.wait_for(own.stdout.readline(), 20)) == b"in\n"
            t0 = time.monotonic()
            own.send_signal(signal.SIGINT)
            _, err = await asyncio.wait_for(own.communicate(), 10)
            assert own.returncode == 128 + signal.SIGINT and time.monotonic() - t0 < 5, (own.returncode, err)
            assert b"KeyboardInterrupt" in err and b"SIGKILL" not in err, err
        assert '"level": "error"' not in d.logs(), d.logs()  # the killed group went, the region thawed


# A sibling whose runtime never acks the quiesce: it runs through the entry's --quiesce-timeout,
# asks for a region of its own meanwhile (queued behind the owner's), and is then frozen.
# It is the process's only runtime: KREX_QUIESCE_SIGNAL that names no signal keeps krex's own
# listener from starting, whose quiesce_ready would otherwise race this one for the process's
# place in the command (the later one wins), take the Quiesce, and leave the asker silent.
ASKER = """
import os, socket, struct, sys
from krex_async.runtime.quiesce import frame, unpack
s = socket.socket(socket.AF_UNIX)
s.connect(os.environ["KREX_SOCKET"])
s.sendall(frame({"type": "hello", "id": 1, "version": 1, "role": "command", "client": "asker"}))
s.sendall(frame({"type": "quiesce_ready", "id": 2, "command": os.environ["KREX_COMMAND"],
                 "token": os.environ["KREX_TOKEN"], "pid": os.getpid()}))
print("ready", flush=True)
while True:
    (n,) = struct.unpack(">I", s.recv(4, socket.MSG_WAITALL))
    if unpack(s.recv(n, socket.MSG_WAITALL)).get("type") == "quiesce":
        break
print("asking", flush=True)
from krex_async import region
with region("second"):
    pass
"""


async def test_ctrl_c_ends_a_frozen_sibling_whose_own_region_is_queued(script, tmp_path: Path):
    """A sibling frozen while its own region waits its turn (agents that loop on regions ask again
    as the last one ends) is held like any other: its Ctrl-C ends it at once, not after the region."""
    release = tmp_path / "release"
    args = ("--isolation", "cgroup", "--freeze", "all", "--quiesce", "all", "--quiesce-timeout", "2")
    async with run_daemon(*args, "--region-timeout", "60") as d:
        async with await d.client() as c:
            sib = await _krex_run(d.socket, PY, script("asker.py", ASKER), KREX_QUIESCE_SIGNAL="none")
            assert sib.stdout is not None
            assert (await asyncio.wait_for(sib.stdout.readline(), 20)) == b"ready\n"
            owner = await c.submit([PY, script("hold.py", HOLDER), str(release)], env=py_env())
            assert (await asyncio.wait_for(sib.stdout.readline(), 20)) == b"asking\n"
            async for _, data in owner.output():
                assert data.startswith(b"in"), data
                break
            await _until(
                c,
                lambda st: any(x["command"] != owner.command and x["frozen"] for x in st["commands"]),
                "the sibling was never frozen",
            )
            t0 = time.monotonic()
            sib.send_signal(signal.SIGINT)
            _, err = await asyncio.wait_for(sib.communicate(), 10)
            assert sib.returncode == 128 + signal.SIGKILL and time.monotonic() - t0 < 5, (sib.returncode, err)
            assert b"frozen by region 'timing'" in err, err
            release.touch()
            res = await asyncio.wait_for(owner.wait(), 15)
            assert res.report.exit_code == 0, res.report


# The owner submits a sibling and ends its region in one write, so the sibling is admitted frozen
# into the region (still current when its start begins) and the region ends while the sibling's
# start waits on its cgroup's intent record (an fsync on a worker thread); the cancel, sent as
# Accepted comes back, lands in that start. The sibling is thawed as its start ends: nothing holds
# it any more, so the cancel is the polite SIGINT, not the SIGKILL of a held command.
ENDS_AS_SIBLING_STARTS = """
import os, socket, sys
from krex_async import protocol as P
s = socket.socket(socket.AF_UNIX)
s.connect(os.environ["KREX_SOCKET"])
cmd, token = os.environ["KREX_COMMAND"], os.environ["KREX_TOKEN"]
buf = bytearray()
def reply():
    global buf
    while True:
        if len(buf) >= 4:
            (n,) = P.HEADER.unpack(buf[:4])
            if len(buf) >= 4 + n:
                msg, buf = P.decode_reply(bytes(buf[4:4 + n])), buf[4 + n:]
                return msg
        data = s.recv(65536)
        assert data, "the daemon closed the connection"
        buf += data
s.sendall(P.encode(P.Hello(id=0, role="command")))
assert isinstance(reply(), P.Welcome)
s.sendall(P.encode(P.RegionEnter(id=1, command=cmd, token=token, name="timing", pid=os.getpid())))
granted = reply()
assert isinstance(granted, P.RegionGranted), granted
sibling = P.Submit(id=2, argv=["sleep", "100"], on_disconnect="keep")
s.sendall(P.encode(sibling) + P.encode(P.RegionExit(id=3, region=granted.report.region, token=token)))
while not isinstance(msg := reply(), P.Accepted):
    pass
s.sendall(P.encode(P.Cancel(id=4, command=msg.command, signal=2)))
while not isinstance(msg := reply(), P.Exited):
    pass
print(msg.report.signal, msg.report.error, flush=True)
"""


async def test_a_cancel_while_starting_into_a_region_that_ended_meanwhile_is_polite(script):
    """The sibling's start was admitted frozen into a region that ended before the cancel was
    acted on: it is thawed, not held, so the cancel reaches it as SIGINT, as it would any command
    no region holds."""
    owner = script("owner.py", ENDS_AS_SIBLING_STARTS)
    async with run_daemon("--isolation", "cgroup", "--freeze", "all", "--region-timeout", "60") as d:
        async with await d.client() as c:
            for i in range(5):
                res = await asyncio.wait_for(c.run([PY, owner], env=py_env()), 30)
                assert res.report.exit_code == 0, (i, res.report, res.stderr)
                assert res.stdout.split(b" ", 1)[0] == b"%d" % signal.SIGINT, (i, res.stdout)
