"""Warm GPU context processes that run Python commands as if they were fresh processes.

`Pool` is imported lazily: a worker imports this package too, and should not pay for asyncio.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from krex_async.ctxpool.base import PoolConfig

if TYPE_CHECKING:
    from krex_async.ctxpool.handle import BrokenWorker, WorkerStartError
    from krex_async.ctxpool.pool import Pool

__all__ = ["BrokenWorker", "Pool", "PoolConfig", "WorkerStartError"]


def __getattr__(name: str) -> Any:
    if name == "Pool":
        from krex_async.ctxpool import pool

        return pool.Pool
    if name in ("BrokenWorker", "WorkerStartError"):
        from krex_async.ctxpool import handle

        return getattr(handle, name)
    raise AttributeError(name)
