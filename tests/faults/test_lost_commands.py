"""SIGKILL of the daemon while a user's command runs: a new daemon on the same socket and state dir
ends what is left of the command and reports it (state `lost`, with the output its spool holds) to
that user only. Agents run as real other users (tests/security/helpers.py), on both backends."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator

import pytest

from krex_async import Client

from ..conftest import PY, ROOT, private_cgroup_root, proc_state, py_env, remove_cgroup_tree, stop_all
from ..security.helpers import LAUNCH, User, make_users, python_as, user_env
from .test_daemon_death import tree

AGENT = r"""
import asyncio, json, sys
from krex_async import Client, KrexError

async def main(path, action, arg):
    async with await Client.connect(path) as c:
        try:
            if action == "keep":
                h = await c.submit(["/bin/sh", "-c", arg], on_disconnect="keep",
                                   env=json.loads(sys.stdin.read()))
                async for _ in h.output():  # the first line is out: the command runs
                    break
                print(json.dumps({"command": h.command}))
            elif action == "read":
                try:
                    print(json.dumps({"read": open(arg, "rb").read().decode()}))
                except OSError as e:
                    print(json.dumps({"read": type(e).__name__}))
            elif action == "attach":
                res = await (await c.attach(arg)).wait()
                try:
                    spooled = open(res.report.stdout_spool).read()
                except OSError as e:
                    spooled = type(e).__name__
                print(json.dumps({"state": res.report.state, "error": res.report.error,
                                  "stdout": res.stdout.decode(), "spooled": spooled}))
        except KrexError as e:
            print(json.dumps({"code": e.code}))

asyncio.run(main(*sys.argv[1:]))
"""

COMMAND = "echo first-line; sleep 60 & sleep 60; wait"


@pytest.fixture(scope="module")
def users() -> Iterator[dict[str, User]]:
    yield from make_users()


def agent(user: User, path: str, action: str, arg: str) -> dict[str, str]:
    return json.loads(python_as(user, AGENT, path, action, arg, input=json.dumps(user_env())))


def launch(cfg: dict[str, object], log: str) -> subprocess.Popen[bytes]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("KREX_SOCKET", None)
    with open(log, "ab") as f:
        return subprocess.Popen(
            [PY, "-c", LAUNCH, json.dumps(cfg)], stdout=f, stderr=subprocess.STDOUT, env=env
        )


async def until_serving(proc: subprocess.Popen[bytes], sock: str, log: str) -> None:
    """Until a client gets an answer (a dead daemon's socket file may already be there)."""
    deadline = time.monotonic() + 20
    while True:
        assert proc.poll() is None, open(log).read()
        with contextlib.suppress(Exception):
            async with await Client.connect(sock, timeout=1) as c:
                await c.status()
                return
        assert time.monotonic() < deadline, open(log).read()
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("isolation", ["signal", "cgroup"])
async def test_a_dead_daemons_command_is_ended_and_reported_lost_to_its_owner(users, isolation):
    cg = None
    if isolation == "cgroup":
        cg = private_cgroup_root()
        if cg is None:
            pytest.skip("the cgroup backend needs root and a cgroup v2 mount")
    alice, mallory = users["alice"], users["mallory"]
    d = tempfile.mkdtemp(prefix="krexl-", dir="/tmp")
    os.chmod(d, 0o755)
    sock, log = os.path.join(d, "s"), os.path.join(d, "daemon.log")
    cfg: dict[str, object] = {
        "socket": sock,
        "state_dir": os.path.join(d, "state"),
        "log_format": "json",
        "isolation": isolation,
        "probes": "off",
        "socket_group": "krexg",
        "retention": 30,
    }
    if cg is not None:
        cfg["cgroup_root"] = cg
    procs = [launch(cfg, log)]
    pids: list[int] = []
    try:
        await until_serving(procs[0], sock, log)
        cid = (await asyncio.to_thread(agent, alice, sock, "keep", COMMAND))["command"]
        async with await Client.connect(sock) as root:
            leader = next(c["pid"] for c in (await root.status())["commands"] if c["command"] == cid)
        pids = tree(leader)
        assert len(pids) >= 3, pids  # sh and its two sleeps
        spool = os.path.join(d, "state", "spool", f"{cid}.stdout")
        deadline = time.monotonic() + 5  # the writer thread queues behind the stream by a moment
        while not os.path.exists(spool) or os.path.getsize(spool) < len("first-line\n"):
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        procs[0].kill()  # SIGKILL: no shutdown path runs
        procs[0].wait()
        assert all(proc_state(p) not in (None, "Z") for p in pids)  # orphaned, still running
        procs.append(launch(cfg, log))
        t0 = time.monotonic()
        await until_serving(procs[1], sock, log)
        while any(proc_state(p) not in (None, "Z") for p in pids):
            assert time.monotonic() - t0 < 5, {p: proc_state(p) for p in pids}
            await asyncio.sleep(0.02)
        got = await asyncio.to_thread(agent, alice, sock, "attach", cid)
        assert got["state"] == "lost", got
        assert f"(pid {procs[0].pid})" in got["error"] and "ended" in got["error"]
        assert got["stdout"] == "first-line\n" and got["spooled"] == "first-line\n"
        assert await asyncio.to_thread(agent, mallory, sock, "attach", cid) == {"code": "forbidden"}
        assert await asyncio.to_thread(agent, mallory, sock, "read", spool) == {"read": "PermissionError"}
        assert await asyncio.to_thread(agent, alice, sock, "read", spool) == {"read": "first-line\n"}
        async with await Client.connect(sock) as root:
            listed = [c for c in (await root.status())["commands"] if c["command"] == cid]
        assert listed and listed[0]["result"] == "lost" and listed[0]["uid"] == alice.uid
        ended = [json.loads(line) for line in open(log) if '"lost_command_ended"' in line]
        how = "in cgroup" if isolation == "cgroup" else "of session"
        assert len(ended) == 1 and how in ended[0]["action"], ended
    finally:
        stop_all(procs)
        for p in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, 9)
        shutil.rmtree(d, ignore_errors=True)
        if cg is not None:
            remove_cgroup_tree(cg)


