"""What the Atrex agent's client (tools/sandbox.py) relies on, as its reference gateway
(tools/local_gateway.py) answers it (issue 24 items 1-5). The requests are shaped as that client
shapes them; the evaluator is a stand-in of Atrex-Bench's scripts/run_eval.py written here (it writes
eval_result.json in Atrex-Bench's layout and exits 1 when the candidate fails correctness); ncu and
nvidia-smi are stand-ins that record how they were called. tests/gateway/test_atrex_client.py
drives the real client against both gateways where a checkout is at hand.
"""

from __future__ import annotations

import asyncio
import json
import textwrap
import time
from pathlib import Path
from typing import Any

from krex_async.gateway.client import GatewayClient

from .conftest import stack
from .test_kinds import install_tools

# Atrex-Bench's layout: passed.{compile,correctness}[sid], correctness.shapes[sid].cases,
# performance.shapes[sid].samples; a candidate that fails correctness still gets its
# eval_result.json, and the evaluator exits 1.
STUB_EVAL = textwrap.dedent("""
    import argparse, json, pathlib, sys
    p = argparse.ArgumentParser()
    for a in ("--input", "--reference-dir", "--output", "--atol", "--rtol",
              "--num-correctness-cases", "--bench-iters"):
        p.add_argument(a, required=True)
    p.add_argument("--clock-locked", action="store_true")
    a = p.parse_args()
    shapes = json.loads((pathlib.Path(a.reference_dir) / "shapes.json").read_text())
    cand = pathlib.Path(a.input).read_text()
    if "CRASH" in cand:
        sys.exit(3)  # no eval_result.json: an evaluator failure, not an outcome
    broken = "BROKEN" in cand
    status = {"status": "failed", "reason": "mismatch: max abs diff 3.5"} if broken else \\
        {"status": "passed"}
    result = {
        "eval_id": "stub-eval", "clock_locked": a.clock_locked,
        "passed": {"compile": {s: {"status": "passed"} for s in shapes},
                   "correctness": {s: dict(status) for s in shapes}},
        "correctness": {"shapes": {s: {"cases": [{"outputs": [
            {"max_elementwise_abs_diff": 3.5 if broken else 0.0,
             "max_elementwise_rel_diff": 0.5 if broken else 0.0}]}]} for s in shapes}},
        "performance": {"shapes": {s: {"samples": [{"end_to_end_time_ms": 0.02}] * 3,
                                       "error": None} for s in shapes}},
    }
    out = pathlib.Path(a.output)
    out.mkdir(parents=True)
    (out / "eval_result.json").write_text(json.dumps(result))
    sys.exit(1 if broken else 0)
""")

FAKE_SMI = textwrap.dedent("""\
    #!/bin/sh
    echo "$@" >> "$(dirname "$0")/smi.log"
    case "$1" in
      --query-supported-clocks=gr) printf '1980\\n1965\\n345\\n' ;;
      --query-gpu=compute_cap) echo 9.0 ;;
      --query-gpu=*) echo "NVIDIA H200, 143771, 580.159.04" ;;
    esac
""")


def typed(kind: str, candidate: str, **extra: Any) -> dict[str, Any]:
    """A request as tools/sandbox.py's _typed_request builds it."""
    req: dict[str, Any] = {
        "name": f"add_{kind}",
        "spec": {"languages": ["triton"], "target_hardware": ["local"]},
        "candidate": candidate,
        "reference": {
            "operator": "add",
            "reference_py": "class Model: pass\n",
            "input_py": "def _make_inputs(n): return {}\n",
            "shapes": {"0": {"n": 4}, "1": {"n": 8}},
            "metadata": {"num_shapes": 2},
        },
        "options": {
            "num_correctness_cases": 1,
            "bench_iters": 20,
            "atol": 0.01,
            "rtol": 0.05,
            "timeout_s": 60,
        },
        "env_vars": {},
    }
    if kind == "run":
        req["mode"] = "full"
    req.update(extra)
    return req


async def client_job(c: GatewayClient, kind: str, payload: dict[str, Any]) -> dict[str, Any]:
    """Submit and long-poll as _run_direct_job does (30 s slices, wait=true)."""
    status, accepted = await c.request("POST", f"/v1/jobs/{kind}", json=payload)
    assert status == 202, accepted
    while True:
        status, job = await c.request(
            "GET", f"/v1/jobs/{accepted['job_id']}", params={"wait": "true", "timeout": "30.000"}
        )
        assert status == 200, job
        if job["status"] in ("succeeded", "failed", "cancelled"):
            return job


