"""Job retention: a finished job's directory and row go `--job-retention` seconds after it ended,
so a gateway that runs for months does not fill its disk with uploads, outputs and profiles.

    Sweeper.start() -> task: once, directories under <state>/jobs with no row (`orphan_dirs`);
        then every `interval`: sweep() -> store.expired(now - retention, skip=busy())
            -> files.remove_tree(<jobs>/<id>) on a thread -> store.forget(those now gone)
            -> on_removed(ids) (the views' cache lets go of them)
        and store.forget_keys(now - retention): a removed job's idempotency key, kept so that a
        late resubmission is refused rather than run again, goes one more retention later
        -> compact(): the rows' pages go back to the filesystem (jobs.db shrinks)

A job is only ever removed once it is terminal and its task has ended (`busy`: a cancelled job's
command may still be ending in its directory, and a job a dead gateway left running may still run
until its command is reaped). The reference gateway keeps every job; its client reads a result by
long polls that end as the job does, and waits at most ~4 h for one (600 s job, 4 h queue grace),
so the default of a day removes nothing a client could still be about to read. A directory that
cannot be removed keeps its row, is said once, and is tried again each sweep; a sweep that fails
(a locked database) is said and the next one runs as planned.
"""

from __future__ import annotations

import asyncio
import re
import sys
import threading
import time
from collections.abc import Callable, Collection
from pathlib import Path

from krex_async.gateway.files import remove_tree
from krex_async.gateway.store import PREFIX, Store

DEFAULT = 86400.0  # a day: seconds a finished job's directory and record are kept
BATCH = 200  # jobs per removal step: one thread hop and one short transaction each
COMPACT_STEP = 1024  # free pages given back per transaction (4 MiB at SQLite's default page size)
MAX_SKIP = 5000  # directories that would not go, passed over in one sweep before it stops
JOB_DIR = re.compile(rf"(?:{'|'.join(sorted({*PREFIX.values(), 'jb'}))})_[0-9a-f]{{12}}\Z")


def parse(text: str) -> float | None:
    """A --job-retention value: seconds (0 keeps jobs forever) or 'never'; None means keep.
    Raises ValueError naming what it expected."""
    if text.strip().lower() == "never":
        return None
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"expected seconds (a number >= 0) or 'never', got {text!r}") from None
    if not 0 <= value < float("inf"):
        raise ValueError(f"expected seconds (a number >= 0) or 'never', got {text!r}")
    return value or None


def log(message: str) -> None:
    print(f"krex gateway: {message}", file=sys.stderr, flush=True)


class Sweeper:
    """Removes expired jobs on a schedule; `stop()` ends the task and halts a removal in flight on
    its thread after the directory it is in (a thread cannot be cancelled: 20,000 orphans held a
    stopping gateway for minutes). Rows whose directory went are forgotten by the next sweep."""

    def __init__(
        self,
        store: Store,
        jobs_dir: Path,
        retention: float,
        busy: Callable[[], Collection[str]],
        on_removed: Callable[[list[str]], None] = lambda ids: None,
    ) -> None:
        self.store, self.jobs_dir, self.retention = store, jobs_dir, retention
        self.busy, self.on_removed = busy, on_removed
        self.interval = min(60.0, max(0.5, retention / 4))  # a job outlives its retention by <25%
        self.failing: set[str] = set()  # ids whose directory would not go: said once each
        self.removed = 0  # jobs removed since start
        self._task: asyncio.Task[None] | None = None
        self._halt = threading.Event()  # set by stop(): the removal thread takes no next directory
        self._removing: asyncio.Future[tuple[list[str], list[tuple[str, str]]]] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        """End the task; returns once no removal runs (the one in flight ends its directory)."""
        self._halt.set()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._removing is not None:
            await asyncio.gather(self._removing, return_exceptions=True)

    async def _remove_off_loop(self, ids: list[str]) -> tuple[list[str], list[tuple[str, str]]]:
        """_remove on a thread, kept for stop() to wait on when this task is cancelled."""
        self._removing = asyncio.get_running_loop().run_in_executor(None, self._remove, ids)
        return await asyncio.shield(self._removing)

    async def _run(self) -> None:
        try:
            if n := await self.orphan_dirs():
                log(f"removed {n} job director{'y' if n == 1 else 'ies'} with no record (left by a crash)")
        except Exception as e:  # noqa: BLE001 - said; the periodic sweep must still run
            log(f"start-up sweep of {self.jobs_dir} failed: {type(e).__name__}: {e}")
        while True:
            try:
                await self.sweep()
                await self.compact()
            except Exception as e:  # noqa: BLE001 - a locked database, a bug: said, tried again
                log(f"job retention sweep failed ({type(e).__name__}: {e}); again in {self.interval:g} s")
            await asyncio.sleep(self.interval)

    async def sweep(self) -> int:
        """Remove the jobs that ended more than `retention` ago; returns how many went."""
        cutoff, total, tried = time.time() - self.retention, 0, set[str]()
        self.store.forget_keys(cutoff)  # removed one retention ago: two after their job ended
        while True:
            ids = self.store.expired(cutoff, BATCH, {*self.busy(), *tried})
            if not ids or len(tried) > MAX_SKIP:  # the skip list is bound by SQLite's parameters
                return total
            gone, failed = await self._remove_off_loop(ids)
            if self._halt.is_set():
                return total  # stopping: what went is forgotten by the next gateway's sweep
            for job_id, why in failed:
                tried.add(job_id)  # kept, and tried again on the next sweep
                if job_id not in self.failing:
                    self.failing.add(job_id)
                    log(f"cannot remove job {job_id}'s directory ({why}); kept, tried again each sweep")
            if gone:
                self.store.forget(gone)
                self.on_removed(gone)
                self.failing.difference_update(gone)
                self.removed += len(gone)
                total += len(gone)

    async def compact(self) -> int:
        """Give the pages of removed rows back to the filesystem, COMPACT_STEP pages per short
        transaction with the loop answering between them; returns how many went. A database
        whose conversion failed (Store.note) frees none, and this stops at once."""
        left = start = self.store.free_pages(0)
        while left:
            now = self.store.free_pages(COMPACT_STEP)
            if now >= left:
                break
            left = now
            await asyncio.sleep(0)
        if left < start:
            self.store.checkpoint()
        return start - left

    def _remove(self, ids: list[str]) -> tuple[list[str], list[tuple[str, str]]]:
        gone, failed = [], []
        for job_id in ids:
            if self._halt.is_set():
                break
            try:
                remove_tree(self.jobs_dir / job_id)
                gone.append(job_id)
            except OSError as e:
                failed.append((job_id, str(e)))
        return gone, failed

    async def orphan_dirs(self) -> int:
        """Remove job directories that have no row (a database reset, or its last commits lost to a
        power cut). Only names the gateway makes are touched; rows are made before directories,
        so a directory with no row belongs to no job, past or future. BATCH names at a time: the
        loop answers between their lookups, and stop() waits for one directory at most."""
        names = await asyncio.to_thread(
            lambda: sorted(p.name for p in self.jobs_dir.iterdir() if JOB_DIR.match(p.name))
        )
        removed = 0
        for i in range(0, len(names), BATCH):
            batch = names[i : i + BATCH]
            orphans = sorted(set(batch) - self.store.known(batch))
            gone, failed = await self._remove_off_loop(orphans)
            for job_id, why in failed:
                log(f"cannot remove {self.jobs_dir / job_id} (no job has it): {why}")
            removed += len(gone)
        return removed
