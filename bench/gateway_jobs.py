"""The same dev jobs through krex's gateway under --policy region, command and shared.

    python -m bench.gateway_jobs [--device auto|cpu|gpu] [--jobs 8] [--policies region,command,shared]
                                 [--max-running 16] [--json FILE]

Each job is what an agent's timing tool sends as an agate dev job: imports, a compile, a correctness
check, then a kernel timed with do_bench. On a GPU (torch + triton importable): a Triton vector-add
kernel (compiled afresh: a job-local TRITON_CACHE_DIR) or a torch fp16 matmul, checked against torch,
timed with triton.testing.do_bench. On the cpu device: a numpy-free stand-in (module imports, compile()
of generated source, a checked pure-Python kernel) timed by a do_bench-like loop in an explicit region.
On a GPU the timed call is wrapped in an explicit region only when krex_async.integrations (the
KREX_AUTO_REGION=1 wrapping of do_bench) is not installed; the table says which ("region via").

First every distinct job runs alone (one at a time, --alone-reps times, median) for its reference;
then all jobs are submitted at once under each policy, each with a fresh daemon and gateway. Columns:
makespan, jobs per minute, throughput relative to `command` (whole-job exclusivity, the FIFO-per-GPU
baseline) and the do_bench inflation: the concurrent median time over the job's alone median (p50 and
max over jobs).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.harness.output import module_prog, write_json
from bench.harness.stack import Stack

ROOT = Path(__file__).resolve().parent.parent

JOB = r"""
import importlib.util, json, os, sys, time
t0 = time.perf_counter()
spec = json.loads(sys.argv[1])
auto = os.environ.get("KREX_AUTO_REGION") == "1" and \
    importlib.util.find_spec("krex_async.integrations") is not None
phases = {}

def timed_region(fn):
    from krex_async import region
    with region("do_bench") as r:
        v = fn()
    return v, r.report

