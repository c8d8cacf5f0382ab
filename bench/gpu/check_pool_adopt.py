"""Adoption on the GPU: how many shell-started jobs a warm pool serves, and what it saves and costs.

    python3 -m bench.gpu.check_pool_adopt [--jobs 8] [--deadline 170]      # JSON to $OUT (or --out)

1. A daemon with `--pool-size JOBS --pool-preload torch`: once warm, JOBS jobs at once as
   `sh -c 'python3 job.py'`, then (warm again) JOBS as `bash runner.sh` (runner.sh runs python3).
   Each job stamps CLOCK_MONOTONIC after `import torch` and after its first CUDA tensor; import_s
   and context_s are those stamps minus the instant before its submit (so they include the shell,
   the adoption hand-over or a fresh interpreter's start). Adopted: the report's pool_adopted.
2. What each warm worker costs: RSS and PSS (smaps_rollup) and GPU memory (NVML per process).
3. The same `sh -c` jobs through a daemon without a pool: the fresh import_s / context_s.
4. The check's cost where nothing is adopted: `python3 -c pass` with no KREX_POOL, with one naming
   another interpreter, and with a matching one but a flag (-X dev: declined before any request).
What could hide a cost: the warm workers sit idle during step 3's run (they hold memory, no GPU
time); jobs of a round share the 16 cores (import is CPU-bound), as the gateway's 8 at once do.
Exit 0 when at least 90% of the jobs were adopted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

from bench.harness import stats
from bench.harness.output import module_prog, write_json
from bench.harness.stack import Daemon
from krex_async import Client

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

JOB = """import sys, time, json
warm = "{mod}" in sys.modules
import {mod}
t_import = time.monotonic()
if {cuda}:
    {mod}.ones(1, device="cuda").add_(1)
    {mod}.cuda.synchronize()
