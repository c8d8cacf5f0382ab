"""Warm GPU context processes that run Python commands as if they were fresh processes.

`Pool` is imported lazily: a worker imports this package too, and should not pay for asyncio.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from krex_async.ctxpool.base import PoolConfig

if TYPE_CHECKING:
    from krex_async.ctxpool.pool import BrokenWorker, Pool, WorkerStartError

__all__ = ["BrokenWorker", "Pool", "PoolConfig", "WorkerStartError"]


def __getattr__(name: str) -> Any:
    if name in ("Pool", "BrokenWorker", "WorkerStartError"):
        from krex_async.ctxpool import pool

        return getattr(pool, name)
    raise AttributeError(name)
