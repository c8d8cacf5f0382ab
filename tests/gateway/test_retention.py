"""Job retention: finished jobs' directories and rows go after --job-retention, running and
queued ones never; a directory that will not go (chattr +i) or a locked database is said and the
sweep goes on; at start, directories with no row are removed."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from krex_async.gateway import job_retention, retention
from krex_async.gateway.retention import Sweeper
from krex_async.gateway.store import KeyRemoved, Store
from tests.conftest import run_daemon, until, until_async
from tests.security.helpers import _ensure_user

from .conftest import SOCKET_GROUP, stack, start_gateway


async def test_finished_jobs_go_after_retention_running_and_queued_ones_stay(tmp_path: Path) -> None:
    async with stack(tmp_path, "--job-retention", "1.5", "--max-running", "1") as (_, gw, c):
        jobs = gw.state / "jobs"
        done = await c.dev("echo kept-for-now > out.txt")
        done = await c.wait(done["job_id"], 30)
        assert done["status"] == "succeeded", done
        assert (jobs / done["job_id"] / "out.txt").exists()  # kept until its retention ends
        long = await c.dev(f"touch {gw.scratch}/started; sleep 5; echo end > out.txt")
        queued = await c.dev("echo after")
        await until(lambda: (gw.scratch / "started").exists(), "the long job started", 20)
        await until(lambda: not (jobs / done["job_id"]).exists(), "the finished job's directory went", 5)
        deadline = time.monotonic() + 5
        while (got := await c.request("GET", f"/v1/jobs/{done['job_id']}"))[0] == 200:  # row: just after
            assert time.monotonic() < deadline, got
            await asyncio.sleep(0.02)
        status, body = got
        assert (status, body["reason"]) == (404, "job_not_found")
        assert done["job_id"] not in {j["job_id"] for j in await c.jobs()}
        await asyncio.sleep(1.5)  # past the retention of a job that had ended when it started
        assert (await c.get(long["job_id"]))["status"] == "running"
        assert (jobs / long["job_id"]).is_dir()
        assert (await c.get(queued["job_id"]))["status"] == "queued"
        ended = await c.wait(long["job_id"], 30)
        assert ended["status"] == "succeeded", ended
        await until(lambda: not (jobs / long["job_id"]).exists(), "the long job's directory went", 5)
        assert "cannot remove" not in gw.logs() and "sweep failed" not in gw.logs()


async def test_start_up_removes_directories_with_no_record(gwhome: Path) -> None:
    state = gwhome / "gw"
    async with run_daemon() as daemon:
        gw = start_gateway(daemon.socket, state)
        c = gw.client()
        try:
            job = await c.wait((await c.dev("echo hi > out.txt"))["job_id"], 30)
        finally:
            await c.close()
            gw.stop()
        jobs = state / "jobs"
        (jobs / "dv_0123456789ab" / "sub").mkdir(parents=True)  # its row was lost
        (jobs / "dv_0123456789ab" / "sub" / "f").write_text("x")
        (jobs / "operator-notes").mkdir()  # not a name the gateway makes: left alone
        gw = start_gateway(daemon.socket, state)
        try:
            await until(lambda: not (jobs / "dv_0123456789ab").exists(), "the orphan went", 10)
            assert (jobs / "operator-notes").is_dir()
            assert (jobs / job["job_id"] / "out.txt").exists()  # has a row, within its retention
            assert "1 job directory with no record" in gw.logs()
        finally:
            gw.stop()
        # --job-retention never: nothing is removed, not even an orphan
        (jobs / "pf_0123456789ab").mkdir()
        gw = start_gateway(daemon.socket, state, "--job-retention", "never")
        try:
            await asyncio.sleep(1.0)
            assert (jobs / "pf_0123456789ab").is_dir()
        finally:
            gw.stop()


@contextlib.contextmanager
def immutable(path: Path) -> Iterator[None]:
    """chattr +i: not even root may unlink it (the real way a removal fails)."""
    r = subprocess.run(["chattr", "+i", str(path)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"chattr +i is not available here: {r.stderr.strip()}")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=True)


async def test_sweep_survives_errors_and_spares_busy_jobs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = Store(tmp_path / "jobs.db")
    jobs = tmp_path / "jobs"
    ids = {}
    for name in ("plain", "stuck", "busy", "running", "queued"):
        job, _ = store.create("dev", {"command": name}, "t", None, None)
        ids[name] = job["job_id"]
    while (claimed := store.claim()) is not None:
        (jobs / claimed[0]).mkdir(parents=True)
        (jobs / claimed[0] / "out").write_text("x")
        if claimed[0] != ids["running"]:
            store.finish(claimed[0], "succeeded", {}, None)
    store.db.execute("UPDATE jobs SET status='queued' WHERE job_id=?", (ids["queued"],))
    busy = {ids["busy"]}  # its task still runs (a cancelled job's command ending)
    removed: list[str] = []
    sweeper = Sweeper(store, jobs, 0.2, lambda: busy, removed.extend)
    said: list[str] = []

    def err() -> str:
        said.append(capsys.readouterr().err)
        return "".join(said)

    locker = sqlite3.connect(tmp_path / "jobs.db", isolation_level=None)
    store.db.execute("PRAGMA busy_timeout=50")
    try:
        with immutable(jobs / ids["stuck"] / "out"):
            locker.execute("BEGIN EXCLUSIVE")  # the first sweeps cannot delete rows
            await asyncio.sleep(0.3)
            sweeper.start()
            await until(lambda: "sweep failed" in err(), "a failed sweep said so", 5)
            locker.execute("ROLLBACK")
            await until(lambda: store.status(ids["plain"]) is None, "the sweep went on", 5)
            await asyncio.sleep(1.2)  # more sweeps, each trying the stuck one again
            assert err().count(f"cannot remove job {ids['stuck']}") == 1, err()  # said once
            assert store.status(ids["stuck"]) == "succeeded" and (jobs / ids["stuck"]).is_dir()
        await until(lambda: store.status(ids["stuck"]) is None, "the stuck one went once it could", 5)
        assert sorted(removed) == sorted([ids["plain"], ids["stuck"]])
        assert not (jobs / ids["plain"]).exists() and not (jobs / ids["stuck"]).exists()
        for name in ("busy", "running", "queued"):
            assert (jobs / ids[name] / "out").exists() and store.status(ids[name]) is not None, name
        busy.clear()  # its task ended
        await until(lambda: store.status(ids["busy"]) is None, "the busy one went after its task", 5)
        assert not (jobs / ids["busy"]).exists() and sweeper._task is not None and not sweeper._task.done()
    finally:
        await sweeper.stop()
        locker.close()
        store.close()


def test_the_retention_flag_and_variable() -> None:
    assert job_retention(None, {}) == retention.DEFAULT == 86400
    assert job_retention("600", {"KREX_GATEWAY_JOB_RETENTION": "5"}) == 600
    assert job_retention(None, {"KREX_GATEWAY_JOB_RETENTION": "5"}) == 5
    assert job_retention(None, {"KREX_GATEWAY_JOB_RETENTION": ""}) == 86400  # empty: unset
    assert job_retention("never", {}) is None and job_retention("0", {}) is None
    for flag, env, named in (
        ("-1", {}, "--job-retention"),
        (None, {"KREX_GATEWAY_JOB_RETENTION": "x"}, "KREX_GATEWAY_JOB_RETENTION"),
    ):
        with pytest.raises(ValueError, match=named):
            job_retention(flag, env)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "krex_async.gateway",
            "--state-dir",
            "/nonexistent",
            "--job-retention",
            "soon",
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 2 and "--job-retention" in r.stderr and "soon" in r.stderr, r.stderr


def test_a_gateway_that_is_not_root_removes_a_tree_its_job_made_read_only(gwhome: Path) -> None:
    """A job of a non-root gateway runs as the gateway's user and may leave 0500/0000 directories
    (a module cache): removing them needs the directories made writable first."""
    if os.geteuid() != 0:
        pytest.skip("runs the removal as another user: needs root")
    user = _ensure_user("krextest", [SOCKET_GROUP])
    top = gwhome / "scratch" / "dv_0123456789ab"
    (top / "cache" / "mod").mkdir(parents=True)
    (top / "cache" / "mod" / "f.go").write_text("x")
    (top / "locked").mkdir()
    for p in (top, top / "cache", top / "cache" / "mod", top / "cache" / "mod" / "f.go", top / "locked"):
        os.chown(p, user.uid, user.gid)
    os.symlink("/etc", top / "cache" / "etc")  # a link: removed, never followed or changed
    (top / "cache" / "mod").chmod(0o500)
    (top / "cache").chmod(0o555)
    (top / "locked").chmod(0o000)
    etc_mode = os.stat("/etc").st_mode
    r = user.run_py(
        "import sys; from pathlib import Path; from krex_async.gateway.files import remove_tree; "
        "print(remove_tree(Path(sys.argv[1])), remove_tree(Path(sys.argv[1])))",
        str(top),
    )
    assert r.returncode == 0 and r.stdout.split() == ["True", "False"], r.stderr
    assert not top.exists() and os.stat("/etc").st_mode == etc_mode


def many_job_dirs(jobs: Path, n: int) -> list[Path]:
    """`n` directories named as the gateway names jobs, each a small tree (a job's module cache)."""
    made = []
    for i in range(n):
        top = jobs / f"dv_{i:012x}"
        for sub in ("a", "b"):
            (top / sub).mkdir(parents=True)
            for j in range(5):
                (top / sub / f"f{j}").write_text("x")
        made.append(top)
    return made


async def test_stop_halts_a_removal_in_flight(tmp_path: Path) -> None:
    """A thread cannot be cancelled: stop() must tell it to take no next directory and wait for
    the one it is in, or a gateway asked to stop during a big start-up sweep goes on deleting
    (20,000 orphans held one for minutes)."""
    store = Store(tmp_path / "jobs.db")
    jobs = tmp_path / "jobs"
    made = many_job_dirs(jobs, 2000)
    sweeper = Sweeper(store, jobs, 3600, lambda: ())
    try:
        sweeper.start()
        await until(lambda: not made[0].exists(), "the start-up sweep began removing", 30)
        t = time.monotonic()
        await sweeper.stop()
        left = sum(p.exists() for p in made)
        await asyncio.sleep(1.0)
        assert sum(p.exists() for p in made) == left > 0, "the removal went on after stop()"
        assert time.monotonic() - t < 2.0
    finally:
        await sweeper.stop()
        store.close()


async def test_a_removed_jobs_idempotency_key_is_refused_not_run_again(tmp_path: Path) -> None:
    """A client resubmitting after a long outage must not run its job twice: the key of a job the
    sweep removed answers 410 naming that job, for one more retention period."""
    async with stack(tmp_path, "--job-retention", "1") as (_, gw, c):
        req = c.dev_request(f"echo ran >> {gw.scratch}/count", idempotency_key="k-1")
        _, first = await c.request("POST", "/v1/jobs/dev", json=req)
        assert (await c.wait(first["job_id"], 30))["status"] == "succeeded"
        await until(lambda: not (gw.state / "jobs" / first["job_id"]).exists(), "the job went", 10)

        async def forgotten() -> bool:  # its row goes just after its directory (sweep: then forget)
            return (await c.request("GET", f"/v1/jobs/{first['job_id']}"))[0] != 200

        await until_async(forgotten, "the job's row went", 10)
        status, body = await c.request("POST", "/v1/jobs/dev", json=req)
        assert (status, body["reason"]) == (410, "job_removed"), body
        assert body["details"]["job_id"] == first["job_id"] and first["job_id"] in body["message"]
        assert body["details"]["idempotency_key"] == "k-1" and body["error_class"] == "krex_gateway"
        await asyncio.sleep(1.0)
        assert (gw.scratch / "count").read_text() == "ran\n"  # not run a second time
        assert await c.jobs() == []  # and nothing was queued


async def test_removed_keys_are_kept_one_more_retention_then_forgotten(tmp_path: Path) -> None:
    store = Store(tmp_path / "jobs.db")
    jobs = tmp_path / "jobs"
    sweeper = Sweeper(store, jobs, 0.3, lambda: ())
    try:
        keyed, _ = store.create("dev", {"command": "a"}, "t", "key", None, owner="alice")
        plain, _ = store.create("dev", {"command": "b"}, "t", None, None, owner="alice")
        while (claimed := store.claim()) is not None:
            store.finish(claimed[0], "succeeded", {}, None)
        await asyncio.sleep(0.4)
        assert await sweeper.sweep() == 2
        assert store.db.execute("SELECT COUNT(*) FROM removed_keys").fetchone()[0] == 1
        with pytest.raises(KeyRemoved) as e:
            store.create("dev", {"command": "a"}, "t", "key", None, owner="alice")
        assert e.value.job_id == keyed["job_id"]
        # Keys are per identity and kind, as they were while the job lived.
        other, created = store.create("dev", {"command": "a"}, "t", "key", None, owner="bob")
        assert created and other["job_id"] != keyed["job_id"]
        await sweeper.sweep()  # within the second retention: kept
        assert store.db.execute("SELECT COUNT(*) FROM removed_keys").fetchone()[0] == 1
        await asyncio.sleep(0.4)
        await sweeper.sweep()
        assert store.db.execute("SELECT COUNT(*) FROM removed_keys").fetchone()[0] == 0
        again, created = store.create("dev", {"command": "a"}, "t", "key", None, owner="alice")
        assert created and again["job_id"] not in (keyed["job_id"], plain["job_id"])
    finally:
        await sweeper.stop()
        store.close()


def db_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in (path, path.with_name(path.name + "-wal")) if p.exists())


