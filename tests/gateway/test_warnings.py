"""The gateway runs free of aiohttp's NotAppKeyWarning: its per-request state uses typed keys
(web.RequestKey where aiohttp has it), so a deployment that turns warnings into errors still serves.

aiohttp warns once per process per string key, so the check runs a fresh gateway process with that
warning made an error, and drives the routes that store request state."""

from __future__ import annotations

from pathlib import Path

from .conftest import stack

STRICT = (
    "-c",
    "import runpy, sys, warnings; from aiohttp import web; "
    "warnings.simplefilter('error', web.NotAppKeyWarning); sys.argv[0] = 'krex-gateway'; "
    "runpy.run_module('krex_async.gateway', run_name='__main__')",
)


async def test_the_gateway_serves_with_not_app_key_warnings_as_errors(tmp_path: Path) -> None:
    async with stack(tmp_path, launcher=STRICT) as (_, gw, c):
        status, body = await c.request("GET", "/v1/jobs")
        assert status == 200, body
        job = await c.dev("echo strict")
        done = await c.wait(job["job_id"], 30)
        assert done["status"] == "succeeded" and done["result"]["stdout"] == "strict\n", done
        status, body = await c.request("GET", "/v1/jobs/nope")
        assert (status, body["reason"]) == (404, "job_not_found"), body
        assert "NotAppKeyWarning" not in gw.logs() and "RequestKey" not in gw.logs(), gw.logs()
