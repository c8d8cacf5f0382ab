"""`krex gateway --fleet ADDRESS`: the agate jobs API in front of the local Ray fleet."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from krex_async.gateway.client import GatewayClient
from tests.conftest import until
from tests.security.helpers import USER_PYTHONPATH

from ..gateway.conftest import JOB_USER, SOCKET_GROUP, gateway_home, job_python
from .conftest import NEEDS_RAY, PY, env

pytestmark = pytest.mark.slow
pytest.importorskip("ray", reason=NEEDS_RAY)
from krex_async.fleet.local import LocalFleet  # noqa: E402


def start(state: Path, *args: str) -> tuple[subprocess.Popen[bytes], str, Path]:
    """`python -m krex_async gateway ...` (the flag is krex's, not the bare gateway module's);
    returns once gateway.json names its pid. As root its jobs run as the gateway tests' job user."""
    state.mkdir(parents=True)
    log = state.parent / "gateway.log"
    if os.geteuid() == 0:
        args = (*args, "--run-as", JOB_USER, "--job-python", job_python())
    e = env()
    e["PYTHONPATH"] = os.pathsep.join([USER_PYTHONPATH, e.get("PYTHONPATH", "")])
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "krex_async",
                "gateway",
                "--listen",
                "127.0.0.1:0",
                "--state-dir",
                str(state),
                *args,
            ],
            stdout=f,
            stderr=subprocess.STDOUT,
            env=e,
        )
    deadline = time.monotonic() + 60
    while True:
        try:
            meta = json.loads((state / "gateway.json").read_text())
            if meta["pid"] == proc.pid:
                return proc, meta["url"], log
        except (OSError, ValueError, KeyError):
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"gateway did not start: {log.read_text()}")
        time.sleep(0.05)


def token(state: Path) -> str:
    """The bearer token the gateway generated at its first start."""
    return (state / "token").read_text().split()[-1]


@pytest.fixture
def stack() -> Iterator[contextlib.ExitStack]:
    with contextlib.ExitStack() as s:
        yield s


async def test_gateway_runs_jobs_on_every_node(local_fleet: LocalFleet, stack: contextlib.ExitStack) -> None:
    assert local_fleet.cluster is not None
    async with await local_fleet.connect():  # the agents (and their daemons) exist first
        pass
    home = stack.enter_context(gateway_home())  # a state dir the jobs' user can pass through
    proc, url, log = start(
        home / "gw", "--fleet", str(local_fleet.cluster.address), "--ray-token-file", local_fleet.token_file
    )
    try:
        async with GatewayClient(url, token(home / "gw")) as c:
            view = (await c.env(force=True))["env"][0]
            keys = sorted(d["key"] for d in view["devices"])
            assert keys == [f"node{i}/cpu{j}" for i in range(3) for j in range(2)], (
                view["probe_error"],
                view,
            )
            jobs = [await c.dev("sleep 1; python -c 'import krex_async; print(\"ran\")'") for _ in range(6)]
            done = await asyncio.gather(*(c.wait(j["job_id"], 60) for j in jobs))
            assert [d["status"] for d in done] == ["succeeded"] * 6, done
            assert all(d["result"]["stdout"] == "ran\n" for d in done)
            nodes = {d["krex_command"].split("/")[0] for d in done}
            assert nodes == {"node0", "node1", "node2"}, [d["krex_command"] for d in done]

            # A job whose node's daemon dies fails as daemon_lost, naming the node.
            job = await c.dev("sleep 10")
            deadline = time.monotonic() + 20
            while not (view := await c.get(job["job_id"])).get("krex_command"):
                assert time.monotonic() < deadline, view
                await asyncio.sleep(0.1)
            node = view["krex_command"].split("/")[0]
            async with await local_fleet.connect() as fc:
                os.kill((await fc.capacity())[node]["daemon_pid"], signal.SIGKILL)
            lost = await c.wait(job["job_id"], 30)
            assert lost["status"] == "failed", lost
            assert lost["error"]["reason"] == "daemon_lost", lost
            assert f"node {node}" in lost["error"]["message"], lost
            # What the Atrex client prints (stdout, stderr) says why, not only the job's error.
            assert f"krex: the job failed: node {node}" in lost["result"]["stderr"], lost
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, log.read_text()
    assert "fleet" in log.read_text()