@pytest.mark.parametrize("made", ["new", "before auto-vacuum"])
async def test_jobs_db_shrinks_after_the_sweep_removes_jobs(tmp_path: Path, made: str) -> None:
    """Deleted rows' pages go back to the filesystem (incremental auto-vacuum after each sweep);
    a database made before that is converted once at start. Without it the file keeps its size."""
    path = tmp_path / "jobs.db"
    if made != "new":  # as an older gateway made it: auto_vacuum off
        Store(path).close()
        old = sqlite3.connect(path, isolation_level=None)
        old.executescript("PRAGMA auto_vacuum=NONE; VACUUM; PRAGMA wal_checkpoint(TRUNCATE)")
        assert old.execute("PRAGMA auto_vacuum").fetchone()[0] == 0
        old.close()
    store = Store(path)
    assert ("made shrinkable" in store.note) == (made != "new"), store.note
    (tmp_path / "jobs").mkdir()
    sweeper = Sweeper(store, tmp_path / "jobs", 0.2, lambda: ())
    try:
        for i in range(300):
            store.create("dev", {"command": str(i)}, "t", f"k{i}", None)
        while (claimed := store.claim()) is not None:
            store.finish(claimed[0], "succeeded", {"stdout": os.urandom(20_000).hex()}, None)
        store.checkpoint()
        full = db_bytes(path)
        assert full > 12_000_000
        sweeper.start()
        await until(lambda: not store.counts(), "the sweep removed every job", 10)
        await until(lambda: db_bytes(path) < full / 10, f"jobs.db shrank from {full} bytes", 10)
    finally:
        await sweeper.stop()
        store.close()


