"""Jobs in SQLite (WAL), in `<state-dir>/jobs.db`: the gateway's only durable state.

Every call is one short transaction on the event loop's thread (a few hundred microseconds at most;
no query scans more than the jobs table's indexes). Status only moves forward:
queued -> running -> succeeded|failed|cancelled, or queued -> cancelled; every update says which
status it expects (`WHERE status=...`), so a cancelled job is never overwritten by its late result
and a job is claimed for running at most once. Opening the store marks every job left `running` by
a previous gateway as failed (reason `gateway_restarted`): it may have run partly, so it is never
run again. Queued jobs stay queued and run after the restart.
"""

from __future__ import annotations

import json
import secrets
import sqlite3
import time
from pathlib import Path
from typing import Any

from .limits import TERMINAL

SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id TEXT NOT NULL UNIQUE,
    kind TEXT NOT NULL,
    status TEXT NOT NULL,
    request TEXT NOT NULL,
    result TEXT,
    error TEXT,
    trace_id TEXT NOT NULL,
    author TEXT,
    idempotency_key TEXT,
    krex_command TEXT,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    started_at REAL,
    finished_at REAL
);
CREATE UNIQUE INDEX IF NOT EXISTS jobs_idem ON jobs(kind, idempotency_key)
    WHERE idempotency_key IS NOT NULL;