DIES_IN_REGION = "import os\nfrom krex_async import region\nregion('timing').__enter__()\nos._exit(0)\n"


async def test_a_restart_keeps_ended_results_sweeps_stale_spools_and_forgets_at_retention():
    """A command that ended before its daemon was SIGKILLed is handed over with its real report
    (not called lost); a spool file no record names is removed at start-up; both the result and
    the lost command's files go when the new daemon's retention ends."""
    d = tempfile.mkdtemp(prefix="krexl-", dir="/tmp")
    sock, log, state = os.path.join(d, "s"), os.path.join(d, "daemon.log"), os.path.join(d, "state")
    cfg: dict[str, object] = {
        "socket": sock,
        "state_dir": state,
        "log_format": "json",
        "isolation": "signal",
        "probes": "off",
        "retention": 30,
    }
    procs = [launch(cfg, log)]
    try:
        await until_serving(procs[0], sock, log)
        async with await Client.connect(sock) as c:
            done = await c.run(["sh", "-c", "printf done"])
            # ends inside its region: the region's report joins the command's after its exit
            died = await c.run([PY, "-c", DIES_IN_REGION], env=py_env())
            assert [r.outcome for r in died.report.regions] == ["owner-died"], died.report
            h = await c.submit(["sh", "-c", "echo running; exec sleep 60"], on_disconnect="keep")
            async for _ in h.output():
                break
        spooled = os.path.join(state, "spool", f"{h.command}.stdout")
        deadline = time.monotonic() + 5  # the writer thread queues behind the stream by a moment
        while not os.path.exists(spooled) or os.path.getsize(spooled) < 8:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        procs[0].kill()
        procs[0].wait()
        stale = os.path.join(state, "spool", "00000-7.stdout")
        open(stale, "wb").close()
        procs.append(launch({**cfg, "retention": 6}, log))  # counted from each end
        await until_serving(procs[1], sock, log)
        assert not os.path.exists(stale)
        async with await Client.connect(sock) as c:
            res = await (await c.attach(done.report.command)).wait()
            assert res.report.state == "exited" and res.report.exit_code == 0
            assert res.stdout == b"done" and res.report.ended_at == done.report.ended_at
            again = await (await c.attach(died.report.command)).wait()
            assert again.report.regions == died.report.regions, again.report
            lost = await (await c.attach(h.command)).wait()
            assert lost.report.state == "lost" and lost.stdout == b"running\n"
            shown = subprocess.run(
                [PY, "-m", "krex_async", "status", "--all", "--socket", sock],
                capture_output=True,
                text=True,
                timeout=30,
                env=dict(os.environ, PYTHONPATH=str(ROOT)),
            )
            line = next(x for x in shown.stdout.splitlines() if x.startswith(h.command))
            assert line.split()[1] == "lost", shown.stdout
            # Submitting on the new daemon works, and never reuses a recovered id.
            new = await c.run(["true"])
            assert new.report.command not in (done.report.command, h.command)
        files = [
            done.report.stdout_spool,
            lost.report.stdout_spool,
            os.path.join(state, "commands", f"{h.command}.json"),
        ]
        assert all(os.path.exists(f) for f in files)
        deadline = time.monotonic() + 12
        while any(os.path.exists(f) for f in files):
            assert time.monotonic() < deadline, [f for f in files if os.path.exists(f)]
            await asyncio.sleep(0.05)
        async with await Client.connect(sock) as c:
            ids = [x["command"] for x in (await c.status())["commands"]]
            assert h.command not in ids and done.report.command not in ids
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
                p.wait(15)
        shutil.rmtree(d, ignore_errors=True)


async def test_a_reused_pid_is_never_taken_for_the_lost_commands_leader():
    """end_lost signals the recorded leader only when its start time matches the record."""
    from krex_async.daemon.persist.records import Record, end_lost, start_ticks
    from krex_async.isolation.signal import SignalBackend

    proc = subprocess.Popen(["sh", "-c", "sleep 30 & sleep 30; wait"], start_new_session=True)
    try:
        await asyncio.sleep(0.2)
        kids = [p for p in tree(proc.pid) if p != proc.pid]
        ticks = start_ticks(proc.pid)
        assert ticks is not None and len(kids) == 2
        rec = Record(
            id="00000-1",
            uid=0,
            gid=0,
            argv=["sh"],
            device="none",
            backend="signal",
            group="cmd-00000-1",
            pid=proc.pid,
            start_ticks=ticks - 1,
            started_at=0,
            daemon_pid=1,
            daemon_ticks=0,
        )
        backend = SignalBackend()
        assert await end_lost(backend, rec) == ("no processes left", [])  # another process's pid now
        assert proc.poll() is None and all(proc_state(p) not in (None, "Z") for p in kids)
        rec.start_ticks = ticks
        assert await end_lost(backend, rec) == (f"killed 3 process(es) of session {proc.pid}", [])
        assert proc.wait(5) == -9
        assert all(proc_state(p) in (None, "Z") for p in kids)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
