"""The queue timeout (`--queue-timeout`): a job that waited that long without being started (no
daemon or fleet node to take it, every --max-running slot taken, or its command queued in the
daemon) ends failed, reason `queue_timeout`, so a client polling for it hears why instead of
waiting for ever.

    QueueTimeout.start() -> task: sleep until the oldest queued job's deadline (its submission
        plus `timeout`; a whole `timeout` when nothing is queued: no job can expire sooner)
        -> store.fail_all('queued', created before now - timeout) -> on_change(id) (long polls answer)

A queued job holds nothing but its row (its directory is made when it is claimed), so failing it
releases everything. The store's `WHERE status='queued'` makes a job either claimed or expired,
never both.

A job handed to the daemon is `running` but may still wait in the daemon's queue (its device held
under --policy command): to its user it has not started either. For such a command (Accepted with
`queued`), JobRunner runs watch():

    sleep until the job's deadline -> Started heard (handle.pid)? untouched
        -> Cancel(queued_only) -> the daemon ends it unstarted, or refuses (not_queued: it started
           as the cancel came) and it runs on -> judge(): its report (cancelled, never started)
           is the job's queue_timeout, result null, its directory kept; its slot frees as it ends

The daemon decides whether it is still queued, in one step of its loop, so a command that started
before the deadline is never touched. The job's own timeout counts from its command's start.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sqlite3
import sys
import time
from collections.abc import Callable
from typing import Any, Protocol

from krex_async.client.submit import KrexError
from krex_async.gateway.store import Store, error

REASON = "queue_timeout"


def in_daemon_queue(device: str, policy: str) -> str:
    """Why a job handed to the daemon has not started (its view's `waiting`, its queue_timeout)."""
    return f"queued in the krex daemon for device {device} (policy {policy})"


class Canceller(Protocol):
    async def cancel(self, command: str, sig: int = ..., queued_only: bool = ...) -> None: ...


class Queued(Protocol):
    """What watch() reads of a command's handle (CommandHandle, or FleetHandle over a fleet)."""

    client: Any  # a Client or FleetClient: a Canceller
    command: str
    device: str
    pid: int | None  # set once its Started is heard


class QueueTimeout:
    """Fails jobs queued longer than `timeout` seconds; `stop()` ends its task."""

    def __init__(
        self,
        store: Store,
        timeout: float,
        on_change: Callable[[str], None],
        waiting: Callable[[], str] = lambda: "",
    ) -> None:
        self.store, self.timeout, self.on_change = store, timeout, on_change
        self.waiting = waiting  # why queued jobs are not being started now (the runner's)
        self.withdrawn: dict[str, str] = {}  # job id -> why, for a command cancelled in the daemon's queue
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def expire(self) -> list[str]:
        """Fail the jobs queued for more than `timeout` now; returns their ids."""
        why = self.waiting()
        ids = self.store.fail_all(
            "queued",
            REASON,
            self.message(why or "every --max-running slot was taken"),
            created_before=time.time() - self.timeout,
        )
        for job_id in ids:
            self.on_change(job_id)
        return ids

    def message(self, why: str) -> str:
        return f"the job was not started within the gateway's queue timeout of {self.timeout:g} s ({why})"

    async def watch(self, job_id: str, handle: Queued, policy: str) -> None:
        """For a job whose command the daemon queued: at the job's deadline, withdraw the command
        if it is still queued there. A daemon that refuses (it started meanwhile) or a lost
        connection leaves the command to run and end as it would."""
        try:
            job = self.store.get(job_id)
            created = job["created_at"] if job is not None else time.time()
        except sqlite3.Error as e:  # locked past its timeout: timed from now (late, never early)
            print(
                f"krex gateway: cannot read job {job_id} ({e}); its queue timeout runs from now",
                file=sys.stderr,
            )
            created = time.time()
        await asyncio.sleep(max(created + self.timeout - time.time(), 0.0))
        if handle.pid is not None:
            return  # Started heard: it runs
        self.withdrawn[job_id] = in_daemon_queue(handle.device, policy)
        client: Canceller = handle.client
        # Refused (not_queued: it started as the cancel came; or a fleet's retry of a cancel that
        # had ended it), not sent (unsupported: an older daemon would kill it even if started) or a
        # lost connection: judge() reads what happened from its report.
        with contextlib.suppress(KrexError):
            await client.cancel(handle.command, signal.SIGKILL, queued_only=True)

    def forget(self, job_id: str) -> None:
        """The job ended (judged or not): nothing of it is kept here."""
        self.withdrawn.pop(job_id, None)

    def judge(self, job_id: str, report: Any) -> dict[str, Any] | None:
        """The job's error when watch() asked to withdraw its command and its report says it was
        cancelled before it started; else None (it started: it ended as it would have)."""
        why = self.withdrawn.pop(job_id, None)
        if why is None or report.state != "cancelled" or report.started_at:
            return None
        return error(REASON, self.message(why))

    async def _run(self) -> None:
        while True:
            try:
                self.expire()
                oldest = self.store.oldest_queued()
            except Exception as e:  # noqa: BLE001 - a locked database: said, tried again
                print(f"krex gateway: queue timeout check failed ({e}); again in 1 s", file=sys.stderr)
                oldest = time.time() - self.timeout + 1.0
            wait = self.timeout if oldest is None else oldest + self.timeout - time.time()
            await asyncio.sleep(min(max(wait, 0.01), self.timeout))