if spec["device"] == "gpu":
    import torch, triton, triton.language as tl, triton.testing
    phases["import_s"] = time.perf_counter() - t0
    t = time.perf_counter()

    @triton.jit
    def add(x, y, out, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = i < n
        tl.store(out + i, tl.load(x + i, mask=m) + tl.load(y + i, mask=m), mask=m)

    n = spec["n"]
    if spec["kernel"] == "add":
        x = torch.randn(n, device="cuda"); y = torch.randn(n, device="cuda")
        o = torch.empty_like(x)
        grid = (triton.cdiv(n, spec["block"]),)
        fn = lambda: add[grid](x, y, o, n, BLOCK=spec["block"])
        fn(); torch.cuda.synchronize()
        phases["compile_s"] = time.perf_counter() - t
        t = time.perf_counter()
        assert torch.allclose(o, x + y)
    else:
        a = torch.randn(n, n, device="cuda", dtype=torch.float16)
        b = torch.randn(n, n, device="cuda", dtype=torch.float16)
        fn = lambda: torch.matmul(a, b)
        fn(); torch.cuda.synchronize()
        phases["compile_s"] = time.perf_counter() - t
        t = time.perf_counter()
        ref = (a.float() @ b.float()).half()
        assert torch.allclose(fn(), ref, atol=1, rtol=1e-2)
    torch.cuda.synchronize()
    phases["check_s"] = time.perf_counter() - t
    t = time.perf_counter()
    bench = lambda: triton.testing.do_bench(fn, warmup=25, rep=spec["rep_ms"])
    if auto:
        ms, report = bench(), None
    else:
        ms, report = timed_region(bench)
else:
    import decimal, fractions, email.parser, http.client, xml.dom.minidom  # noqa: F401
    phases["import_s"] = time.perf_counter() - t0
    t = time.perf_counter()
    src = "\n".join(f"def f{i}(x):\n    return x * {i} + {i}" for i in range(spec["defs"]))
    ns = {}
    exec(compile(src, "<kernel>", "exec"), ns)
    phases["compile_s"] = time.perf_counter() - t
    t = time.perf_counter()
    kernel = lambda: sum(i * i for i in range(spec["n"]))
    assert kernel() == sum(i * i for i in range(spec["n"]))
    phases["check_s"] = time.perf_counter() - t
    t = time.perf_counter()

    def bench():
        times = []
        end = time.perf_counter() + spec["rep_ms"] / 1e3
        while time.perf_counter() < end or len(times) < 5:
            s = time.perf_counter(); kernel(); times.append(time.perf_counter() - s)
        times.sort()
        return times[len(times) // 2] * 1e3

    ms, report = timed_region(bench)
phases["bench_s"] = time.perf_counter() - t
print("RESULT " + json.dumps({"ms": ms, "phases": phases, "via": "auto" if auto else "explicit",
                              "wait_s": report.wait_s if report else None}))
"""


def kernels(device: str, n: int) -> list[dict[str, object]]:
    if device == "gpu":
        base = [
            {"kernel": "add", "n": 1 << 24, "block": 1024},
            {"kernel": "matmul", "n": 3072},
            {"kernel": "add", "n": 1 << 22, "block": 512},
            {"kernel": "matmul", "n": 4096},
            {"kernel": "add", "n": 1 << 26, "block": 2048},
            {"kernel": "matmul", "n": 2048},
        ]
        rep = 200
    else:
        base = [
            {"n": 20000, "defs": 3000},
            {"n": 40000, "defs": 2000},
            {"n": 10000, "defs": 4000},
            {"n": 30000, "defs": 2500},
        ]
        rep = 150
    return [{**base[i % len(base)], "device": device, "rep_ms": rep, "key": i % len(base)} for i in range(n)]


async def submit_all(st: Stack, specs: list[dict[str, object]], tmp: Path) -> tuple[float, list]:
    """Submit every job at once; (makespan s, [(spec, parsed RESULT, job view)])."""
    async with st.client() as c:
        t = time.monotonic()
        jobs = []
        for i, s in enumerate(specs):
            cache = f".triton-cache-{i}"
            jobs.append(
                await c.dev(
                    f"python job.py '{json.dumps(s)}'",
                    files={"job.py": JOB},
                    env_vars={"TRITON_CACHE_DIR": cache},
                    timeout_s=600,
                )
            )
        views = await asyncio.gather(*(c.wait(j["job_id"], 1200) for j in jobs))
        makespan = time.monotonic() - t
    out = []
    for s, v in zip(specs, views):
        if v["status"] != "succeeded":
            raise SystemExit(f"job failed: {json.dumps(v, indent=1)[:3000]}")
        line = next(ln for ln in v["result"]["stdout"].splitlines() if ln.startswith("RESULT "))
        out.append((s, json.loads(line[7:]), v))
    return makespan, out


async def main() -> int:
    ap = argparse.ArgumentParser(prog=module_prog(__spec__), description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=["auto", "cpu", "gpu"], default="auto")
    ap.add_argument("--jobs", type=int, default=8)
    ap.add_argument("--policies", default="region,command,shared")
    ap.add_argument("--max-running", type=int, default=16)
    ap.add_argument("--alone-reps", type=int, default=3, help="alone runs per job (median)")
    ap.add_argument("--json", help="write every number to this file")
    args = ap.parse_args()
    device = args.device
    if device == "auto":
        try:
            import torch

            device = "gpu" if torch.cuda.is_available() else "cpu"
        except ImportError:
            device = "cpu"
    devices = "auto" if device == "gpu" else "cpu:1"
    specs = kernels(device, args.jobs)
    tmp = Path(tempfile.mkdtemp(prefix="gwbench-"))
    distinct = {s["key"]: s for s in specs}
    alone: dict[object, float] = {}
    alone_wall = 0.0
    st = Stack(["--devices", devices, "--log-level", "warning"], 1, policy="region", parent=tmp).start()
    try:
        for key, s in distinct.items():
            times = []
            for _ in range(args.alone_reps):
                wall, ((_, res, _),) = await submit_all(st, [s], tmp)
                times.append(res["ms"])
            alone[key] = statistics.median(times)
            alone_wall += wall
    finally:
        st.stop()
    serial_s = sum(alone_wall / len(distinct) for _ in specs)  # one at a time, estimated
    rows = []
    for policy in args.policies.split(","):
        st = Stack(
            ["--devices", devices, "--log-level", "warning"], args.max_running, policy=policy, parent=tmp
        ).start()
        try:
            makespan, results = await submit_all(st, specs, tmp)
        finally:
            st.stop()
        infl = [r["ms"] / alone[s["key"]] for s, r, _ in results]
        regions = sum(len(v["result"]["regions"]) for _, _, v in results)
        waits = [g.get("wait_s", 0.0) for _, _, v in results for g in v["result"]["regions"]]
        rows.append(
            {
                "policy": policy,
                "makespan_s": makespan,
                "jobs_per_min": 60 * len(specs) / makespan,
                "inflation_p50": statistics.median(infl),
                "inflation_max": max(infl),
                "regions": regions,
                "wait_p50_s": statistics.median(waits) if waits else None,
                "via": sorted({r["via"] for _, r, _ in results}),
                "per_job": [
                    {"spec": s, "ms": r["ms"], "alone_ms": alone[s["key"]], "phases": r["phases"]}
                    for s, r, _ in results
                ],
            }
        )
    base = next((r for r in rows if r["policy"] == "command"), rows[0])
    print(
        f"\n{len(specs)} dev jobs on {device} through the krex gateway (max-running "
        f"{args.max_running}); one at a time they take about {serial_s:.1f} s\n"
    )
    print(
        f"{'policy':<8} {'makespan s':>10} {'jobs/min':>9} {'vs command':>10} "
        f"{'do_bench x p50':>14} {'x max':>7} {'regions':>8} {'wait p50 s':>10}  region via"
    )
    for r in rows:
        wait = "-" if r["wait_p50_s"] is None else f"{r['wait_p50_s']:.3f}"
        print(
            f"{r['policy']:<8} {r['makespan_s']:>10.2f} {r['jobs_per_min']:>9.1f} "
            f"{base['makespan_s'] / r['makespan_s']:>10.2f} {r['inflation_p50']:>14.3f} "
            f"{r['inflation_max']:>7.3f} {r['regions']:>8} {wait:>10}  {','.join(r['via'])}"
        )
    print(
        "\nalone (ms): "
        + ", ".join(
            f"{distinct[k].get('kernel', 'cpu')}[{distinct[k]['n']}]={v:.4f}" for k, v in alone.items()
        )
    )
    if args.json:
        write_json(
            args.json, {"device": device, "alone_ms": {str(k): v for k, v in alone.items()}, "rows": rows}
        )
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
