"""A full state disk (issue 36 item 6c), on a real small tmpfs: one caller's job that fills it makes
new work a clear 507 (never a 500 'cannot rollback'), the jobs already accepted lose nothing (a
queued one runs once space is freed), and the filler does not stay `running` after space is freed."""

from __future__ import annotations

import errno
import os
import pwd
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from krex_async.gateway import catalog
from krex_async.gateway.jobs import JobRunner
from krex_async.gateway.limits import Limits
from krex_async.gateway.store import Store, disk_full
from tests.conftest import run_daemon, until

from .conftest import JOB_USER, SOCKET_GROUP, gateway_home, start_gateway

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")


def mount_tmpfs(path: Path, size: str) -> None:
    path.mkdir(exist_ok=True)
    p = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0711", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    if p.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {p.stderr.strip()}")


@pytest.fixture
def small_fs() -> Iterator[Path]:
    with gateway_home() as home:
        fs = home / "fs"
        mount_tmpfs(fs, "12m")
        try:
            yield fs
        finally:
            subprocess.run(["umount", "-l", str(fs)], check=False)


def fill(path: Path) -> None:
    """Write zeros into `path` until the file system says ENOSPC."""
    with open(path, "wb") as f:
        try:
            while True:
                f.write(bytes(1 << 16))
                f.flush()
        except OSError:
            pass


def free(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def test_a_full_disk_under_the_store_is_disk_full_not_cannot_rollback(small_fs: Path) -> None:
    store = Store(small_fs / "jobs.db")
    try:
        store.create("dev", {"command": "true"}, "t", None, None)
        fill(small_fs / "filler")
        with pytest.raises(Exception) as got:  # noqa: PT011 - whichever error, it must say full
            for i in range(10_000):
                store.create("dev", {"command": "x" * 65536, "n": i}, "t", None, None)
        assert disk_full(got.value), repr(got.value)
        assert not store.db.in_transaction
        (small_fs / "filler").unlink()
        job, created = store.create("dev", {"command": "after"}, "t", None, None)
        assert created and store.status(job["job_id"]) == "queued"
    finally:
        store.close()


@pytest.mark.parametrize("reserve", [1 << 20, 0], ids=["reserve", "no-reserve"])
async def test_a_job_filling_the_state_disk_refuses_new_work_and_loses_nothing(
    small_fs: Path, reserve: int
) -> None:
    """With a reserve the refusal comes before the disk is full; without one (0), from the write
    that fails: the same 507 either way, and the queued job waits (is put back) rather than fails."""
    async with run_daemon("--socket-group", SOCKET_GROUP) as daemon:
        os.chmod(os.path.dirname(daemon.socket), 0o711)
        gw = start_gateway(
            daemon.socket, small_fs / "gw", "--run-as", "krextest", "--max-running", "1",
            "--min-free-space", str(reserve),
        )  # fmt: skip
        try:
            async with gw.client() as c:
                filler = await c.dev("head -c 64M /dev/zero > big; while [ -e big ]; do sleep 0.05; done")
                queued = await c.dev("echo kept")  # accepted before the disk filled: waits its turn
                big = gw.state / "jobs" / filler["job_id"] / "big"
                # full, not nearly: without a reserve the refusal comes from a write that fails, and a
                # job's record fits in what a filler still writing has left (the fresh clone of
                # session 30, under load: accepted, no "reason")
                await until(lambda: big.exists() and free(small_fs) == 0, "the filler fills the disk")
                status, body = await c.request("POST", "/v1/jobs/dev", json=c.dev_request("echo new"))
                assert (status, body["reason"]) == (507, "insufficient_storage"), (status, body)
                assert "jobs already accepted are kept" in body["message"], body
                status, _ = await c.request("GET", "/v1/jobs")
                assert status == 200  # reads still served
                assert (await c.get(queued["job_id"]))["status"] == "queued"
                big.unlink()  # space freed: the filler ends and is recorded, the queued job runs
                done = await c.wait(filler["job_id"], 60)
                assert done["status"] in ("succeeded", "failed"), done
                kept = await c.wait(queued["job_id"], 60)
                assert kept["status"] == "succeeded" and kept["result"]["stdout"] == "kept\n", kept
                again = await c.wait((await c.dev("echo again"))["job_id"], 60)
                assert again["result"]["stdout"] == "again\n", again
            assert "Traceback" not in gw.logs(), gw.logs()
        finally:
            gw.stop()


async def test_an_accepted_job_waits_for_space_and_its_verdict_is_kept_until_written(small_fs: Path) -> None:
    """Its directory meets ENOSPC before it starts: back in the queue, not failed; its verdict
    meets a full database: written once there is room, not left `running`."""

    class FullStore(Store):
        refusals = 2

        def finish(self, *a, **kw):  # type: ignore[no-untyped-def]
            if self.refusals:
                self.refusals -= 1
                raise sqlite3.OperationalError("database or disk is full")
            return super().finish(*a, **kw)

    kinds, _ = catalog.build(Limits(), frozenset(["local"]), None, sys.executable)
    dev, tries = kinds["dev"], []

    class FullDisk:
        def __getattr__(self, name: str) -> object:
            return getattr(dev, name)

        def prepare(self, request, workdir):  # type: ignore[no-untyped-def]
            tries.append(workdir.exists())
            if len(tries) <= 2:
                raise OSError(errno.ENOSPC, "No space left on device")
            return dev.prepare(request, workdir)

    store = FullStore(small_fs / "jobs.db")
    (small_fs / "jobs").mkdir(mode=0o711)
    async with run_daemon() as daemon:
        runner = JobRunner(
            store,
            small_fs / "jobs",
            Limits(),
            daemon.socket,
            {"dev": FullDisk()},
            lambda _j: None,
            run_as=pwd.getpwnam(JOB_USER).pw_uid,  # never root
        )
        request = dev.validate({"command": "echo kept", "spec": {"target_hardware": ["local"]}})[0]
        job, _ = store.create("dev", request, "t", None, None)
        runner.start()
        try:
            await until(
                lambda: store.status(job["job_id"]) == "succeeded",
                lambda: f"the job ran once there was room: {store.get(job['job_id'])}, tries {tries}",
                30,
            )
            assert len(tries) == 3 and store.refusals == 0
            assert (store.get(job["job_id"]) or {})["result"]["stdout"] == "kept\n"
        finally:
            await runner.stop()
            store.close()
