"""The gateway reads back what a job wrote without following the job's links, from files of the
job's user only; the store keeps a database made before owners existed; a link planted as the
state directory's lock file is refused, never followed."""

from __future__ import annotations

import fcntl
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from krex_async.gateway.command import job_env
from krex_async.gateway.files import StateError, find, open_lock, read_job_file
from krex_async.gateway.store import Store


def test_a_job_never_inherits_the_gateways_token(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KREX_GATEWAY_TOKEN", "gateway-secret")
    monkeypatch.setenv("AGATE_TOKEN", "client-secret")
    monkeypatch.setenv("NOT_PASSED", "1")
    monkeypatch.setenv("LC_ALL", "C")
    env = job_env("dv_x", tmp_path, {"MINE": "2"}, names={"KEPT"})
    assert "KREX_GATEWAY_TOKEN" not in env and "AGATE_TOKEN" not in env
    assert "NOT_PASSED" not in env and "KEPT" not in env  # named, but not set
    assert env["LC_ALL"] == "C" and env["MINE"] == "2" and env["KREX_GATEWAY_JOB"] == "dv_x"
    monkeypatch.setenv("KEPT", "1")
    assert job_env("dv_x", tmp_path, {}, names={"KEPT"})["KEPT"] == "1"


def test_read_back_refuses_links_fifos_and_other_owners(tmp_path: Path) -> None:
    job = tmp_path / "job"
    (job / "out" / "sub").mkdir(parents=True)
    secret = tmp_path / "secret.json"
    secret.write_text('{"secret": 1}')
    (job / "out" / "ok.json").write_text("{}")
    (job / "out" / "link.json").symlink_to(secret)
    (job / "out" / "sub" / "eval_result.json").write_text("{}")
    (job / "linkdir").symlink_to(job / "out")
    os.mkfifo(job / "out" / "fifo")
    me = os.geteuid()
    assert read_job_file(job, "out/ok.json", me, 100) == b"{}"
    for rel in ("out/link.json", "linkdir/ok.json"):
        with pytest.raises(OSError):
            read_job_file(job, rel, me, 100)
    with pytest.raises(PermissionError):
        read_job_file(job, "out/fifo", me, 100)  # opened without blocking, then refused
    with pytest.raises(OSError):  # larger than the limit
        read_job_file(job, "out/sub/eval_result.json", me, 1)
    if me == 0:  # a file of another user than the job's (and not the gateway's) is not read
        os.chown(job / "out" / "ok.json", 12345, 12345)
        with pytest.raises(PermissionError):
            read_job_file(job, "out/ok.json", 23456, 100)
    assert list(find(job, "out", "eval_result.json")) == ["out/sub/eval_result.json"]
    assert list(find(job, "linkdir", "ok.json")) == []  # a linked top is not walked
    assert list(find(job, "missing", "x")) == []


def test_a_database_from_before_owners_opens_with_its_jobs_kept(tmp_path: Path) -> None:
    db = tmp_path / "jobs.db"
    old = sqlite3.connect(db)
    old.executescript("""
        CREATE TABLE jobs (seq INTEGER PRIMARY KEY AUTOINCREMENT, job_id TEXT NOT NULL UNIQUE,
            kind TEXT NOT NULL, status TEXT NOT NULL, request TEXT NOT NULL, result TEXT,
            error TEXT, trace_id TEXT NOT NULL, author TEXT, idempotency_key TEXT,
            krex_command TEXT, created_at REAL NOT NULL, updated_at REAL NOT NULL,
            started_at REAL, finished_at REAL);
        CREATE UNIQUE INDEX jobs_idem ON jobs(kind, idempotency_key)
            WHERE idempotency_key IS NOT NULL;
        INSERT INTO jobs (job_id, kind, status, request, result, trace_id, idempotency_key,
            created_at, updated_at) VALUES ('dv_old', 'dev', 'succeeded', '{"command": "true"}',
            '{"exit_code": 0}', 't', 'k', 1, 1);
    """)
    old.commit()
    old.close()
    store = Store(db)
    try:
        assert store.get("dv_old", "default")["result"] == {"exit_code": 0}  # type: ignore[index]
        assert store.get("dv_old", "someone") is None
        job, created = store.create("dev", {"command": "x"}, "t", "k", None, "someone")
        assert created and job["job_id"] != "dv_old"  # keys are per owner now
    finally:
        store.close()


def test_a_link_planted_as_the_lock_file_is_refused(tmp_path: Path) -> None:
    """Opened with O_NOFOLLOW: a link there would have the gateway open and chmod its target."""
    state, target = tmp_path / "state", tmp_path / "target"
    state.mkdir(mode=0o711)
    target.write_text("keep")
    target.chmod(0o644)
    os.symlink(target, state / "gateway.lock")
    r = subprocess.run(
        [sys.executable, "-m", "krex_async.gateway", "--listen", "127.0.0.1:0", "--no-auth"]
        + ["--state-dir", str(state), "--socket", str(tmp_path / "no-daemon.sock")],
        capture_output=True,
        text=True,
        timeout=20,
    )
    assert r.returncode == 2 and "gateway.lock is a symbolic link" in r.stderr, r.stderr
    assert target.read_text() == "keep" and target.stat().st_mode & 0o777 == 0o644
    assert not (state / "jobs.db").exists()  # refused before anything was made
    (state / "gateway.lock").unlink()
    os.link(target, state / "gateway.lock")
    with pytest.raises(StateError, match="hard link"):
        open_lock(state / "gateway.lock")
    (state / "gateway.lock").unlink()
    os.mkfifo(state / "gateway.lock")
    with pytest.raises(StateError, match="not a regular file"):
        open_lock(state / "gateway.lock")
    (state / "gateway.lock").unlink()
    fd = open_lock(state / "gateway.lock")
    try:
        assert os.fstat(fd).st_mode & 0o777 == 0o600 and fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC
    finally:
        os.close(fd)
    assert target.stat().st_mode & 0o777 == 0o644


def test_a_corrupt_jobs_db_is_refused_with_a_clear_error(tmp_path: Path) -> None:
    """A jobs.db that is not a database: exit 2 naming it, not a traceback."""
    state = tmp_path / "state"
    state.mkdir(mode=0o711)
    (state / "jobs.db").write_bytes(b"not a database, " * 512)
    argv = [sys.executable, "-m", "krex_async.gateway", "--listen", "127.0.0.1:0", "--no-auth"]
    argv += ["--state-dir", str(state), "--socket", str(tmp_path / "no-daemon.sock")]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=20)
    assert r.returncode == 2, r.stderr
    assert "jobs.db cannot be used (DatabaseError" in r.stderr and "Traceback" not in r.stderr, r.stderr
