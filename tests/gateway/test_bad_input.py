"""Malformed requests get a JSON error with a reason (400, 404, 405, 413, 422, 501), never a crash;
unsafe file paths never write outside the job directory; remote binds need --allow-remote and never
go without a token."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from pathlib import Path

import pytest

from krex_async.gateway import limits as L
from krex_async.gateway.files import write_files
from tests.conftest import ROOT, run_daemon

from .conftest import PY, gateway_home, stack, start_gateway

UNSAFE = [
    "/etc/passwd",
    "../x",
    "a/../../x",
    "a/./b",
    "./a",
    "a//b",
    "a/",
    "",
    "a\x00b",
    "a\\..\\b",
    "x" * 300,
]


@pytest.mark.parametrize("name", UNSAFE)
def test_unsafe_paths_are_refused(name: str) -> None:
    with pytest.raises(L.BadRequest) as e:
        L.safe_path(name)
    assert e.value.reason == "unsafe_path"


def test_write_files_does_not_follow_symlinks(tmp_path: Path) -> None:
    root = tmp_path / "job"
    outside = tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (root / "link").symlink_to(outside)
    (root / "file").symlink_to(outside / "target")
    with pytest.raises(OSError):
        write_files(root, {"link/escaped": "x"})
    with pytest.raises(OSError):
        write_files(root, {"file": "x"})
    assert list(outside.iterdir()) == []
    write_files(root, {"ok/inner/f.txt": "fine"})
    assert (root / "ok" / "inner" / "f.txt").read_text() == "fine"


async def test_malformed_requests(tmp_path: Path) -> None:
    async with stack(tmp_path, "--max-body", "20000", "--max-file", "4000", "--max-timeout", "100") as (
        _,
        gw,
        c,
    ):
        good = c.dev_request("true")

        async def post(
            body: object = None, raw: bytes | None = None, path: str = "/v1/jobs/dev"
        ) -> tuple[int, dict[str, object]]:
            status, resp = await c.request("POST", path, json=body if raw is None else None, data=raw)
            assert isinstance(resp, dict), resp
            assert {"reason", "message", "trace_id"} <= set(resp), resp
            return status, resp

        async def expect(status: int, reason: str, **kw: object) -> None:
            got, resp = await post(**kw)  # type: ignore[arg-type]
            assert (got, resp["reason"]) == (status, reason), resp

        await expect(400, "invalid_json", raw=b"{not json")
        for field in ("command", "author"):  # a lone surrogate parses, but no UTF-8 holds it
            await expect(400, "invalid_json", raw=json.dumps({**good, field: "echo \ud800"}).encode())
        await expect(400, "invalid_json", raw=json.dumps({**good, "files": {"\udc80.py": "x"}}).encode())
        await expect(400, "invalid_json", raw=b"\xff\xfe")
        await expect(400, "empty_body", raw=b"")
        await expect(422, "invalid_request", body=[1, 2])
        await expect(422, "invalid_command", body={**good, "command": ""})
        await expect(422, "invalid_command", body={k: v for k, v in good.items() if k != "command"})
        await expect(422, "invalid_command", body={**good, "command": ["ls"]})
        await expect(422, "invalid_target_hardware", body={k: v for k, v in good.items() if k != "spec"})
        await expect(422, "invalid_target_hardware", body={**good, "spec": {"target_hardware": []}})
        await expect(422, "unsupported_hardware", body={**good, "spec": {"target_hardware": ["B200"]}})
        for t in (0, -1, "10", True, 1e9, 101):
            await expect(422, "invalid_timeout", body={**good, "timeout_s": t})
        await expect(
            422,
            "invalid_timeout",
            raw=json.dumps({**good}).replace('"timeout_s": 60', '"timeout_s": NaN').encode(),
        )
        await expect(422, "invalid_env_vars", body={**good, "env_vars": {"1BAD": "x"}})
        await expect(422, "invalid_env_vars", body={**good, "env_vars": {"A": 1}})
        await expect(422, "invalid_env_vars", body={**good, "env_vars": {"KREX_SOCKET": "/x"}})
        await expect(422, "invalid_env_vars", body={**good, "env_vars": ["A=1"]})
        await expect(422, "invalid_idempotency_key", body={**good, "idempotency_key": ""})
        await expect(422, "invalid_idempotency_key", body={**good, "idempotency_key": 7})
        for name in ("/abs", "../up", "a/../../up", "a\x00b", "./a"):
            await expect(422, "unsafe_path", body={**good, "files": {name: "x"}})
        await expect(422, "unsafe_path", body={**good, "files": {"a": "x", "a/b": "y"}})
        await expect(422, "invalid_files", body={**good, "files": {"a": 1}})
        await expect(422, "invalid_files", body={**good, "files": ["a"]})
        await expect(422, "file_too_large", body={**good, "files": {"big": "x" * 5000}})
        await expect(413, "request_too_large", body={**good, "command": "true " + "x" * 30000})
        await expect(413, "request_too_large", raw=b" " * 30000)

        async def chunks():  # no Content-Length: the limit holds while reading
            for _ in range(30):
                yield b" " * 1000

        got, resp = await c.request("POST", "/v1/jobs/dev", data=chunks())  # type: ignore[arg-type]
        assert (got, resp["reason"]) == (413, "request_too_large"), resp
        await expect(501, "kind_not_supported", body=good, path="/v1/jobs/disassemble")
        await expect(501, "kind_not_supported", body=good, path="/v1/jobs/eval")
        await expect(501, "kind_not_supported", body=good, path="/v1/jobs/profile")
        await expect(501, "kind_not_supported", body=good, path="/v1/jobs/teleport")
        await expect(404, "route_not_found", body=good, path="/v1/nope")
        await expect(404, "job_not_found", body=None, raw=b"", path="/v1/jobs/dv_missing/cancel")

        for path, status, reason in (
            ("/nope", 404, "route_not_found"),
            ("/v1/jobs/dv_missing", 404, "job_not_found"),
            ("/v1/jobs?kind=teleport", 400, "invalid_kind"),
            ("/v1/jobs?status=done", 400, "invalid_status"),
            ("/v1/jobs?limit=ten", 400, "invalid_limit"),
            ("/v1/jobs?limit=0", 400, "invalid_limit"),
            ("/v1/jobs?sort=age", 400, "invalid_sort"),
            ("/v1/env?force=maybe", 400, "invalid_force"),
        ):
            got, resp = await c.request("GET", path)
            assert (got, resp["reason"]) == (status, reason), (path, resp)
        got, resp = await c.request("DELETE", "/v1/jobs")
        assert (got, resp["reason"]) == (405, "method_not_allowed")

        done = await c.dev("true")
        await c.wait(done["job_id"], 30)  # a finished job's long poll checks its timeout too
        got, resp = await c.request("GET", f"/v1/jobs/{done['job_id']}?wait=true&timeout=soon")
        assert (got, resp["reason"]) == (400, "invalid_timeout"), resp
        job = await c.dev("sleep 5")
        for q, reason in (
            ("wait=maybe", "invalid_wait"),
            ("wait=true&timeout=soon", "invalid_timeout"),
            ("wait=true&timeout=-1", "invalid_timeout"),
            ("wait=true&timeout=inf", "invalid_timeout"),
        ):
            got, resp = await c.request("GET", f"/v1/jobs/{job['job_id']}?{q}")
            assert (got, resp["reason"]) == (400, reason), (q, resp)
        await c.cancel(job["job_id"])

        # Nothing malformed was stored or written; the gateway still serves.
        assert sorted(j["job_id"] for j in await c.jobs()) == sorted([job["job_id"], done["job_id"]])
        assert set(os.listdir(gw.state / "jobs")) <= {job["job_id"], done["job_id"]}
        assert not (tmp_path / "up").exists()
        assert await c.health() == "ok"


async def test_remote_bind_needs_allow_remote_and_a_token(tmp_path: Path) -> None:
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    async with run_daemon() as daemon, contextlib.AsyncExitStack() as stack:
        base = [
            PY,
            "-m",
            "krex_async.gateway",
            "--state-dir",
            str(tmp_path / "s"),
            "--socket",
            daemon.socket,
            "--listen",
            "0.0.0.0:0",
        ]
        for extra, why in (
            ([], "--allow-remote"),
            (["--allow-remote", "--no-auth"], "--no-auth is for loopback only"),
        ):
            r = subprocess.run(base + extra, capture_output=True, text=True, timeout=30, env=env)
            assert r.returncode == 2 and why in r.stderr, r.stderr
        home = stack.enter_context(gateway_home())  # jobs run as another user: a reachable state dir
        gw = start_gateway(
            daemon.socket,
            home / "gw",
            "--allow-remote",
            env={"KREX_GATEWAY_TOKEN": "s3cret"},
            listen="0.0.0.0:0",
            token="s3cret",
        )
        gw.url = gw.url.replace("0.0.0.0", "127.0.0.1")
        authed, anon, wrong = gw.client(), type(gw.client())(gw.url), type(gw.client())(gw.url, token="guess")
        try:
            assert await anon.health() == "ok"  # health stays open for probes
            for c in (anon, wrong):
                got, resp = await c.request("GET", "/v1/jobs")
                assert (got, resp["reason"]) == (401, "unauthorized")
                got, resp = await c.request("POST", "/v1/jobs/dev", json=c.dev_request("true"))
                assert got == 401
            assert await authed.jobs() == []
            job = await authed.dev("echo remote")
            assert (await authed.wait(job["job_id"], 30))["result"]["stdout"] == "remote\n"
        finally:
            for c in (authed, anon, wrong):
                await c.close()
            gw.stop()