async def test_eval_outcomes_as_the_reference_reports_them(tmp_path: Path, gwhome: Path) -> None:
    bench, env = install_tools(gwhome / "scratch", STUB_EVAL)
    async with stack(tmp_path, "--atrex-bench-root", str(bench), env=env) as (_, _gw, c):
        # 24.1: correctness fails, the evaluator exits 1: the job succeeded, with the failures.
        job = await client_job(c, "eval", typed("run", "# BROKEN\nclass Model: pass\n"))
        assert job["status"] == "succeeded" and job["error"] is None, job
        r = job["result"]
        assert r["passed"]["correctness"]["0"] == {"status": "failed", "reason": "mismatch: max abs diff 3.5"}
        assert r["correctness"]["shapes"]["1"]["cases"][0]["outputs"][0]["max_elementwise_abs_diff"] == 3.5
        ok = await client_job(c, "eval", typed("run", "class Model: pass\n"))
        assert ok["status"] == "succeeded" and ok["result"]["passed"]["correctness"]["0"] == {
            "status": "passed"
        }
        # No eval_result.json: evaluator_failed, with the command's result.
        bad = await client_job(c, "eval", typed("run", "# CRASH\n"))
        assert bad["status"] == "failed" and bad["error"]["reason"] == "evaluator_failed"
        assert bad["result"]["exit_code"] == 3
        # 24.5: the reference's validation answers are 422s.
        for payload in (
            typed("run", ""),
            typed("run", "x", lock_clocks="yes"),
            typed("run", "x", mode="fast"),
            {**typed("run", "x"), "spec": {}},
        ):
            status, body = await c.request("POST", "/v1/jobs/eval", json=payload)
            assert status == 422, body
        # NaN in a part passed on as given: refused, and no job left behind that nobody was told
        # of (it was stored, then its read-back failed: a 500 and a job that ran anyway)
        before = await c.jobs()
        for where in ("options", "metadata"):
            nan = typed("run", "class Model: pass\n")
            (nan["options"] if where == "options" else nan["reference"]["metadata"])["x"] = float("nan")
            raw = json.dumps(nan).encode()  # Python writes NaN, as a client's json.dumps would
            status, body = await c.request("POST", "/v1/jobs/eval", data=raw)
            assert (status, body["reason"]) == (422, "invalid_request"), body
        assert await c.jobs() == before


async def test_lock_clocks_locks_and_resets_or_fails_saying_why(tmp_path: Path, gwhome: Path) -> None:
    bench, env = install_tools(gwhome / "scratch", STUB_EVAL)
    bindir = gwhome / "scratch" / "bin"
    (bindir / "nvidia-smi").write_text(FAKE_SMI)
    (bindir / "smi.log").touch()
    async with stack(tmp_path, "--atrex-bench-root", str(bench), env=env) as (_, _gw, c):
        job = await client_job(c, "eval", typed("run", "class Model: pass\n", lock_clocks=True))
    calls = (bindir / "smi.log").read_text().splitlines()
    try:
        import pynvml

        pynvml.nvmlInit()
        nvml = True
    except Exception:  # no NVIDIA driver here: the gateway used nvidia-smi, as the reference
        nvml = False
    if not nvml:
        assert job["status"] == "succeeded" and job["result"]["clock_locked"] is True, job
        locks = [c for c in calls if c.startswith("--lock-gpu-clocks")]
        assert locks == ["--lock-gpu-clocks 1980,1980"], calls
        assert calls[-1] == "--reset-gpu-clocks", calls
    async with stack(tmp_path, "--atrex-bench-root", str(bench), env={"PATH": "/usr/bin:/bin"}) as (
        _,
        _gw,
        c,
    ):
        job = await client_job(c, "eval", typed("run", "class Model: pass\n", lock_clocks=True))
        if not nvml:  # nothing can lock clocks: the job fails saying so, as the reference does
            assert job["status"] == "failed" and job["error"]["reason"] == "execution_error"
            assert "cannot lock GPU clocks" in job["error"]["message"], job["error"]


