"""A small asyncio client of the agate jobs API (what tests, benchmarks and scripts use).

    async with GatewayClient("http://127.0.0.1:8000") as gw:
        job = await gw.dev("python bench.py", files={"bench.py": src})
        job = await gw.get(job["job_id"], wait=True, timeout=60)

Every call returns (status, body) through `request`, or the body for the typed helpers, which raise
`GatewayError` (with the API's reason) on a non-2xx answer. The session is closed by `close()`.
"""

from __future__ import annotations

import time
from typing import Any

import aiohttp

TERMINAL = ("succeeded", "failed", "cancelled")


class GatewayError(Exception):
    def __init__(self, status: int, body: Any) -> None:
        self.status = status
        self.body = body
        self.reason = body.get("reason", "") if isinstance(body, dict) else ""
        super().__init__(
            f"HTTP {status} {self.reason}: {body.get('message') if isinstance(body, dict) else body}"
        )


class GatewayClient:
    def __init__(self, url: str, token: str | None = None, timeout: float = 330.0) -> None:
        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.session = aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=timeout))

    async def __aenter__(self) -> GatewayClient:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def close(self) -> None:
        await self.session.close()

    async def request(
        self,
        method: str,
        path: str,
        json: Any = None,
        data: bytes | None = None,
        params: dict[str, str] | None = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, Any]:
        """(HTTP status, parsed JSON body or text)."""
        async with self.session.request(
            method, self.url + path, json=json, data=data, params=params, headers=headers
        ) as r:
            if r.content_type == "application/json":
                return r.status, await r.json()
            return r.status, await r.text()

    async def _ok(self, method: str, path: str, **kw: Any) -> Any:
        status, body = await self.request(method, path, **kw)
        if not 200 <= status < 300:
            raise GatewayError(status, body)
        return body

    async def health(self) -> str:
        return str(await self._ok("GET", "/healthz"))

    async def env(self, gpu: str | None = None, force: bool = False) -> dict[str, Any]:
        params = {"force": "true"} if force else None
        body = await self._ok("GET", "/v1/env" + (f"/{gpu}" if gpu else ""), params=params)
        return body  # type: ignore[no-any-return]

    @staticmethod
    def dev_request(
        command: str,
        files: dict[str, str] | None = None,
        env_vars: dict[str, str] | None = None,
        timeout_s: float = 60,
        hardware: str = "local",
        idempotency_key: str | None = None,
    ) -> dict[str, Any]:
        req: dict[str, Any] = {
            "spec": {"target_hardware": [hardware]},
            "command": command,
            "files": files or {},
            "env_vars": env_vars or {},
            "timeout_s": timeout_s,
        }
        if idempotency_key is not None:
            req["idempotency_key"] = idempotency_key
        return req

    async def dev(self, command: str, **kw: Any) -> dict[str, Any]:
        """Submit a dev job; returns the job (status queued, or the existing job for a known key)."""
        return await self._ok(
            "POST",
            "/v1/jobs/dev",  # type: ignore[no-any-return]
            json=self.dev_request(command, **kw),
        )

    async def get(self, job_id: str, wait: bool = False, timeout: float = 30) -> dict[str, Any]:
        params = {"wait": "true", "timeout": str(timeout)} if wait else None
        return await self._ok(
            "GET",
            f"/v1/jobs/{job_id}",  # type: ignore[no-any-return]
            params=params,
        )

    async def wait(self, job_id: str, timeout: float = 300) -> dict[str, Any]:
        """Long-poll until the job ends or `timeout` passes; returns the last view."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            job = await self.get(job_id, wait=True, timeout=max(0.0, min(left, 60)))
            if job["status"] in TERMINAL or left <= 0:
                return job

    async def jobs(self, **filters: Any) -> list[dict[str, Any]]:
        body = await self._ok("GET", "/v1/jobs", params={k: str(v) for k, v in filters.items()})
        return body["jobs"]  # type: ignore[no-any-return]

    async def cancel(self, job_id: str) -> dict[str, Any]:
        return await self._ok("POST", f"/v1/jobs/{job_id}/cancel")  # type: ignore[no-any-return]
