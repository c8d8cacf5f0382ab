"""The gateway's secrets stay its own (issue 36 item 6 a, b), checked as real other users:

- a token never sits in the gateway's command line, where every local user reads it (`ps`,
  /proc/PID/cmdline): `--token T` is refused naming --token-file and $KREX_GATEWAY_TOKEN, and a
  token taken from the environment is neither in the cmdline nor in any job's environment;
- a job gets a minimal environment plus what it asks for: a variable an operator left in a root
  gateway's environment does not reach jobs run as another user unless --job-env names it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.security.helpers import USER_PYTHONPATH

from .conftest import JOB_USER, PY, job_python, stack

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: real users read and run as others")

TOKEN = "argv-token-0123456789abcdef0123456789"


def read_as(user: str, path: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(["cat", path], user=user, capture_output=True, timeout=30)


async def test_a_token_is_never_in_the_gateways_command_line(tmp_path: Path) -> None:
    async with stack(tmp_path) as (daemon, _gw, _c):
        home = _gw.state.parent
        state = home / "other"
        env = {
            **{k: v for k, v in os.environ.items() if k not in ("KREX_GATEWAY_TOKEN", "KREX_SOCKET")},
            "PYTHONPATH": USER_PYTHONPATH,
        }
        argv = [PY, "-m", "krex_async.gateway", "--listen", "127.0.0.1:0", "--socket", daemon.socket]
        argv += ["--run-as", JOB_USER, "--job-python", job_python(), "--state-dir", str(state)]
        proc = subprocess.Popen([*argv, "--token", TOKEN], stderr=subprocess.PIPE, env=env, text=True)
        try:
            deadline = time.monotonic() + 30
            while proc.poll() is None and not (state / "gateway.json").exists():
                assert time.monotonic() < deadline, "the gateway neither started nor refused"
                time.sleep(0.05)
            if proc.poll() is None:  # it started: what another user reads of it
                seen = read_as("krextest2", f"/proc/{proc.pid}/cmdline")
                assert TOKEN.encode() not in seen.stdout, "another user reads the token in the cmdline"
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            proc.wait(15)
        assert proc.stderr is not None
        said = proc.stderr.read()
        assert proc.returncode == 2, said
        assert "--token-file" in said and "$KREX_GATEWAY_TOKEN" in said and "/proc/PID/cmdline" in said, said
        assert TOKEN not in said

    # From the environment: served, and neither another user nor a job finds it.
    async with stack(tmp_path, env={"KREX_GATEWAY_TOKEN": TOKEN}, token=TOKEN) as (_, gw, c):
        assert "token from $KREX_GATEWAY_TOKEN" in gw.logs(), gw.logs()
        seen = read_as("krextest2", f"/proc/{gw.proc.pid}/cmdline")
        assert seen.returncode == 0 and TOKEN.encode() not in seen.stdout
        environ = read_as("krextest2", f"/proc/{gw.proc.pid}/environ")
        assert environ.returncode != 0 and TOKEN.encode() not in environ.stdout  # 0400, root's
        job = await c.dev(f"cat /proc/{gw.proc.pid}/cmdline; echo; env")
        done = await c.wait(job["job_id"], 60)
        assert done["status"] == "succeeded", done
        assert TOKEN not in done["result"]["stdout"], done["result"]["stdout"]


async def test_a_job_gets_a_minimal_environment_not_the_gateways(tmp_path: Path) -> None:
    planted = {
        "OPERATOR_DB_PASSWORD": "hunter2-planted",
        "AWS_SECRET_ACCESS_KEY": "aws-planted",
        "NAMED_FOR_JOBS": "named-planted",
        "LANG": "C.UTF-8",
        "CUDA_CACHE_DISABLE": "1",
    }
    async with stack(tmp_path, "--job-env", "NAMED_FOR_JOBS", env=planted) as (_, gw, c):
        job = await c.dev(
            "python -c 'import json, os; print(json.dumps(dict(os.environ)))'",
            env_vars={"ASKED": "by-the-job"},
        )
        done = await c.wait(job["job_id"], 60)
        assert done["status"] == "succeeded", done
        env = json.loads(done["result"]["stdout"])
        assert "OPERATOR_DB_PASSWORD" not in env and "AWS_SECRET_ACCESS_KEY" not in env, env
        assert "hunter2-planted" not in done["result"]["stdout"]
        assert env["NAMED_FOR_JOBS"] == "named-planted"  # --job-env names it: passed on
        assert env["ASKED"] == "by-the-job" and env["KREX_AUTO_REGION"] == "1"
        assert env["LANG"] == "C.UTF-8" and env["CUDA_CACHE_DISABLE"] == "1"
        assert env["USER"] == env["LOGNAME"] == JOB_USER and env["KREX_GATEWAY_JOB"] == job["job_id"]
        assert str(gw.state / "bin") == env["PATH"].split(":")[0]
        assert not set(env) - {
            *planted,
            "ASKED",
            "PATH",
            "PYTHONPATH",
            "HOME",
            "USER",
            "LOGNAME",
            "TORCH_EXTENSIONS_DIR",
            "ATREX_LOCAL_JOB_ID",
            "KREX_GATEWAY_JOB",
            "PWD",
            "SHLVL",
            "_",
            *(k for k in env if k.startswith(("KREX_", "LC_", "CUDA_", "NVIDIA_", "TRITON_", "TORCH_"))),
            *(k for k in env if k in ("LANGUAGE", "TZ", "TERM", "TMPDIR", "LD_LIBRARY_PATH")),
        }, sorted(env)
