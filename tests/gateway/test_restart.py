"""The gateway dies (SIGKILL) mid-job and restarts on the same state dir: the running job is failed
and never run again, the queued one runs; a second gateway cannot share the state dir."""

from __future__ import annotations

import asyncio
import os
import signal
import sqlite3
import stat
import subprocess
import sys
import time
from pathlib import Path

from krex_async.gateway import catalog
from krex_async.gateway.jobs import JobRunner
from krex_async.gateway.limits import Limits
from krex_async.gateway.store import Store
from tests.conftest import ROOT, run_daemon

from .conftest import PY, pid_alive, start_gateway, stopped_daemon_socket


async def test_sigkill_mid_job_then_restart(gwhome: Path) -> None:
    state, scratch = gwhome / "gw", gwhome / "scratch"
    async with run_daemon() as daemon:
        gw = start_gateway(daemon.socket, state, "--max-running", "1")
        c = gw.client()
        try:
            running = await c.dev(f"echo run >> {scratch}/runs; echo $$ > {scratch}/pid; exec sleep 60")
            queued = await c.dev("echo queued-ran")
            for _ in range(200):
                if (scratch / "pid").exists() and (scratch / "pid").read_text().strip():
                    break
                await asyncio.sleep(0.05)
            pid = int((scratch / "pid").read_text())
            assert (await c.get(queued["job_id"]))["status"] == "queued"
        finally:
            await c.close()
        gw.stop(signal.SIGKILL)
        gw = start_gateway(daemon.socket, state, "--max-running", "1")
        c = gw.client()
        try:
            # The command is gone: the daemon ends an agent's commands when it disconnects, and
            # the new gateway kills what a dead one left running.
            for _ in range(100):
                if not pid_alive(pid):
                    break
                await asyncio.sleep(0.05)
            assert not pid_alive(pid)
            view = await c.get(running["job_id"])
            assert view["status"] == "failed" and view["error"]["reason"] == "gateway_restarted"
            done = await c.wait(queued["job_id"], 30)
            assert done["status"] == "succeeded" and done["result"]["stdout"] == "queued-ran\n"
            await asyncio.sleep(0.3)
            assert (scratch / "runs").read_text() == "run\n"  # never run twice
            assert (await c.get(running["job_id"]))["status"] == "failed"

            # The second gateway is refused before it touches the first one's state (its modes).
            (state / "bin").chmod(0o700)
            second = subprocess.run(
                [
                    PY,
                    "-m",
                    "krex_async.gateway",
                    "--listen",
                    "127.0.0.1:0",
                    "--state-dir",
                    str(state),
                    "--socket",
                    daemon.socket,
                ],
                capture_output=True,
                text=True,
                timeout=30,
                env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
            )
            assert second.returncode == 2 and "in use" in second.stderr
            assert stat.S_IMODE((state / "bin").stat().st_mode) == 0o700
            (state / "bin").chmod(0o755)
        finally:
            await c.close()
            gw.stop()


