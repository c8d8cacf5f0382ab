"""Jobs in SQLite (WAL), in `<state-dir>/jobs.db`: the gateway's only durable state.

Every call is one short transaction on the event loop's thread (a few hundred microseconds at most;
no query scans more than the jobs table's indexes). Status only moves forward:
queued -> running -> succeeded|failed|cancelled, or queued -> cancelled; every update says which
status it expects (`WHERE status=...`), so a cancelled job is never overwritten by its late result
and a job is claimed for running at most once. Each job has an `owner` (the identity that submitted
it, auth.py): reads, lists, cancels and idempotency keys are scoped to it. Opening the store marks
every job left `running` by a previous gateway as failed (reason `gateway_restarted`): it may have run
partly, so it is never run again. Queued jobs stay queued and run after the restart. A finished
job's row is deleted when its retention ends (retention.py); only a terminal row is ever deleted.
Its idempotency key outlives it in `removed_keys` for one more retention period, so a resubmission
with that key is answered (KeyRemoved) rather than run a second time.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import sqlite3
import sys
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

from krex_async.gateway.limits import TERMINAL
from krex_async.gateway.schema import (
    COLUMNS,
    INDEXES,
    MIGRATIONS,
    PREFIX,
    SCHEMA,
    KeyRemoved,
    TooMany,
    disk_full,
    error,
    view,
)
from krex_async.gateway.schema import dumps as _dumps
from krex_async.gateway.schema import loads as _loads

__all__ = ["PREFIX", "KeyRemoved", "Store", "TooMany", "disk_full", "error"]  # their old home


class Store:
    """Owns one sqlite3 connection; `close()` releases it. Raises sqlite3.Error on a broken db."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.max_running_per_owner = 0  # --max-running-per-identity (0: no cap)
        self.max_active_per_owner = 0  # --max-queued-per-identity: queued and running (0: no cap)
        self.served: dict[str, int] = {}  # identity -> the turn its last job was claimed in
        self._turn = 0
        self.db = sqlite3.connect(path, isolation_level=None)  # autocommit; explicit BEGINs
        path.chmod(0o600)
        self.db.row_factory = sqlite3.Row
        # Pages freed by the retention sweep go back to the filesystem (free_pages). This takes
        # on a new database only; an older one is converted by a VACUUM below.
        self.db.execute("PRAGMA auto_vacuum=INCREMENTAL")
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.execute("PRAGMA busy_timeout=5000")
        self.db.executescript(SCHEMA)
        have = {r[1] for r in self.db.execute("PRAGMA table_info(jobs)")}
        for column, sql in MIGRATIONS:
            if column not in have:
                self.db.execute(sql)
        self.db.executescript(INDEXES)
        self.note = self._make_shrinkable(path)  # said by the gateway at start ("" when nothing)
        # Jobs a previous gateway left running: they may have run partly, so they never run again.
        self.orphans = self.fail_all(
            "running",
            "gateway_restarted",
            "the gateway stopped while the job was running; it is not run again",
        )
        self.restarted = len(self.orphans)

    def close(self) -> None:
        self.db.close()

    def _rollback(self) -> None:
        """Roll back the open transaction, if SQLite has not already: on a full disk (SQLITE_FULL)
        it rolls back by itself, and a second ROLLBACK would hide that error behind 'cannot
        rollback - no transaction is active'."""
        if self.db.in_transaction:
            self.db.execute("ROLLBACK")

    def _make_shrinkable(self, path: Path) -> str:
        """Turn on incremental auto-vacuum in a database made before it: a one-off VACUUM, which
        rewrites the file (seconds per GB, on start only). Without it the file keeps its largest
        size for ever; a VACUUM that fails (disk full) is said and the gateway runs on."""
        if self.db.execute("PRAGMA auto_vacuum").fetchone()[0] == 2:
            return ""
        size = path.stat().st_size / 2**20
        try:
            self.db.execute("VACUUM")
            self.checkpoint()
        except sqlite3.Error as e:
            return f"{path}: cannot make it shrinkable ({e}): it keeps its size after rows are removed"
        return f"{path}: made shrinkable (a one-off VACUUM of {size:.1f} MiB for incremental auto-vacuum)"

    def free_pages(self, limit: int) -> int:
        """Give up to `limit` free pages (rows deleted) back to the filesystem, in one short
        transaction; returns how many free pages are left (`limit` 0: only says so)."""
        if limit > 0:  # executescript steps the pragma to its end; execute would free one page
            self.db.executescript(f"PRAGMA incremental_vacuum({int(limit)})")
        return int(self.db.execute("PRAGMA freelist_count").fetchone()[0])

    def checkpoint(self) -> None:
        """Copy the WAL into the database and empty it: the file shrinks now, and so does the WAL."""
        self.db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()

    def create(
        self,
        kind: str,
        request: dict[str, Any],
        trace_id: str,
        idempotency_key: str | None,
        author: str | None,
        owner: str = "default",
        run_uid: int | None = None,
    ) -> tuple[dict[str, Any], bool]:
        """Insert a queued job, or return the owner's job with the same kind and idempotency key.
        Raises KeyRemoved when that job was removed (its key is kept a while: `forget`), TooMany
        when the owner has max_active_per_owner jobs queued or running already."""
        self.db.execute("BEGIN IMMEDIATE")
        try:
            if idempotency_key is not None:
                row = self.db.execute(
                    f"SELECT {COLUMNS} FROM jobs WHERE owner=? AND kind=? AND idempotency_key=?",
                    (owner, kind, idempotency_key),
                ).fetchone()
                if row is not None:
                    self.db.execute("COMMIT")
                    return self.view(row), False
                gone = self.db.execute(
                    "SELECT job_id, removed_at FROM removed_keys WHERE owner=? AND kind=? "
                    "AND idempotency_key=?",
                    (owner, kind, idempotency_key),
                ).fetchone()
                if gone is not None:
                    raise KeyRemoved(gone[0], gone[1])  # rolled back below: nothing was written
            if self.max_active_per_owner:
                queued, running = self.active(owner)
                if queued + running >= self.max_active_per_owner:
                    raise TooMany(queued, running, self.max_active_per_owner)
            now = time.time()
            job_id = f"{PREFIX.get(kind, 'jb')}_{secrets.token_hex(6)}"
            self.db.execute(
                "INSERT INTO jobs (job_id, kind, status, request, trace_id, author, "
                "idempotency_key, created_at, updated_at, owner, run_uid) "
                "VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                (
                    job_id,
                    kind,
                    "queued",
                    _dumps(request),
                    trace_id,
                    author,
                    idempotency_key,
                    now,
                    now,
                    owner,
                    run_uid,
                ),
            )
            job = self.get(job_id)  # read back inside the transaction: a row it cannot show is not kept
            assert job is not None
            self.db.execute("COMMIT")
        except BaseException:
            self._rollback()
            raise
        return job, True

    def get(self, job_id: str, owner: str | None = None) -> dict[str, Any] | None:
        """The job's API object (None: no such job, or not `owner`'s when one is given)."""
        row = self.db.execute(f"SELECT {COLUMNS} FROM jobs WHERE job_id=?", (job_id,)).fetchone()
        return None if row is None or owner not in (None, row["owner"]) else self.view(row)

    def status(self, job_id: str, owner: str | None = None) -> str | None:
        row = self.db.execute("SELECT status, owner FROM jobs WHERE job_id=?", (job_id,)).fetchone()
        return None if row is None or owner not in (None, row[1]) else str(row[0])

    def run_uid(self, job_id: str) -> int | None:
        row = self.db.execute("SELECT run_uid FROM jobs WHERE job_id=?", (job_id,)).fetchone()
        return None if row is None else row[0]

    def expired(self, before: float, limit: int, skip: Collection[str] = ()) -> list[str]:
        """Up to `limit` ids of jobs that reached a terminal status before `before` (oldest
        first), leaving out `skip` (jobs whose task still runs)."""
        sql = (
            "SELECT job_id FROM jobs WHERE finished_at < ? AND status IN ('succeeded', 'failed', 'cancelled')"
        )
        if skip:
            sql += f" AND job_id NOT IN ({','.join('?' * len(skip))})"
        sql += " ORDER BY finished_at LIMIT ?"
        return [r[0] for r in self.db.execute(sql, (before, *skip, limit)).fetchall()]

    def forget(self, job_ids: Collection[str]) -> int:
        """Delete these jobs' rows, each only while it is terminal, keeping each one's idempotency
        key in removed_keys (`forget_keys` ends that). Returns how many went."""
        now, terminal = time.time(), "status IN ('succeeded', 'failed', 'cancelled')"
        self.db.execute("BEGIN IMMEDIATE")
        try:
            n = 0
            for job_id in job_ids:
                self.db.execute(
                    "INSERT OR REPLACE INTO removed_keys SELECT owner, kind, idempotency_key, job_id, ? "
                    f"FROM jobs WHERE job_id=? AND idempotency_key IS NOT NULL AND {terminal}",
                    (now, job_id),
                )
                n += self.db.execute(f"DELETE FROM jobs WHERE job_id=? AND {terminal}", (job_id,)).rowcount
            self.db.execute("COMMIT")
        except BaseException:
            self._rollback()
            raise
        return n

    def forget_keys(self, before: float) -> int:
        """Let go of the keys of jobs removed before `before`: the table stays bounded."""
        return self.db.execute("DELETE FROM removed_keys WHERE removed_at < ?", (before,)).rowcount

    def known(self, job_ids: Collection[str]) -> set[str]:
        """Which of these ids have a row."""
        return {
            job_id
            for job_id in job_ids
            if self.db.execute("SELECT 1 FROM jobs WHERE job_id=?", (job_id,)).fetchone() is not None
        }

    def list_ids(
        self,
        owner: str,
        kind: str | None,
        status: str | None,
        author: str | None,
        limit: int,
        newest_first: bool = True,
    ) -> list[str]:
        """The owner's job ids matching the filters (the views are rendered one at a time)."""
        where, args = ["owner=?"], [owner]
        for col, val in (("kind", kind), ("status", status), ("author", author)):
            if val is not None:
                where.append(f"{col}=?")
                args.append(val)
        sql = "SELECT job_id FROM jobs WHERE " + " AND ".join(where)
        sql += f" ORDER BY seq {'DESC' if newest_first else 'ASC'} LIMIT ?"
        return [r[0] for r in self.db.execute(sql, (*args, limit)).fetchall()]

    def render(self, job_id: str, owner: str | None = None) -> tuple[str, bytes] | None:
        """(status, the job's API object as JSON bytes), built around the stored result and error
        text without decoding them: a 16 MB result is not parsed and re-encoded for each reader."""
        row = self.db.execute(f"SELECT {COLUMNS} FROM jobs WHERE job_id=?", (job_id,)).fetchone()
        if row is None or owner not in (None, row["owner"]):
            return None
        head = self.view(row, decode=False)
        text = json.dumps(head, ensure_ascii=False, separators=(",", ":"))[:-1]
        body = f'{text},"result":{row["result"] or "null"},"error":{row["error"] or "null"}}}'.encode(
            "utf-8", "surrogatepass"
        )
        return str(row["status"]), body

    def claim(self) -> tuple[str, str, dict[str, Any]] | None:
        """The next queued job, now marked running (recorded before anything is started): fair
        between identities, not first come first served (one identity's batch would make every
        other identity wait for all of it). Each identity's oldest queued job is a candidate; the
        one whose identity has the fewest jobs running goes first, then the identity served
        longest ago (round robin), then the oldest. Identities at `max_running_per_owner` wait."""
        self.db.execute("BEGIN IMMEDIATE")
        try:
            running = dict(
                self.db.execute("SELECT owner, COUNT(*) FROM jobs WHERE status='running' GROUP BY owner")
            )
            heads = self.db.execute(
                "SELECT owner, MIN(seq) FROM jobs WHERE status='queued' GROUP BY owner"
            ).fetchall()
            cap = self.max_running_per_owner
            ready = [(o, seq) for o, seq in heads if not (cap and running.get(o, 0) >= cap)]
            row = None
            if ready:
                owner, seq = min(ready, key=lambda h: (running.get(h[0], 0), self.served.get(h[0], -1), h[1]))
                row = self.db.execute("SELECT job_id, kind, request FROM jobs WHERE seq=?", (seq,)).fetchone()
                now = time.time()
                self.db.execute(
                    "UPDATE jobs SET status='running', started_at=?, updated_at=? "
                    "WHERE job_id=? AND status='queued'",
                    (now, now, row[0]),
                )
            self.db.execute("COMMIT")
        except BaseException:
            self._rollback()
            raise
        if row is None:
            return None
        self._turn += 1
        self.served[owner] = self._turn
        return row[0], row[1], _loads(row[2])

    def active(self, owner: str) -> tuple[int, int]:
        """(queued, running) jobs of this identity."""
        counts = dict(
            self.db.execute(
                "SELECT status, COUNT(*) FROM jobs WHERE owner=? AND status IN ('queued', 'running') "
                "GROUP BY status",
                (owner,),
            )
        )
        return counts.get("queued", 0), counts.get("running", 0)

    def owner(self, job_id: str) -> str | None:
        row = self.db.execute("SELECT owner FROM jobs WHERE job_id=?", (job_id,)).fetchone()
        return None if row is None else str(row[0])

    def requeue(self, job_id: str) -> bool:
        """running -> queued again, keeping its place, for a job no command was started for (no
        node could take it). False when it is no longer running (cancelled meanwhile)."""
        n = self.db.execute(
            "UPDATE jobs SET status='queued', started_at=NULL, krex_command=NULL, updated_at=? "
            "WHERE job_id=? AND status='running'",
            (time.time(), job_id),
        ).rowcount
        return n == 1

    def set_command(self, job_id: str, command: str) -> None:
        self.db.execute(
            "UPDATE jobs SET krex_command=?, updated_at=? WHERE job_id=? AND status='running'",
            (command, time.time(), job_id),
        )

    def finish(
        self, job_id: str, status: str, result: dict[str, Any] | None, err: dict[str, Any] | None
    ) -> bool:
        """running -> a terminal status. A job cancelled meanwhile stays as the cancel left it
        (result and error null, as the reference gateway reports it: its client then resubmits
        once). Returns whether this call decided the status."""
        assert status in TERMINAL
        now = time.time()
        n = self.db.execute(
            "UPDATE jobs SET status=?, result=?, error=?, updated_at=?, "
            "finished_at=? WHERE job_id=? AND status='running'",
            (status, _dumps(result), _dumps(err), now, now, job_id),
        ).rowcount
        return n == 1

    def cancel(self, job_id: str, owner: str | None = None) -> str | None:
        """Mark a queued or running job cancelled; returns the status it had (None: no such job,
        or not `owner`'s)."""
        self.db.execute("BEGIN IMMEDIATE")
        try:
            before = self.status(job_id, owner)
            if before in ("queued", "running"):
                now = time.time()
                self.db.execute(
                    "UPDATE jobs SET status='cancelled', updated_at=?, finished_at=? WHERE job_id=?",
                    (now, now, job_id),
                )
            self.db.execute("COMMIT")
        except BaseException:
            self._rollback()
            raise
        return before

    def fail_all(
        self, status: str, reason: str, message: str, created_before: float | None = None
    ) -> list[str]:
        """Mark every job in `status` (created before `created_before`, when given) failed with
        this error, in one transaction; returns their ids."""
        now, where = time.time(), "status=?"
        args: list[object] = [status]
        if created_before is not None:
            where += " AND created_at < ?"
            args.append(created_before)
        self.db.execute("BEGIN IMMEDIATE")
        try:
            ids = [r[0] for r in self.db.execute(f"SELECT job_id FROM jobs WHERE {where}", args)]
            self.db.execute(
                f"UPDATE jobs SET status='failed', error=?, updated_at=?, finished_at=? WHERE {where}",
                (_dumps(error(reason, message)), now, now, *args),
            )
            self.db.execute("COMMIT")
        except BaseException:
            self._rollback()
            raise
        return ids

    def oldest_queued(self) -> float | None:
        """When the longest-waiting queued job was submitted (None: the queue is empty)."""
        row = self.db.execute("SELECT MIN(created_at) FROM jobs WHERE status='queued'").fetchone()
        return None if row[0] is None else float(row[0])

    def counts(self) -> dict[str, int]:
        return {
            r[0]: r[1]
            for r in self.db.execute("SELECT status, COUNT(*) FROM jobs GROUP BY status").fetchall()
        }

    view = staticmethod(view)


RETRY_S = 1.0  # between tries of a write the state disk had no room for


async def until_stored(write: Callable[[], object], said: str = "") -> None:
    """`write()` (a store call), tried again each RETRY_S while it fails with sqlite3.Error (a full
    state disk, a locked database); the first failure is said on stderr after `said`, if given."""
    first = True
    while True:
        try:
            write()
            return
        except sqlite3.Error as e:
            if first and said:
                print(f"{said} ({e}); trying again every {RETRY_S:g} s", file=sys.stderr, flush=True)
            first = False
        await asyncio.sleep(RETRY_S)
