"""The jobs table and its rows as the API shows them: the schema store.py keeps (SCHEMA, its
MIGRATIONS and INDEXES), the columns a view reads (COLUMNS, `view`), and the errors a store call
raises or records (`error`, KeyRemoved, TooMany, `disk_full`)."""

from __future__ import annotations

import errno
import json
import sqlite3
from typing import Any

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
CREATE INDEX IF NOT EXISTS jobs_status ON jobs(status, seq);
CREATE TABLE IF NOT EXISTS removed_keys (
    owner TEXT NOT NULL,
    kind TEXT NOT NULL,
    idempotency_key TEXT NOT NULL,
    job_id TEXT NOT NULL,
    removed_at REAL NOT NULL,
    PRIMARY KEY (owner, kind, idempotency_key)
);
CREATE INDEX IF NOT EXISTS removed_keys_at ON removed_keys(removed_at);
"""
# Added after the first release: a database made before them gains them on open (owner 'default',
# the identity of a single token, for its jobs).
MIGRATIONS = (
    ("owner", "ALTER TABLE jobs ADD COLUMN owner TEXT NOT NULL DEFAULT 'default'"),
    ("run_uid", "ALTER TABLE jobs ADD COLUMN run_uid INTEGER"),
)
INDEXES = """
DROP INDEX IF EXISTS jobs_idem;
CREATE UNIQUE INDEX IF NOT EXISTS jobs_owner_idem ON jobs(owner, kind, idempotency_key)
    WHERE idempotency_key IS NOT NULL;
CREATE INDEX IF NOT EXISTS jobs_owner ON jobs(owner, seq);
CREATE INDEX IF NOT EXISTS jobs_finished ON jobs(finished_at) WHERE finished_at IS NOT NULL;
"""
# Everything a view needs; mode and lock_clocks read from the stored request by SQLite, so the request
# (up to the body limit) is never decoded to show a job.
COLUMNS = (
    "job_id, kind, status, result, error, trace_id, author, idempotency_key, krex_command, "
    "created_at, updated_at, started_at, finished_at, owner, "
    "json_extract(request, '$.mode') AS mode, "
    "json_extract(request, '$.lock_clocks') AS lock_clocks"
)
PREFIX = {"dev": "dv", "eval": "ev", "profile": "pf"}


class KeyRemoved(Exception):
    """An idempotency key whose job retention removed: answered, never run again (a client
    resubmitting after a long outage would otherwise run the job twice)."""

    def __init__(self, job_id: str, removed_at: float) -> None:
        super().__init__(f"job {job_id} was removed")
        self.job_id, self.removed_at = job_id, removed_at


class TooMany(Exception):
    """The identity already has its --max-queued-per-identity jobs queued or running."""

    def __init__(self, queued: int, running: int, cap: int) -> None:
        super().__init__(f"{queued} queued and {running} running of at most {cap}")
        self.queued, self.running, self.cap = queued, running, cap


def error(reason: str, message: str, trace_id: str | None = None, **details: Any) -> dict[str, Any]:
    """The API's error object, used both for HTTP error bodies and for a job's `error`."""
    return {
        "error_class": "krex_gateway",
        "reason": reason,
        "message": message,
        "details": details,
        "trace_id": trace_id,
    }


def disk_full(e: BaseException) -> bool:
    """Whether `e` says the state's file system (or the user's quota there) is full."""
    if isinstance(e, sqlite3.Error):
        return getattr(e, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL or "disk is full" in str(e)
    return isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)


def dumps(v: Any) -> str | None:
    return None if v is None else json.dumps(v, ensure_ascii=False, separators=(",", ":"))


def loads(v: str | None) -> Any:
    return None if v is None else json.loads(v)


def view(row: sqlite3.Row, decode: bool = True) -> dict[str, Any]:
    """The API's job object (without result and error when not `decode`: render splices
    their stored text in)."""
    mode = row["mode"]
    lock = row["lock_clocks"]
    job = {
        "job_id": row["job_id"],
        "kind": row["kind"],
        "status": row["status"],
        "mode": mode,
        "lock_clocks": None if lock is None else bool(lock),
        "mode_enforced": (
            (mode or "full") in ("full", "correctness_only") if row["kind"] == "eval" else None
        ),
        "trace_id": row["trace_id"],
        "author": row["author"],
        "idempotency_key": row["idempotency_key"],
        "krex_command": row["krex_command"],
        "created_at": row["created_at"],
        "updated_at": row["updated_at"],
        "started_at": row["started_at"],
        "finished_at": row["finished_at"],
    }
    if decode:
        job["result"], job["error"] = loads(row["result"]), loads(row["error"])
    return job