async def test_profile_request_semantics_and_result_shape(tmp_path: Path, gwhome: Path) -> None:
    bench, env = install_tools(gwhome / "scratch", STUB_EVAL)
    async with stack(tmp_path, "--atrex-bench-root", str(bench), env=env) as (_, gw, c):
        job = await client_job(
            c, "profile", typed("profile", "class Model: pass\n", level="sol", top_kernels=1)
        )
        assert job["status"] == "succeeded", job
        r = job["result"]
        assert (r["profiler"], r["level"], len(r["kernels"])) == ("ncu", "sol", 1)
        (k,) = r["kernels"]
        assert set(k) >= {
            "name",
            "duration",
            "duration_unit",
            "compute_sol_pct",
            "mem_sol_pct",
            "dram_pct",
            "occupancy_pct",
            "bound",
            "metrics",
        }
        assert all(isinstance(v, float) for v in k["metrics"].values())
        opts = json.loads((gw.state / "jobs" / job["job_id"] / "profile_output" / "opts.json").read_text())
        assert opts["--profile-from-start"] == "off"  # only the cudaProfilerStart..Stop call
        assert len(opts["--metrics"].split(",")) == 5

        job = await client_job(c, "profile", typed("profile", "x = 1\n", level="survey"))
        (k, _small) = job["result"]["kernels"]
        assert "compute_sol_pct" not in k and "diagnostics" not in k
        opts = json.loads((gw.state / "jobs" / job["job_id"] / "profile_output" / "opts.json").read_text())
        assert opts["--metrics"] == "gpu__time_duration.sum"

        job = await client_job(c, "profile", typed("profile", "x = 1\n", level="deep", kernel_regex="add.*"))
        assert "diagnostics" in job["result"]["kernels"][0]
        opts = json.loads((gw.state / "jobs" / job["job_id"] / "profile_output" / "opts.json").read_text())
        assert opts["--set"] == "full" and opts["--kernel-name"] == "regex:add.*"

        job = await client_job(c, "profile", typed("profile", "x = 1\n", counters=["a__b.sum", "c__d.avg"]))
        opts = json.loads((gw.state / "jobs" / job["job_id"] / "profile_output" / "opts.json").read_text())
        assert opts["--metrics"] == "a__b.sum,c__d.avg"
        for bad in (
            {"level": "deep"},
            {"profiler": "nsys"},
            {"top_kernels": 0},
            {"kernel_regex": "("},
            {"counters": [""]},
        ):
            status, body = await c.request(
                "POST", "/v1/jobs/profile", json=typed("profile", "x = 1\n", **bad)
            )
            assert status == 422, (bad, body)


async def test_dev_jobs_as_the_reference_runs_them(tmp_path: Path) -> None:
    async with stack(tmp_path) as (daemon, gw, c):
        # 24.5: bash, not dash: [[ ]], arrays, pipefail.
        job = await client_job(
            c,
            "dev",
            c.dev_request(
                'set -o pipefail; arr=(a b c); [[ ${#arr[@]} == 3 ]] && echo "${arr[2]}"; '
                "false | true; echo $?"
            ),
        )
        assert job["status"] == "succeeded" and job["result"]["stdout"] == "c\n1\n", job
        # Timeout: SIGTERM, exit -15 (the client's 241), failed command_timeout.
        t = time.monotonic()
        job = await client_job(c, "dev", c.dev_request("sleep 30", timeout_s=1))
        assert time.monotonic() - t < 10
        assert (job["status"], job["error"]["reason"], job["result"]["exit_code"]) == (
            "failed",
            "command_timeout",
            -15,
        ), job
        # A command that ignores SIGTERM is killed 2 s later.
        job = await client_job(
            c, "dev", c.dev_request("trap '' TERM; sleep 30 & wait; sleep 30", timeout_s=1)
        )
        assert job["status"] == "failed" and job["error"]["reason"] == "command_timeout"
        # 24.3: a gateway-side cancel, and an operator's `krex cancel` of the command: both
        # cancelled with result and error null, so the client resubmits once.
        status, job = await c.request("POST", "/v1/jobs/dev", json=c.dev_request("sleep 30"))
        for _ in range(200):
            view = await c.get(job["job_id"])
            if view["krex_command"]:
                break
            await asyncio.sleep(0.05)
        await c.cancel(job["job_id"])
        done = await c.wait(job["job_id"], 10)
        assert (done["status"], done["result"], done["error"]) == ("cancelled", None, None)
        status, job = await c.request("POST", "/v1/jobs/dev", json=c.dev_request("sleep 30"))
        for _ in range(200):
            view = await c.get(job["job_id"])
            if view["krex_command"]:
                break
            await asyncio.sleep(0.05)
        async with await daemon.client() as operator:  # type: ignore[attr-defined]
            await operator.cancel(view["krex_command"], 9)
        done = await c.wait(job["job_id"], 10)
        assert (done["status"], done["result"], done["error"]) == ("cancelled", None, None)


async def test_output_above_the_reference_limit_fails_as_the_reference(tmp_path: Path) -> None:
    async with stack(tmp_path) as (_, _gw, c):
        over = 32 * 1024 * 1024 + 1000
        job = await client_job(
            c, "dev", c.dev_request(f"head -c {over} /dev/zero | tr '\\0' z; echo fine >&2", timeout_s=120)
        )
        assert job["status"] == "failed" and job["error"]["reason"] == "output_too_large"
        r = job["result"]
        assert len(r["stdout"]) == 32 * 1024 * 1024 and r["stderr"] == "fine\n"
