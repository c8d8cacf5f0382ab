"""The queue timeout (`--queue-timeout`): a job that waited that long without being started (no
daemon or fleet node to take it, or every --max-running slot taken) ends failed, reason
`queue_timeout`, so a client polling for it hears why instead of waiting for ever.

    QueueTimeout.start() -> task: sleep until the oldest queued job's deadline (its submission
        plus `timeout`; a whole `timeout` when nothing is queued: no job can expire sooner)
        -> store.fail_all('queued', created before now - timeout) -> on_change(id) (long polls answer)

A queued job holds nothing but its row (its directory is made when it is claimed), so failing it
releases everything. The store's `WHERE status='queued'` makes a job either claimed or expired,
never both. Only the gateway's own queue is timed: a job handed to the daemon is `running`, and its
own timeout counts from its command's start.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable

from krex_async.gateway.store import Store

REASON = "queue_timeout"


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
            f"the job was not started within the gateway's queue timeout of {self.timeout:g} s"
            + (f" ({why})" if why else " (every --max-running slot was taken)"),
            created_before=time.time() - self.timeout,
        )
        for job_id in ids:
            self.on_change(job_id)
        return ids

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