async def test_gateway_jobs_wait_while_no_fleet_node_is_up(
    local_fleet: LocalFleet, stack: contextlib.ExitStack
) -> None:
    """Every node's daemon stopped (SIGSTOP: it answers nothing): a job submitted then stays queued,
    its view and /v1/env saying why, and runs once the nodes answer again; it is not failed."""
    assert local_fleet.cluster is not None
    async with await local_fleet.connect() as fc:
        pids = [c["daemon_pid"] for c in (await fc.capacity()).values()]
    assert len(pids) == 3 and all(pids), pids
    home = stack.enter_context(gateway_home())
    proc, url, log = start(
        home / "gw", "--fleet", str(local_fleet.cluster.address), "--ray-token-file", local_fleet.token_file
    )
    try:
        async with GatewayClient(url, token(home / "gw")) as c:
            warm = await c.dev("echo warm")
            assert (await c.wait(warm["job_id"], 60))["status"] == "succeeded"
            for pid in pids:
                os.kill(pid, signal.SIGSTOP)
            try:
                # The gateway's refresher finds every node silent within STATUS_S (5 s) of a tick.
                await asyncio.sleep(9)
                job = await c.dev("echo back")
                await asyncio.sleep(3)
                view = await c.get(job["job_id"])
                assert view["status"] == "queued", view
                waiting = view["waiting"]
                assert waiting.startswith("waiting for a fleet node: no node of the fleet is up"), view
                assert "node0: no capacity report" in waiting, view
                probe = (await c.env())["env"][0]["probe_error"]
                assert "waiting for a fleet node: no node of the fleet is up" in probe, probe
            finally:
                for pid in pids:
                    os.kill(pid, signal.SIGCONT)
            done = await c.wait(job["job_id"], 60)
            assert done["status"] == "succeeded" and done["result"]["stdout"] == "back\n", done
            assert "waiting" not in done
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, log.read_text()


async def test_gateway_fleet_unreachable_says_so(stack: contextlib.ExitStack) -> None:
    """No Ray cluster at the address: the gateway serves, /v1/env names the failure, jobs wait
    queued (as with a daemon that is down), and SIGTERM ends it cleanly."""
    from krex_async.fleet.auth import create_token

    home = stack.enter_context(gateway_home())
    ray_token = create_token(str(home / "ray" / "token"))
    proc, url, log = start(home / "gw", "--fleet", "127.0.0.1:1", "--ray-token-file", ray_token)
    try:
        async with GatewayClient(url, token(home / "gw")) as c:
            view = (await c.env())["env"][0]
            assert "no Ray cluster at '127.0.0.1:1'" in view["probe_error"], view
            job = await c.dev("echo hi")
            await asyncio.sleep(1.5)
            assert (await c.get(job["job_id"]))["status"] == "queued"
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, log.read_text()


async def test_fleet_status_shows_each_nodes_capacity(local_fleet: LocalFleet) -> None:
    assert local_fleet.cluster is not None
    async with await local_fleet.connect() as fc:
        h = await fc.submit([PY, "-c", "import time; time.sleep(20)"], env=env(), node="node2", device="cpu1")
        try:
            r = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "krex_async",
                    "fleet",
                    "status",
                    "--json",
                    "--address",
                    str(local_fleet.cluster.address),
                    "--ray-token-file",
                    local_fleet.token_file,
                ],
                capture_output=True,
                text=True,
                env=env(),
                timeout=60,
            )
            assert r.returncode == 0, r.stderr
            cap = json.loads(r.stdout)
            assert sorted(cap) == ["node0", "node1", "node2"]
            assert cap["node2"]["running"] + cap["node2"]["queued"] == 1
            assert cap["node2"]["devices"][1]["commands"] == [h.daemon_command]
            assert all(c["up"] and len(c["devices"]) == 2 for c in cap.values())
            assert cap["node2"]["devices"][1]["memory_free_bytes"] > 0
        finally:
            await h.cancel(signal.SIGKILL)
            await h.wait()


