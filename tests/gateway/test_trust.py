"""The gateway's trust model, for real, as root with real users (issue 20 items 2, 4 and 9):

- by default every request needs the token the gateway wrote into a 0600 file at first start;
- jobs never run as root: as --run-as, as `nobody` when none is given, per token where the token
  file names a user;
- a caller lists, reads, waits on and cancels only its own jobs (idempotency keys included);
- a job cannot read another job's directory, nor change the gateway's database or shims, nor make
  the gateway read a file for it through a link;
- malformed bodies, however deeply nested, are 400s.
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
import subprocess
from pathlib import Path

import pytest

from krex_async.gateway.client import GatewayClient
from tests.conftest import run_daemon

from .conftest import PY, gateway_home, job_python, stack, start_gateway
from .test_kinds import bundle, install_tools

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: real users run the jobs")


def uid_of(name: str) -> int:
    import pwd

    return pwd.getpwnam(name).pw_uid


async def test_a_default_gateway_needs_its_token_and_runs_jobs_as_nobody(tmp_path: Path) -> None:
    async with stack(tmp_path, as_test_user=False) as (_, gw, c):
        token_file = gw.state / "token"
        st = os.lstat(token_file)
        assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == 0
        assert "jobs run as 'nobody'" in gw.logs() and str(token_file) in gw.logs()
        async with GatewayClient(gw.url) as anon, GatewayClient(gw.url, "wrong-token") as wrong:
            assert await anon.health() == "ok"  # probes stay open
            for other in (anon, wrong):
                for method, path, body in (
                    ("GET", "/v1/jobs", None),
                    ("GET", "/v1/env", None),
                    ("POST", "/v1/jobs/dev", c.dev_request("id")),
                ):
                    got, resp = await other.request(method, path, json=body)
                    assert (got, resp["reason"]) == (401, "unauthorized"), (path, resp)
        job = await c.dev("id -u; head -c 40 /etc/shadow")
        view = await c.wait(job["job_id"], 30)
        assert view["result"]["stdout"].splitlines()[0] == str(uid_of("nobody")), view["result"]
        assert view["status"] == "failed" and "Permission denied" in view["result"]["stderr"]


async def test_a_local_user_cannot_read_the_token(tmp_path: Path) -> None:
    async with stack(tmp_path) as (_, gw, _c):
        r = subprocess.run(["cat", str(gw.state / "token")], user="krextest2", capture_output=True, text=True)
        assert r.returncode != 0 and "Permission denied" in r.stderr


def token_file(home: Path, lines: str, mode: int = 0o600) -> Path:
    path = home / "tokens"
    path.write_text(lines)
    path.chmod(mode)
    return path


ALICE, MALLORY = "alice-token-0123456789abcdef", "mallory-token-0123456789abcdef"


async def test_each_token_sees_only_its_jobs_and_runs_as_its_user(tmp_path: Path) -> None:
    with gateway_home() as home:
        tokens = token_file(home, f"alice {ALICE} krextest\n# a comment\nmallory {MALLORY} krextest2\n")
        async with stack(tmp_path, "--token-file", str(tokens)) as (_, gw, _c):
            async with GatewayClient(gw.url, ALICE) as a, GatewayClient(gw.url, MALLORY) as m:
                mine = await a.dev(
                    "id -u; cat secret.txt; exec sleep 30",
                    files={"secret.txt": "alice-secret-42\n"},
                    idempotency_key="same-key",
                )
                for _ in range(200):
                    if (await a.get(mine["job_id"]))["krex_command"]:
                        break
                    await asyncio.sleep(0.05)
                # Another token: the job does not exist for it, in every route.
                assert await m.jobs() == []
                for method, path in (
                    ("GET", f"/v1/jobs/{mine['job_id']}"),
                    ("GET", f"/v1/jobs/{mine['job_id']}?wait=true&timeout=1"),
                    ("GET", f"/v1/evals/{mine['job_id']}"),
                    ("POST", f"/v1/jobs/{mine['job_id']}/cancel"),
                ):
                    got, resp = await m.request(method, path)
                    assert (got, resp["reason"]) == (404, "job_not_found"), (path, resp)
                # Its own idempotency key space: the same key is a new job, not alice's.
                theirs = await m.dev("id -u", idempotency_key="same-key")
                assert theirs["job_id"] != mine["job_id"]
                view = await m.wait(theirs["job_id"], 30)
                assert view["result"]["stdout"] == f"{uid_of('krextest2')}\n"
                assert [j["job_id"] for j in await a.jobs()] == [mine["job_id"]]
                jobdir = gw.state / "jobs" / mine["job_id"]
                st = os.stat(jobdir)
                assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (uid_of("krextest"), 0o700)
                assert (await a.get(mine["job_id"]))["status"] == "running"
                await a.cancel(mine["job_id"])


async def test_a_job_cannot_reach_the_gateway_state_or_another_job(tmp_path: Path) -> None:
    with gateway_home() as home:
        tokens = token_file(home, f"alice {ALICE} krextest\nmallory {MALLORY} krextest2\n")
        async with stack(tmp_path, "--token-file", str(tokens)) as (_, gw, _c):
            state = gw.state
            shim = (state / "bin" / "python3").read_bytes()
            async with GatewayClient(gw.url, ALICE) as a, GatewayClient(gw.url, MALLORY) as m:
                victim = await a.wait((await a.dev("true", files={"secret.txt": "s3cr3t\n"}))["job_id"], 30)
                attacks = {
                    "list_jobs": f"ls {state}/jobs",
                    "read_other": f"cat {state}/jobs/{victim['job_id']}/secret.txt",
                    "write_db": f"echo x >> {state}/jobs.db",
                    "read_db": f"head -c 16 {state}/jobs.db",
                    "replace_shim": f"echo 'echo pwned' > {state}/bin/python3",
                    "rename_shim": f"mv {state}/bin/python3 {state}/bin/x",
                    "new_file": f"touch {state}/bin/python4",
                    "read_token": f"cat {tokens}",
                }
                for name, cmd in attacks.items():
                    view = await m.wait((await m.dev(cmd))["job_id"], 30)
                    assert view["status"] == "failed", (name, view["result"])
                    assert "s3cr3t" not in view["result"]["stdout"], name
                    assert "denied" in view["result"]["stderr"], (name, view["result"])
                assert (state / "bin" / "python3").read_bytes() == shim
                assert not (state / "bin" / "python4").exists()
                assert await a.get(victim["job_id"]) == victim  # its record is as it was


EVIL_EVAL = """
import argparse, os, pathlib, sys
p = argparse.ArgumentParser()
for a in ("--input", "--reference-dir", "--output", "--atol", "--rtol", "--num-correctness-cases",
          "--bench-iters"):
    p.add_argument(a)