def deep_tree(top: Path, depth: int) -> Path:
    """`depth` nested directories under `top` (made by relative steps: the path outgrows PATH_MAX);
    returns `top`."""
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(depth):
            os.mkdir("d", dir_fd=fd)
            nfd = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            with open(os.open("f", os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=nfd), "w") as f:
                f.write("x")
            os.close(fd)
            fd = nfd
    finally:
        os.close(fd)
    return top


async def test_a_3000_deep_tree_is_removed_by_the_sweep_without_following_links(tmp_path: Path) -> None:
    """A job that leaves a 3000-deep tree made every sweep fail (RecursionError, or EMFILE from
    one fd per level); the sweep removes it, and a link inside it to a directory outside is
    removed, not followed."""
    store = Store(tmp_path / "jobs.db")
    jobs = tmp_path / "jobs"
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("not the job's")
    try:
        job, _ = store.create("dev", {"command": "deep"}, "t", None, None)
        other, _ = store.create("dev", {"command": "plain"}, "t", None, None)
        for _ in range(2):
            claimed = store.claim()
            assert claimed is not None
            (jobs / claimed[0]).mkdir(parents=True)
            store.finish(claimed[0], "succeeded", {}, None)
        top = deep_tree(jobs / job["job_id"], 3000)
        (top / "d" / "d" / "link").symlink_to(outside, target_is_directory=True)
        (top / "toplink").symlink_to(outside)
        await asyncio.sleep(0.05)
        sweeper = Sweeper(store, jobs, 0.01, lambda: ())
        assert await sweeper.sweep() == 2
        assert not (jobs / job["job_id"]).exists() and not (jobs / other["job_id"]).exists()
        assert (outside / "keep").read_text() == "not the job's"
        assert store.status(job["job_id"]) is None and sweeper.failing == set()
    finally:
        store.close()