# A fleet of its own (this process joined the package's cluster): one node whose daemon runs one
# command at a time, so a second job waits in that daemon's queue.
COMMAND_FLEET = """
import asyncio, sys
from krex_async.fleet.local import LocalFleet

async def main():
    args = ("--devices", "cpu:1", "--policy", "command")
    fleet = LocalFleet(1, daemon_args=args, run_as=sys.argv[1], socket_group=sys.argv[2])
    try:
        address = fleet.start()
        async with await fleet.connect() as fc:  # its agent starts the node's daemon
            agent = await fc.agents["node0"].hello.remote()
        print(address, fleet.token_file, agent["pid"], flush=True)
        await asyncio.to_thread(sys.stdin.read)  # until the test closes our stdin
    finally:
        fleet.close()

asyncio.run(main())
"""


@pytest.fixture(scope="module")
def command_fleet() -> Iterator[tuple[str, str, int]]:
    """COMMAND_FLEET's address, token file and node agent's pid; its helper's log beside it in a
    temporary directory."""
    with tempfile.TemporaryDirectory(prefix="krex-cmdfleet-", dir="/tmp") as tmp:
        log = Path(tmp) / "fleet.log"
        with open(log, "wb") as err:
            helper = subprocess.Popen(
                [sys.executable, "-c", COMMAND_FLEET, JOB_USER, SOCKET_GROUP],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                env=env(),
            )
        assert helper.stdin is not None and helper.stdout is not None
        try:
            line = helper.stdout.readline().decode().split()
            assert len(line) == 3, log.read_text()
            yield line[0], line[1], int(line[2])
        finally:
            helper.stdin.close()  # it stops its fleet
            try:
                helper.wait(60)
            except subprocess.TimeoutExpired:
                helper.kill()
                helper.wait()


async def test_gateway_queue_timeout_withdraws_a_job_queued_on_its_node(
    command_fleet: tuple[str, str, int], stack: contextlib.ExitStack
) -> None:
    """--queue-timeout over a fleet as over one daemon: a job its node's daemon queued is cancelled
    there at its deadline (queue_timeout, result null); the one that started is not touched."""
    home = stack.enter_context(gateway_home())
    address, token_file, _ = command_fleet
    proc, url, log = start(
        home / "gw",
        *("--fleet", address, "--ray-token-file", token_file),
        *("--queue-timeout", "3", "--max-running", "3"),
    )
    try:
        async with GatewayClient(url, token(home / "gw")) as c:
            long = await c.dev(f"touch {home}/scratch/long; sleep 6")
            deadline = time.monotonic() + 30
            while not (home / "scratch" / "long").exists():
                assert time.monotonic() < deadline, await c.get(long["job_id"])
                await asyncio.sleep(0.1)
            stuck = await c.dev(f"touch {home}/scratch/stuck")
            view = await c.wait(stuck["job_id"], 30)
            assert view["status"] == "failed" and view["error"]["reason"] == "queue_timeout", view
            assert view["result"] is None and "node0/cpu0" in view["error"]["message"], view
            assert (await c.wait(long["job_id"], 30))["status"] == "succeeded"
            await asyncio.sleep(0.5)
            assert not (home / "scratch" / "stuck").exists()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, log.read_text()


