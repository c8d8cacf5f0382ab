"""Job views on the wire: one encoding per finished job, shared by its readers and streamed.

A result can be tens of MB (output up to the 32 MiB per-stream limit). Building the response anew
per reader costs each reader the result twice over (decoded, re-encoded) before a byte is sent. A
finished job never changes, so its JSON bytes are made once (Store.render splices the stored text),
kept in a small LRU bounded in bytes, and written to each reader in slices with a drain between
them: a reader costs one slice of buffer however large the result and however slow the reader.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Callable
from typing import TypeVar

from aiohttp import web

from krex_async.gateway.limits import TERMINAL
from krex_async.gateway.store import Store

T = TypeVar("T")


def request_key(name: str, kind: type[T]) -> web.RequestKey[T]:
    """A typed key for per-request state: aiohttp 3.14+ warns (NotAppKeyWarning) on a plain
    string key; an older aiohttp has neither the class nor the warning, and takes the string."""
    if hasattr(web, "RequestKey"):
        return web.RequestKey(name, kind)
    return name  # type: ignore[return-value]


TRACE = request_key("trace", str)  # the request's trace id, set by the app's middleware

SLICE = 256 * 1024
CACHE_BYTES = 256 * 1024 * 1024
HEADERS = {"Content-Type": "application/json; charset=utf-8"}


class Views:
    """Renders and caches job views; `stream_*` write them to a request."""

    def __init__(
        self,
        store: Store,
        cache_bytes: int = CACHE_BYTES,
        waiting: Callable[[str, str], str] = lambda job_id, status: "",
    ) -> None:
        self.store = store
        self.waiting = waiting  # (job id, status) -> why it has not started: the view's `waiting`
        self.cache_bytes = cache_bytes
        self._cache: OrderedDict[str, bytes] = OrderedDict()
        self._held = 0

    def body(self, job_id: str, owner: str | None) -> bytes | None:
        """The job's view as JSON bytes (None: not found or not `owner`'s)."""
        if owner is not None and self.store.status(job_id, owner) is None:
            return None
        cached = self._cache.get(job_id)
        if cached is not None:
            self._cache.move_to_end(job_id)
            return cached
        rendered = self.store.render(job_id, owner)
        if rendered is None:
            return None
        status, data = rendered
        if status in ("queued", "running") and (why := self.waiting(job_id, status)):
            data = data[:-1] + b',"waiting":' + json.dumps(why, ensure_ascii=False).encode() + b"}"
        if status in TERMINAL and len(data) <= self.cache_bytes // 4:
            self._cache[job_id] = data
            self._held += len(data)
            while self._held > self.cache_bytes:
                _, old = self._cache.popitem(last=False)
                self._held -= len(old)
        return data

    def forget(self, job_ids: list[str]) -> None:
        """These jobs are gone (their retention ended): their cached views go too."""
        for job_id in job_ids:
            data = self._cache.pop(job_id, None)
            if data is not None:
                self._held -= len(data)

    @staticmethod
    async def _write(resp: web.StreamResponse, data: bytes) -> None:
        view = memoryview(data)
        for i in range(0, len(view), SLICE):
            await resp.write(view[i : i + SLICE])  # drains: at most a slice waits per reader

    async def stream_job(
        self, request: web.Request, job_id: str, owner: str | None
    ) -> web.StreamResponse | None:
        data = self.body(job_id, owner)
        if data is None:
            return None
        resp = web.StreamResponse(status=200, headers=HEADERS)
        resp.content_length = len(data)
        resp.headers["X-Trace-Id"] = request[TRACE]
        await resp.prepare(request)
        await self._write(resp, data)
        await resp.write_eof()
        return resp

    async def stream_list(self, request: web.Request, ids: list[str]) -> web.StreamResponse:
        """{"jobs": [...]}: one job rendered at a time, so a long list of large jobs costs one
        job's encoding, not the list's."""
        resp = web.StreamResponse(status=200, headers=HEADERS)
        resp.headers["X-Trace-Id"] = request[TRACE]
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        await resp.write(b'{"jobs":[')
        first = True
        for job_id in ids:
            data = self.body(job_id, None)
            if data is None:
                continue
            await resp.write(b"" if first else b",")
            first = False
            await self._write(resp, data)
        await resp.write(b"]}")
        await resp.write_eof()
        return resp