def _serve(sock: str, state: Path) -> subprocess.Popen[bytes]:
    os.makedirs(os.path.dirname(sock), exist_ok=True)  # run_daemon removed it; serve makes none
    return subprocess.Popen(
        [sys.executable, "-m", "krex_async", "serve", "--socket", sock, "--state-dir", str(state)],
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


async def test_queued_jobs_wait_for_the_daemon(tmp_path: Path, gwhome: Path) -> None:
    """With no daemon the gateway serves and queues; jobs run once the daemon is there."""
    sock = await stopped_daemon_socket()
    gw = start_gateway(sock, gwhome / "gw")
    c = gw.client()
    try:
        job = await c.dev("echo late")
        await asyncio.sleep(1.0)
        assert (await c.get(job["job_id"]))["status"] == "queued"
        env = (await c.env())["env"][0]
        assert "krex daemon" in (env["probe_error"] or "")
        proc = _serve(sock, tmp_path / "dstate")
        try:
            view = await c.wait(job["job_id"], 30)
            assert view["status"] == "succeeded" and view["result"]["stdout"] == "late\n"
        finally:
            proc.terminate()
            proc.wait(15)
    finally:
        await c.close()
        gw.stop()


async def test_a_claim_removes_what_a_requeue_left_of_the_job_dir(tmp_path: Path, gwhome: Path) -> None:
    """A fleet job put back in the queue may leave part of its dir (its removal could fail):
    claimed again, the job starts in a fresh dir; before, mkdir raised FileExistsError and the job
    failed. A link left in it is removed, not followed."""
    sock = await stopped_daemon_socket()
    gw = start_gateway(sock, gwhome / "gw")
    c = gw.client()
    try:
        job = await c.dev("ls -A")
        await asyncio.sleep(0.5)
        assert (await c.get(job["job_id"]))["status"] == "queued"
        left = gwhome / "gw" / "jobs" / job["job_id"]
        (left / ".torch_extensions" / "x").mkdir(parents=True)
        (left / "stale").write_text("from the first claim")
        keep = gwhome / "scratch" / "keep"
        keep.write_text("not the job's")
        (left / "link").symlink_to(keep)
        proc = _serve(sock, tmp_path / "dstate")
        try:
            view = await c.wait(job["job_id"], 30)
            assert view["status"] == "succeeded", view
            assert "stale" not in view["result"]["stdout"] and "link" not in view["result"]["stdout"]
            assert keep.read_text() == "not the job's"
        finally:
            proc.terminate()
            proc.wait(15)
    finally:
        await c.close()
        gw.stop()


async def test_sigterm_fails_the_running_job_and_ends_its_command(gwhome: Path) -> None:
    state, scratch = gwhome / "gw", gwhome / "scratch"
    async with run_daemon() as daemon:
        gw = start_gateway(daemon.socket, state)
        c = gw.client()
        poller = gw.client()
        try:
            job = await c.dev(f"echo $$ > {scratch}/pid; exec sleep 60")
            for _ in range(200):
                if (scratch / "pid").exists() and (scratch / "pid").read_text().strip():
                    break
                await asyncio.sleep(0.05)
            pid = int((scratch / "pid").read_text())
            poll = asyncio.ensure_future(poller.get(job["job_id"], wait=True, timeout=60))
            await asyncio.sleep(0.3)
            assert not poll.done()
            t = time.monotonic()
            assert await asyncio.to_thread(gw.stop, signal.SIGTERM, 10) == 0
            assert time.monotonic() - t < 5
            # The long poll answered at shutdown instead of being cut off.
            assert (await asyncio.wait_for(poll, 5))["status"] in ("running", "failed")
            assert not pid_alive(pid)
        finally:
            await c.close()
            await poller.close()
        gw = start_gateway(daemon.socket, state)
        c = gw.client()
        try:
            view = await c.get(job["job_id"])
            assert view["status"] == "failed" and view["error"]["reason"] == "gateway_stopped"
        finally:
            await c.close()
            gw.stop()


async def test_a_store_error_while_claiming_does_not_end_the_claim_loop(tmp_path: Path) -> None:
    """A claim that fails (the database locked past its timeout, a full disk) is tried again a
    second later: before, the loop task died with it and every later job stayed queued."""

    class Flaky(Store):
        failures = 1

        def claim(self):  # type: ignore[no-untyped-def]
            if self.failures:
                self.failures -= 1
                raise sqlite3.OperationalError("database is locked")
            return super().claim()

    store = Flaky(tmp_path / "jobs.db")
    kinds, _ = catalog.build(Limits(), frozenset(["local"]), None, sys.executable)
    async with run_daemon() as daemon:
        runner = JobRunner(store, tmp_path / "jobs", Limits(), daemon.socket, kinds, lambda _j: None)
        (tmp_path / "jobs").mkdir()
        job, _ = store.create(
            "dev",
            kinds["dev"].validate({"command": "true", "spec": {"target_hardware": ["local"]}})[0],
            "t",
            None,
            None,
        )
        runner.start()
        try:
            async with asyncio.timeout(10):
                while store.status(job["job_id"]) == "queued":
                    await asyncio.sleep(0.05)
            assert store.failures == 0  # the first claim failed; the loop claimed again
        finally:
            await runner.stop()
            store.close()
