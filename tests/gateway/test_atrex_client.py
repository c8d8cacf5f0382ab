"""The real Atrex client (tools/sandbox.py) against its reference gateway (tools/local_gateway.py)
and against krex, operation by operation: same exit status, same RESULT_JSON / PROFILE_JSON (krex's
extra `krex` field aside), same stdout, the same resubmission after a gateway-side cancel.

Skipped unless KREX_ATREX_CHECKOUT points at an atrex-kernel-agent checkout (nothing of it is in
this repository); the evaluator and ncu are this suite's stand-ins (test_atrex_compat.py).

    KREX_ATREX_CHECKOUT=/path/to/atrex-kernel-agent pytest tests/gateway/test_atrex_client.py
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from .conftest import PY, stack
from .test_atrex_compat import STUB_EVAL
from .test_kinds import install_tools

CHECKOUT = os.environ.get("KREX_ATREX_CHECKOUT", "")
pytestmark = pytest.mark.skipif(
    not (CHECKOUT and (Path(CHECKOUT) / "tools" / "sandbox.py").is_file()),
    reason="set KREX_ATREX_CHECKOUT to an atrex-kernel-agent checkout to run its real client",
)
PREFIXES = ("[test_kernel] RESULT_JSON=", "[sandbox] PROFILE_JSON=")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def workspace(root: Path, candidate: str) -> Path:
    ws = root / f"ws-{abs(hash(candidate))}"
    ws.mkdir(parents=True)
    files = {
        "kernel.py": candidate,
        "reference.py": "class Model: pass\n",
        "input.py": "def _make_inputs(n): return {}\n",
        "shapes.json": json.dumps({"0": {"n": 4}, "1": {"n": 8}}),
        "test_kernel.py": "raise SystemExit('runs remotely only')\n",
    }
    for name, text in files.items():
        (ws / name).write_text(text)
    return ws


def sandbox(url: str, token: str | None, ws: Path, *args: str, path: str) -> subprocess.CompletedProcess[str]:
    env = {"PATH": path, "HOME": str(ws), "ATREX_SANDBOX_QUEUE_WAIT_GRACE": "60", "LANG": "C.UTF-8"}
    if token:
        env["AGATE_TOKEN"] = token
    return subprocess.run(
        [
            PY,
            str(Path(CHECKOUT) / "tools" / "sandbox.py"),
            "--hardware",
            "local",
            "--url",
            url,
            "--workspace",
            str(ws),
            "--no-sync",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=str(ws),
    )


def outcome(p: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    """What the agent sees: exit status, its stdout (typed results parsed, krex's extras out)."""
    lines = []
    for line in p.stdout.splitlines():
        for prefix in PREFIXES:
            if line.startswith(prefix):
                value = json.loads(line[len(prefix) :])
                value.pop("krex", None)
                line = prefix + json.dumps(value, sort_keys=True)
        lines.append(line)
    return {
        "rc": p.returncode,
        "stdout": lines,
        "resubmitted": "without a result/error; resubmitted once" in p.stderr,
    }


def reference_gateway(state: Path, bench: Path, env: dict[str, str]) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    proc = subprocess.Popen(
        [
            PY,
            str(Path(CHECKOUT) / "tools" / "local_gateway.py"),
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--state-dir",
            str(state),
            "--atrex-bench-root",
            str(bench),
        ],
        env={**os.environ, **env},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            urllib.request.urlopen(url + "/healthz", timeout=1).read()
            return proc, url
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("the reference gateway did not start")


def cancel_first_running(url: str, token: str | None, deadline_s: float = 60) -> None:
    """An operator cancels the client's job once it runs (the client must then resubmit)."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        req = urllib.request.Request(url + "/v1/jobs?status=running", headers=headers)
        jobs = json.loads(urllib.request.urlopen(req, timeout=10).read())["jobs"]
        if jobs:
            time.sleep(1.0)  # let it reach its sleep
            urllib.request.urlopen(
                urllib.request.Request(
                    f"{url}/v1/jobs/{jobs[0]['job_id']}/cancel",
                    data=b"{}",
                    method="POST",
                    headers={**headers, "Content-Type": "application/json"},
                ),
                timeout=10,
            ).read()
            return
        time.sleep(0.1)
    raise RuntimeError("no running job to cancel")


async def test_the_real_client_gets_the_same_outcomes_from_both_gateways(
    tmp_path: Path, gwhome: Path
) -> None:
    scratch = gwhome / "scratch"
    bench, env = install_tools(scratch, STUB_EVAL)
    path = env["PATH"]
    ops: list[tuple[str, str, tuple[str, ...]]] = [
        (
            "dev",
            "class Model: pass\n",
            ("--kind", "dev", "--", "bash", "-c", "echo hello; [[ -n x ]] && echo bash; exit 3"),
        ),
        ("timeout", "class Model: pass\n", ("--kind", "dev", "--timeout", "2", "--", "sleep", "30")),
        ("eval-pass", "class Model: pass\n", ("--kind", "run", "--", "python", "test_kernel.py")),
        ("eval-fail", "# BROKEN\nclass Model: pass\n", ("--kind", "run", "--", "python", "test_kernel.py")),
        (
            "profile",
            "class Model: pass\n",
            (
                "--kind",
                "profile",
                "--profile-level",
                "sol",
                "--top-kernels",
                "1",
                "--",
                "python",
                "profile_driver.py",
            ),
        ),
    ]
    ref_proc, ref_url = reference_gateway(tmp_path / "ref", bench, env)
    try:
        async with stack(tmp_path, "--atrex-bench-root", str(bench), env=env) as (_, gw, _c):
            got: dict[str, dict[str, Any]] = {}
            for name, cand, args in ops:
                for side, url, token in (("reference", ref_url, None), ("krex", gw.url, gw.token)):
                    ws = workspace(scratch / side / name, cand)
                    os.chmod(scratch / side, 0o777)
                    p = await asyncio.to_thread(sandbox, url, token, ws, *args, path=path)
                    got.setdefault(name, {})[side] = outcome(p)
                assert got[name]["krex"] == got[name]["reference"], (name, got[name])
            # A gateway-side cancel: the client resubmits once and reports the second run.
            for side, url, token in (("reference", ref_url, None), ("krex", gw.url, gw.token)):
                marker = scratch / f"once-{side}"
                ws = workspace(scratch / side / "cancel", "class Model: pass\n")
                cmd = f"if [ -e {marker} ]; then echo second; else touch {marker}; sleep 30; fi"
                run = asyncio.to_thread(
                    sandbox, url, token, ws, "--kind", "dev", "--", "bash", "-c", cmd, path=path
                )
                task = asyncio.ensure_future(run)
                await asyncio.to_thread(cancel_first_running, url, token)
                got.setdefault("cancel", {})[side] = outcome(await task)
            assert got["cancel"]["krex"] == got["cancel"]["reference"], got["cancel"]
            assert got["cancel"]["krex"]["resubmitted"] and got["eval-fail"]["krex"]["rc"] == 1
            assert got["timeout"]["krex"]["rc"] == 241  # -15, as the reference reports it
            print(json.dumps(got, indent=1))
    finally:
        ref_proc.terminate()
        ref_proc.wait(15)