print(json.dumps({{"import": t_import, "context": time.monotonic(), "preloaded": warm}}))
"""


def pct(xs: list[float], q: float) -> float | None:
    return stats.pct(xs, q, "rank")


def daemon(pool: int, preload: str, t_end: float) -> Daemon:
    """`krex serve` with or without a pool, up by t_end at the latest."""
    return Daemon(
        ["--probes", "off", "--pool-size", str(pool), *(["--pool-preload", preload] if pool else [])],
        prefix="krexadopt-",
        env=env(),
        ready_s=max(1.0, t_end - time.monotonic()),
    )


def env() -> dict[str, str]:
    e = dict(os.environ)
    e.pop("KREX_SOCKET", None)
    e["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, e.get("PYTHONPATH")]))
    e["PATH"] = os.path.dirname(sys.executable) + os.pathsep + e.get("PATH", os.defpath)
    return e


async def wait_warm(c: Client, n: int, deadline: float) -> dict[str, Any]:
    while True:
        pools = (await c.status()).get("pools", {})
        if pools and all(p["warm"] >= n for p in pools.values()):
            return pools
        if time.monotonic() > deadline:
            raise TimeoutError(f"pool not warm: {pools}")
        await asyncio.sleep(0.1)


async def round_of(clients: list[Client], line: str, cwd: str) -> list[dict[str, Any]]:
    async def one(c: Client) -> dict[str, Any]:
        t0 = time.monotonic()
        res = await c.run(["/bin/sh", "-c", line], cwd=cwd, env=env(), timeout=120)
        try:
            stamp = json.loads(res.stdout.decode().strip().splitlines()[-1])
        except (ValueError, IndexError):
            return {"ok": False, "rc": res.returncode, "stderr": res.stderr[-800:].decode(errors="replace")}
        return {
            "ok": res.returncode == 0,
            "import_s": stamp["import"] - t0,
            "context_s": stamp["context"] - t0,
            "preloaded": stamp["preloaded"],
            "adopted": res.report.pool_adopted,
            "declined": res.report.pool_declined,
            "wall_s": res.report.wall_s,
        }

    return list(await asyncio.gather(*(one(c) for c in clients)))


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in runs if r.get("ok")]
    return {
        "jobs": len(runs),
        "ok": len(ok),
        "adopted": sum(r.get("adopted", 0) >= 1 for r in runs),
        "import_s_p50": pct([r["import_s"] for r in ok], 0.5),
        "import_s_p95": pct([r["import_s"] for r in ok], 0.95),
        "context_s_p50": pct([r["context_s"] for r in ok], 0.5),
        "declined": [r.get("declined") for r in runs if r.get("declined")],
        "runs": runs,
    }


def check_cost(reps: int = 20) -> dict[str, float]:
    """Median start-to-exit of `python3 -c pass` under three KREX_POOL situations (no daemon)."""
    runtime = os.path.join(ROOT, "krex_async", "runtime")
    base = dict(env(), PYTHONPATH=runtime + os.pathsep + env()["PYTHONPATH"])
    base.pop("KREX_POOL", None)
    exe = os.path.realpath(sys.executable)
    venv = os.path.realpath(sys.prefix) if sys.prefix != sys.base_prefix else ""
    cases = {
        "no_pool": (base, []),
        "other_interpreter": (dict(base, KREX_POOL="/x/python\n"), []),
        "declined_flag": (dict(base, KREX_POOL=f"{exe}\n{venv}"), ["-X", "dev"]),
        "flag_alone": (base, ["-X", "dev"]),
    }
    out = {}
    for name, (e, flags) in cases.items():
        xs = []
        for _ in range(reps):
            t0 = time.perf_counter()
            subprocess.run([sys.executable, *flags, "-c", "pass"], env=e, check=True)
            xs.append(time.perf_counter() - t0)
        out[name + "_ms"] = round(1000 * (pct(xs, 0.5) or 0.0), 3)
    return out


async def main() -> int:
    ap = argparse.ArgumentParser(prog=module_prog(__spec__), description=__doc__.split("\n")[0])
    ap.add_argument("--jobs", type=int, default=8)
    ap.add_argument("--preload", default="torch")
    ap.add_argument(
        "--cpu",
        action="store_true",
        help="a dry run without a GPU: --preload is "
        "imported and no context is made (e.g. --cpu --preload decimal)",
    )
    ap.add_argument("--deadline", type=float, default=170.0, help="seconds for the whole check")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "check_pool_adopt.json"))
    args = ap.parse_args()
    t_end = time.monotonic() + args.deadline
    work = tempfile.mkdtemp(prefix="adoptjobs-")
    with open(os.path.join(work, "job.py"), "w") as f:
        f.write(JOB.format(mod=args.preload.split(",")[0], cuda=not args.cpu))
    with open(os.path.join(work, "runner.sh"), "w") as f:
        f.write('set -e\ncd "$(dirname "$0")"\npython3 job.py "$@"\n')
    result: dict[str, Any] = {
        "jobs": args.jobs,
        "preload": args.preload,
        "python": sys.executable,
        "errors": [],
    }
    try:
        await phases(args, result, work, t_end)
    except Exception as e:  # a phase that fails still leaves what the others measured
        result["errors"].append(f"{type(e).__name__}: {e}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rounds = [result[k] for k in ("sh_c", "bash_runner") if k in result]
    jobs = sum(r["jobs"] for r in rounds)
    result["adoption_rate"] = sum(r["adopted"] for r in rounds) / jobs if jobs else 0.0
    workers = result.get("workers", [])
    result["worker_cost"] = {
        f"{k}_p50": pct([w[k] for w in workers if w.get(k)], 0.5)
        for k in ("rss_bytes", "pss_bytes", "gpu_bytes")
    }
    result["worker_cost"]["workers"] = len(workers)
    write_json(args.out, result)
    print(
        json.dumps(
            {
                "adoption_rate": result["adoption_rate"],
                "worker_cost": result["worker_cost"],
                "import_s_p50": {
                    k: result[k]["import_s_p50"] for k in ("sh_c", "bash_runner", "fresh_sh_c") if k in result
                },
                "errors": result["errors"],
                "out": args.out,
            }
        ),
        flush=True,
    )
    return 0 if result["adoption_rate"] >= 0.9 and not result["errors"] else 1


async def phases(args: argparse.Namespace, result: dict[str, Any], work: str, t_end: float) -> None:
    """The check's steps 4, 1-2 and 3, filling `result` as each ends."""
    result["check_cost"] = check_cost()
    print("check cost", result["check_cost"], flush=True)
    async with daemon(args.jobs, args.preload, t_end) as pooled:
        clients = [await Client.connect(pooled.socket) for _ in range(args.jobs)]
        t0 = time.monotonic()
        await wait_warm(clients[0], args.jobs, min(t_end, time.monotonic() + 110))
        result["warm_s"] = time.monotonic() - t0
        live = await clients[0].status()  # status_live: workers' RSS/PSS/GPU bytes
        result["workers"] = [w for p in live["pools"].values() for w in p["workers"]]
        for name, line in (("sh_c", "python3 job.py"), ("bash_runner", "bash runner.sh")):
            try:
                await wait_warm(clients[0], args.jobs, min(t_end - 40, time.monotonic() + 60))
            except TimeoutError as e:  # run anyway: the misses show as declined "no warm worker"
                result["errors"].append(f"{name}: {e}")
            result[name] = summary(await round_of(clients, line, work))
            print(name, {k: v for k, v in result[name].items() if k != "runs"}, flush=True)
        result["pool_status"] = {
            k: {kk: vv for kk, vv in p.items() if kk != "workers"}
            for k, p in (await clients[0].status())["pools"].items()
        }
        for c in clients:
            await c.close()
    async with daemon(0, "", t_end) as fresh:
        clients = [await Client.connect(fresh.socket) for _ in range(args.jobs)]
        result["fresh_sh_c"] = summary(await round_of(clients, "python3 job.py", work))
        print("fresh_sh_c", {k: v for k, v in result["fresh_sh_c"].items() if k != "runs"}, flush=True)
        for c in clients:
            await c.close()


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