a = p.parse_args()
out = pathlib.Path(a.output)
out.mkdir(parents=True)
os.symlink(os.environ["TARGET"], out / "eval_result.json")
sys.exit(1)
"""


async def test_the_gateway_does_not_follow_a_jobs_link_to_read_its_result(
    tmp_path: Path, gwhome: Path
) -> None:
    secret = gwhome / "root-only.json"
    secret.write_text(json.dumps({"root_secret": "do-not-leak"}))
    secret.chmod(0o600)
    bench, env = install_tools(gwhome / "scratch", EVIL_EVAL)
    async with stack(tmp_path, "--atrex-bench-root", str(bench), env=env) as (_, _gw, c):
        status, job = await c.request(
            "POST", "/v1/jobs/eval", json={**bundle(c), "env_vars": {"TARGET": str(secret)}}
        )
        assert status == 202, job
        view = await c.wait(job["job_id"], 60)
        assert view["status"] == "failed" and view["error"]["reason"] == "invalid_eval_result"
        assert "do-not-leak" not in json.dumps(view)


async def test_refused_configurations(gwhome: Path) -> None:
    async with run_daemon() as daemon:

        def start(*args: str, user: str | None = None) -> subprocess.CompletedProcess[str]:
            from tests.security.helpers import USER_PYTHONPATH

            return subprocess.run(
                [
                    job_python() if user else PY,
                    "-m",
                    "krex_async.gateway",
                    "--listen",
                    "127.0.0.1:0",
                    "--socket",
                    daemon.socket,
                    *args,
                ],
                capture_output=True,
                text=True,
                timeout=30,
                user=user,
                env={"PYTHONPATH": USER_PYTHONPATH, "PATH": "/usr/bin:/bin"},
                cwd="/",
            )

        state = str(gwhome / "s")
        r = start("--state-dir", state, "--run-as", "root")
        assert r.returncode == 2 and "never run as root" in r.stderr, r.stderr
        r = start("--state-dir", state, "--no-auth", "--token-file", str(gwhome / "t"))
        assert r.returncode == 2 and "--no-auth cannot be combined" in r.stderr, r.stderr
        loose = token_file(gwhome, f"{ALICE}\n", 0o644)
        r = start("--state-dir", state, "--token-file", str(loose))
        assert r.returncode == 2 and "chmod 600" in r.stderr, r.stderr
        other = gwhome / "theirs"
        other.mkdir()
        os.chown(other, uid_of("krextest"), -1)
        r = start("--state-dir", str(other))
        assert r.returncode == 2 and "belongs to uid" in r.stderr, r.stderr
        # Not root: it cannot run jobs as anyone else.
        mine = gwhome / "scratch" / "as-alice"
        r = start("--state-dir", str(mine), "--run-as", "krextest2", user="krextest")
        assert r.returncode == 2 and "only a gateway started as root" in r.stderr, r.stderr


async def test_no_auth_says_what_it_does(tmp_path: Path) -> None:
    async with stack(tmp_path, "--no-auth") as (_, gw, _c):
        assert "NO AUTHENTICATION" in gw.logs()
        async with GatewayClient(gw.url) as anon:
            job = await anon.dev("echo open")
            assert (await anon.wait(job["job_id"], 30))["result"]["stdout"] == "open\n"


async def test_deeply_nested_bodies_are_400s(tmp_path: Path) -> None:
    async with stack(tmp_path) as (_, _gw, c):
        good = c.dev_request("true")
        nested: object = "x"
        for _ in range(200):
            nested = [nested]
        for raw in (
            b"[" * 100_000,
            b"[" * 100_000 + b"]" * 100_000,
            b'{"a":' * 50_000 + b"1" + b"}" * 50_000,
            json.dumps({**good, "extra": nested}).encode(),
        ):
            got, resp = await c.request(
                "POST", "/v1/jobs/dev", data=raw, headers={"Content-Type": "application/json"}
            )
            assert (got, resp["reason"]) == (400, "invalid_json"), resp
        assert await c.health() == "ok"
        job = await c.dev("echo still")
        assert (await c.wait(job["job_id"], 30))["result"]["stdout"] == "still\n"


async def test_a_job_queued_before_owners_existed_never_runs_as_root(gwhome: Path) -> None:
    """A database from before run-as: its queued job runs as the gateway's jobs' user."""
    import sqlite3

    state = gwhome / "gw"
    state.mkdir()
    db = sqlite3.connect(state / "jobs.db")
    db.executescript("""
        CREATE TABLE jobs (seq INTEGER PRIMARY KEY AUTOINCREMENT, job_id TEXT NOT NULL UNIQUE,
            kind TEXT NOT NULL, status TEXT NOT NULL, request TEXT NOT NULL, result TEXT,
            error TEXT, trace_id TEXT NOT NULL, author TEXT, idempotency_key TEXT,
            krex_command TEXT, created_at REAL NOT NULL, updated_at REAL NOT NULL,
            started_at REAL, finished_at REAL);
    """)
    db.execute(
        "INSERT INTO jobs (job_id, kind, status, request, trace_id, created_at, "
        "updated_at) VALUES ('dv_legacy', 'dev', 'queued', ?, 't', 1, 1)",
        (
            json.dumps(
                {
                    "command": "id -u",
                    "files": {},
                    "env_vars": {},
                    "timeout_s": 30,
                    "spec": {"target_hardware": ["local"]},
                }
            ),
        ),
    )
    db.commit()
    db.close()
    async with run_daemon() as daemon:
        gw = start_gateway(daemon.socket, state)  # as root, no --run-as: nobody
        try:
            async with gw.client() as c:
                view = await c.wait("dv_legacy", 30)
            assert view["status"] == "succeeded", view
            assert view["result"]["stdout"] == f"{uid_of('nobody')}\n"
        finally:
            gw.stop()
