"""`krex demo`: start a daemon, run a small concurrent agent-like workload with regions, print reports.

Each demo command does what a kernel agent's benchmark command does: set-up work that may overlap
with others (imports, a compile, input generation), then a timed loop inside `region("timing")`. The
demo runs the workload under the `region` and `shared` policies on one daemon flag each and prints what
every region cost and how much the timings moved.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time

WORK = r'''
import json, os, sys, time
from krex_async import region

def kernel(n=60_000):              # a fixed "kernel": the same work every call
    s = 0
    for i in range(n):
        s += i * i
    return s

t = time.perf_counter()
src = "\n".join(f"def f{i}(x): return x * {i} + {i}" for i in range(3000))
compile(src, "generated", "exec")  # "compile": real CPU work that may overlap with others
while time.perf_counter() - t < float(sys.argv[1]):
    kernel()
with region("timing") as r:
    samples = []
    for _ in range(int(sys.argv[2])):
        t0 = time.perf_counter()
        kernel()
        samples.append(time.perf_counter() - t0)
samples.sort()
print(json.dumps({"median_ms": samples[len(samples) // 2] * 1e3, "enter_ms": r.report.enter_s * 1e3
                  if r.report else 0, "frozen": len(r.report.frozen) if r.report else 0}))
'''


async def _workload(sock: str, script: str, n: int) -> tuple[float, list[dict[str, float]]]:
    import json

    from .client import Client

    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    async with await Client.connect(sock) as c:
        t0 = time.monotonic()
        results = await asyncio.gather(*(c.run([sys.executable, script, "0.4", "15"], env=env)
                                         for _ in range(n)))
        makespan = time.monotonic() - t0
    rows = []
    for res in results:
        if res.returncode != 0:
            raise SystemExit(f"demo command failed: {res.stderr.decode(errors='replace')}")
        info = json.loads(res.stdout)
        reg = res.report.regions[0]
        rows.append({"command": res.report.command, "wall_s": res.report.wall_s,
                     "wait_ms": reg.wait_s * 1e3, "enter_ms": reg.enter_s * 1e3,
                     "held_ms": reg.held_s * 1e3, "frozen": len(reg.frozen),
                     "median_ms": info["median_ms"]})
    return makespan, rows


def _baseline(script: str) -> float:
    env = dict(os.environ)
    env.pop("KREX_SOCKET", None)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    p = subprocess.run([sys.executable, script, "0.0", "15"], capture_output=True, env=env,
                       check=True)
    import json

    return float(json.loads(p.stdout)["median_ms"])


def main(n: int = 6) -> int:
    tmp = tempfile.mkdtemp(prefix="krex-demo-", dir="/tmp")
    script = os.path.join(tmp, "work.py")
    with open(script, "w") as f:
        f.write(WORK)
    alone = _baseline(script)
    print(f"krex demo: {n} concurrent agent-like commands; the timed kernel alone: {alone:.2f} ms\n")
    for policy in ("region", "shared"):
        sock = os.path.join(tmp, f"{policy}.sock")
        log = open(os.path.join(tmp, f"{policy}.log"), "wb")
        daemon = subprocess.Popen([sys.executable, "-m", "krex_async", "serve", "--socket", sock,
                                   "--policy", policy, "--log-format", "json",
                                   "--state-dir", os.path.join(tmp, "state")],
                                  stdout=log, stderr=subprocess.STDOUT)
        try:
            while not os.path.exists(sock):
                if daemon.poll() is not None:
                    raise SystemExit(f"daemon failed; see {log.name}")
                time.sleep(0.02)
            makespan, rows = asyncio.run(_workload(sock, script, n))
        finally:
            daemon.terminate()
            daemon.wait(20)
        print(f"policy {policy}: makespan {makespan:.2f} s")
        print(f"  {'command':<12} {'wall s':>7} {'wait ms':>8} {'enter ms':>9} {'held ms':>8} "
              f"{'frozen':>6} {'median ms':>10} {'vs alone':>9}")
        for r in rows:
            print(f"  {r['command']:<12} {r['wall_s']:>7.2f} {r['wait_ms']:>8.1f} "
                  f"{r['enter_ms']:>9.2f} {r['held_ms']:>8.1f} {r['frozen']:>6} "
                  f"{r['median_ms']:>10.2f} {100 * (r['median_ms'] / alone - 1):>+8.1f}%")
        med = statistics.median(r["median_ms"] for r in rows)
        print(f"  median timing {med:.2f} ms ({100 * (med / alone - 1):+.1f}% vs alone)\n")
    print(f"logs and scripts in {tmp}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