async def test_a_fleet_job_queued_on_its_node_is_timed_from_its_start(
    command_fleet: tuple[str, str, int], stack: contextlib.ExitStack
) -> None:
    """A job's timeout runs from its command's start, heard from its node's agent: not the
    daemon's backstop (timeout + 7 s) for a command that waited in that node's queue."""
    home = stack.enter_context(gateway_home())
    address, token_file, _ = command_fleet
    proc, url, log = start(
        home / "gw", "--fleet", address, "--ray-token-file", token_file, "--max-running", "3"
    )
    try:
        async with GatewayClient(url, token(home / "gw")) as c:
            first = await c.dev(f"touch {home}/scratch/first; sleep 2")
            deadline = time.monotonic() + 30
            while not (home / "scratch" / "first").exists():
                assert time.monotonic() < deadline, await c.get(first["job_id"])
                await asyncio.sleep(0.1)
            t = time.monotonic()
            late = await c.dev("sleep 30", timeout_s=1)
            view = await c.wait(late["job_id"], 40)
            took = time.monotonic() - t
            assert view["status"] == "failed" and view["error"]["reason"] == "command_timeout", view
            assert took < 6.5, took  # ~2 s queued, 1 s run, SIGTERM; the backstop ends it at ~10 s
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, log.read_text()


async def test_a_job_on_a_node_whose_agent_dies_is_failed_saying_why_or_queued_again(
    command_fleet: tuple[str, str, int], stack: contextlib.ExitStack
) -> None:
    """The node's agent is killed (SIGKILL) while one job runs there and another waits in its
    daemon's queue: the running one fails, its reason in the job's error and in the stderr that the
    Atrex client prints; the queued one (it never started, so never reached its region) is queued
    again, says so in its result, and runs once the node is back: the node's new agent reaches the
    node's daemon where its predecessor did (not the default socket). Last in this module: it kills
    the helper fleet's agent."""
    address, token_file, agent_pid = command_fleet
    home = stack.enter_context(gateway_home())
    proc, url, log = start(
        home / "gw", "--fleet", address, "--ray-token-file", token_file, "--max-running", "3"
    )
    try:
        async with GatewayClient(url, token(home / "gw")) as c:
            running = await c.dev(f"echo partial; touch {home}/scratch/running; sleep 60")
            await until(lambda: (home / "scratch" / "running").exists(), "the first job runs")
            queued = await c.dev(f"touch {home}/scratch/queued; echo second")
            deadline = time.monotonic() + 30
            while not (view := await c.get(queued["job_id"])).get("krex_command"):
                assert time.monotonic() < deadline, view
                await asyncio.sleep(0.1)
            assert not (home / "scratch" / "queued").exists()  # waiting in the node's daemon
            os.kill(agent_pid, signal.SIGKILL)

            lost = await c.wait(running["job_id"], 60)
            assert lost["status"] == "failed" and lost["error"]["reason"] == "daemon_lost", lost
            assert "node node0: its agent" in lost["error"]["message"], lost
            assert lost["result"]["stdout"] == "partial\n", lost
            assert "krex: the job failed: node node0: its agent" in lost["result"]["stderr"], lost

            done = await c.wait(queued["job_id"], 120)
            assert done["status"] == "succeeded" and done["result"]["stdout"] == "second\n", done
            requeued = done["result"]["krex"]["requeued"]
            assert len(requeued) == 1 and "node node0" in requeued[0], done
            assert "had not started there: queued again" in requeued[0], done
            assert done["krex_command"].startswith("node0/"), done  # the node, used again
            again = await c.wait((await c.dev("echo again"))["job_id"], 60)
            assert again["status"] == "succeeded" and again["result"]["stdout"] == "again\n", again
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, log.read_text()


async def test_gateway_fleet_without_a_usable_token_file_says_so(stack: contextlib.ExitStack) -> None:
    """--fleet joins only with Ray's token: none there, or one others can read, is named as the
    reason jobs wait (the gateway serves on), before any connection is tried."""
    home = stack.enter_context(gateway_home())
    loose = home / "loose-token"
    loose.write_text("x" * 64)
    loose.chmod(0o644)
    for i, (token_file, why) in enumerate(
        ((home / "none", "cannot be read"), (loose, "is readable by others"))
    ):
        state = home / f"gw{i}"
        proc, url, log = start(state, "--fleet", "127.0.0.1:1", "--ray-token-file", str(token_file))
        try:
            async with GatewayClient(url, token(state)) as c:
                view = (await c.env())["env"][0]
                assert f"the Ray token file {str(token_file)!r} {why}" in view["probe_error"], view
        finally:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(30) == 0, log.read_text()