CREATE INDEX IF NOT EXISTS jobs_status ON jobs(status, seq);
"""
PREFIX = {"dev": "dv", "eval": "ev", "profile": "pf"}


def error(reason: str, message: str, trace_id: str | None = None, **details: Any) -> dict[str, Any]:
    """The API's error object, used both for HTTP error bodies and for a job's `error`."""
    return {"error_class": "krex_gateway", "reason": reason, "message": message,
            "details": details, "trace_id": trace_id}


def _dumps(v: Any) -> str | None:
    return None if v is None else json.dumps(v, ensure_ascii=False, separators=(",", ":"))


def _loads(v: str | None) -> Any:
    return None if v is None else json.loads(v)


class Store:
    """Owns one sqlite3 connection; `close()` releases it. Raises sqlite3.Error on a broken db."""

    def __init__(self, path: Path) -> None:
        self.db = sqlite3.connect(path, isolation_level=None)  # autocommit; explicit BEGINs
        path.chmod(0o600)
        self.db.row_factory = sqlite3.Row
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.execute("PRAGMA busy_timeout=5000")
        self.db.executescript(SCHEMA)
        now = time.time()
        self.orphans = [r[0] for r in self.db.execute(
            "SELECT job_id FROM jobs WHERE status='running'").fetchall()]
        self.restarted = self.db.execute(
            "UPDATE jobs SET status='failed', error=?, updated_at=?, finished_at=? "
            "WHERE status='running'",
            (_dumps(error("gateway_restarted", "the gateway stopped while the job was running; "
                          "it is not run again")), now, now)).rowcount

    def close(self) -> None:
        self.db.close()

    def create(self, kind: str, request: dict[str, Any], trace_id: str,
               idempotency_key: str | None, author: str | None) -> tuple[dict[str, Any], bool]:
        """Insert a queued job, or return the job with the same kind and idempotency key."""
        self.db.execute("BEGIN IMMEDIATE")
        try:
            if idempotency_key is not None:
                row = self.db.execute("SELECT * FROM jobs WHERE kind=? AND idempotency_key=?",
                                      (kind, idempotency_key)).fetchone()
                if row is not None:
                    self.db.execute("COMMIT")
                    return self.view(row), False
            now = time.time()
            job_id = f"{PREFIX.get(kind, 'jb')}_{secrets.token_hex(6)}"
            self.db.execute(
                "INSERT INTO jobs (job_id, kind, status, request, trace_id, author, "
                "idempotency_key, created_at, updated_at) VALUES (?,?,?,?,?,?,?,?,?)",
                (job_id, kind, "queued", _dumps(request), trace_id, author, idempotency_key,
                 now, now))
            self.db.execute("COMMIT")
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        job = self.get(job_id)
        assert job is not None
        return job, True

    def get(self, job_id: str) -> dict[str, Any] | None:
        row = self.db.execute("SELECT * FROM jobs WHERE job_id=?", (job_id,)).fetchone()
        return None if row is None else self.view(row)

    def status(self, job_id: str) -> str | None:
        row = self.db.execute("SELECT status FROM jobs WHERE job_id=?", (job_id,)).fetchone()
        return None if row is None else str(row[0])

    def list(self, kind: str | None, status: str | None, author: str | None, limit: int,
             newest_first: bool = True) -> list[dict[str, Any]]:
        where, args = [], []
        for col, val in (("kind", kind), ("status", status), ("author", author)):
            if val is not None:
                where.append(f"{col}=?")
                args.append(val)
        sql = "SELECT * FROM jobs" + (" WHERE " + " AND ".join(where) if where else "")
        sql += f" ORDER BY seq {'DESC' if newest_first else 'ASC'} LIMIT ?"
        return [self.view(r) for r in self.db.execute(sql, (*args, limit)).fetchall()]

    def claim(self) -> tuple[str, str, dict[str, Any]] | None:
        """The oldest queued job, now marked running (recorded before anything is started)."""
        self.db.execute("BEGIN IMMEDIATE")
        try:
            row = self.db.execute("SELECT job_id, kind, request FROM jobs WHERE status='queued' "
                                  "ORDER BY seq LIMIT 1").fetchone()
            if row is not None:
                now = time.time()
                self.db.execute("UPDATE jobs SET status='running', started_at=?, updated_at=? "
                                "WHERE job_id=? AND status='queued'", (now, now, row[0]))
            self.db.execute("COMMIT")
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        return None if row is None else (row[0], row[1], _loads(row[2]))

    def set_command(self, job_id: str, command: str) -> None:
        self.db.execute("UPDATE jobs SET krex_command=?, updated_at=? WHERE job_id=?",
                        (command, time.time(), job_id))

    def finish(self, job_id: str, status: str, result: dict[str, Any] | None,
               err: dict[str, Any] | None) -> bool:
        """running -> a terminal status. A job cancelled meanwhile keeps `cancelled` but gets the
        result. Returns whether this call decided the status."""
        assert status in TERMINAL
        now = time.time()
        n = self.db.execute("UPDATE jobs SET status=?, result=?, error=?, updated_at=?, "
                            "finished_at=? WHERE job_id=? AND status='running'",
                            (status, _dumps(result), _dumps(err), now, now, job_id)).rowcount
        if n == 0 and result is not None:
            self.db.execute("UPDATE jobs SET result=?, updated_at=? WHERE job_id=? AND "
                            "status='cancelled' AND result IS NULL",
                            (_dumps(result), now, job_id))
        return n == 1

    def cancel(self, job_id: str) -> str | None:
        """Mark a queued or running job cancelled; returns the status it had (None: no such job)."""
        self.db.execute("BEGIN IMMEDIATE")
        try:
            before = self.status(job_id)
            if before in ("queued", "running"):
                now = time.time()
                self.db.execute(
                    "UPDATE jobs SET status='cancelled', error=?, updated_at=?, finished_at=? "
                    "WHERE job_id=?",
                    (_dumps(error("cancelled", f"cancelled while {before}")), now, now, job_id))
            self.db.execute("COMMIT")
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        return before

    def fail_running(self, reason: str, message: str) -> int:
        now = time.time()
        return self.db.execute("UPDATE jobs SET status='failed', error=?, updated_at=?, "
                               "finished_at=? WHERE status='running'",
                               (_dumps(error(reason, message)), now, now)).rowcount

    def counts(self) -> dict[str, int]:
        return {r[0]: r[1] for r in
                self.db.execute("SELECT status, COUNT(*) FROM jobs GROUP BY status").fetchall()}

    @staticmethod
    def view(row: sqlite3.Row) -> dict[str, Any]:
        """The API's job object."""
        req = _loads(row["request"]) or {}
        return {
            "job_id": row["job_id"], "kind": row["kind"], "status": row["status"],
            "mode": req.get("mode"), "lock_clocks": req.get("lock_clocks"),
            "mode_enforced": (req.get("mode", "full") in ("full", "correctness_only")
                              if row["kind"] == "eval" else None),
            "result": _loads(row["result"]), "error": _loads(row["error"]),
            "trace_id": row["trace_id"], "author": row["author"],
            "idempotency_key": row["idempotency_key"], "krex_command": row["krex_command"],
            "created_at": row["created_at"], "updated_at": row["updated_at"],
            "started_at": row["started_at"], "finished_at": row["finished_at"],
        }
