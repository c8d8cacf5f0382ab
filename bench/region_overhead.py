"""What a region costs: enter and exit latency with idle siblings, and with commands contending.

    python -m bench.region_overhead [--backends signal,cgroup] [--siblings 1,4,16] [--regions 200]

Table 1 (siblings): one owner enters and leaves `--regions` empty regions while S idle sibling
commands share its device, so every entry freezes S commands and fences cores. Columns: the owner's
observed enter and exit latency (call to return), and the daemon's own split of the entry into freeze
and cpuset time, p50/p99 in milliseconds.

Table 2 (contending): N commands on one device all loop over regions; enter latency then includes the
wait behind the others (FIFO). Runs on the `cpu` device: it needs no GPU.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from bench.harness.stats import pct_or_nan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

OWNER = r'''
import json, sys, time
from krex_async import region
n = int(sys.argv[1])
enter, exit_, rep = [], [], []
for _ in range(n):
    t0 = time.perf_counter()
    r = region("bench")
    r.__enter__()
    t1 = time.perf_counter()
    r.__exit__(None, None, None)
    t2 = time.perf_counter()
    enter.append(t1 - t0)
    exit_.append(t2 - t1)
    rep.append((r.report.freeze_s, r.report.cores_s, r.report.wait_s, r.report.enter_s,
                len(r.report.frozen), r.report.quiesce_s, r.report.select_s, r.report.settle_s,
                r.report.drain))
print(json.dumps({"enter": enter, "exit": exit_, "rep": rep}))
'''

SLEEPER = "import time\nwhile True: time.sleep(0.05)\n"
SPINNER = "while True: pass\n"  # --busy: siblings that keep a core busy


def pct(xs: list[float], q: float) -> float:
    return pct_or_nan(xs, q, "rank") * 1e3  # in ms


def env() -> dict[str, str]:
    e = dict(os.environ)
    e.pop("KREX_SOCKET", None)
    e["PYTHONPATH"] = ROOT + os.pathsep + e.get("PYTHONPATH", "")
    return e


class Daemon:
    def __init__(self, tmp: str, backend: str, extra: list[str], probes: str = "off") -> None:
        self.sock = os.path.join(tmp, f"{backend}.sock")
        self.log = open(os.path.join(tmp, f"{backend}.log"), "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "krex_async", "serve", "--socket", self.sock, "--isolation",
             backend, "--log-level", "warning", "--state-dir", os.path.join(tmp, "state"),
             "--probes", probes, *(extra if backend == "cgroup" else [])],
            stdout=self.log, stderr=subprocess.STDOUT, env=env())
        while not os.path.exists(self.sock):
            if self.proc.poll() is not None:
                raise SystemExit(f"daemon ({backend}) failed: {open(self.log.name).read()}")
            time.sleep(0.02)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


async def siblings_case(sock: str, owner: str, sleeper: str, n_sib: int, regions: int,
                        fresh: bool = False) -> dict:
    """`fresh`: every region is the first (and only) one of a new owner command, as in the replay,
    where each command times one kernel; otherwise one owner enters `regions` regions."""
    from krex_async import Client

    async with await Client.connect(sock) as c:
        sibs = [await c.submit([sys.executable, sleeper], env=env()) for _ in range(n_sib)]
        await asyncio.sleep(0.5 + 0.02 * n_sib)  # let them start
        runs = [await c.run([sys.executable, owner, "1"], env=env()) for _ in range(regions)] \
            if fresh else [await c.run([sys.executable, owner, str(regions)], env=env())]
        for s in sibs:
            await s.cancel(9)
        for s in sibs:
            await s.wait()
    data: dict[str, list] = {"enter": [], "exit": [], "rep": []}
    for res in runs:
        if res.returncode != 0:
            raise SystemExit(res.stderr.decode())
        for k, v in json.loads(res.stdout).items():
            data[k] += v
    skip = 2 if fresh else 5  # the first entries warm caches
    rep = data["rep"][skip:]
    return {"siblings": n_sib, "enter": data["enter"][skip:], "exit": data["exit"][skip:],
            "freeze": [r[0] for r in rep], "cores": [r[1] for r in rep],
            "quiesce": [r[5] for r in rep], "daemon": [r[3] for r in rep],
            "select": [r[6] for r in rep], "settle": [r[7] for r in rep],
            "drain": sorted({r[8] for r in rep}),
            "frozen": statistics.median(r[4] for r in rep) if rep else 0}


async def contending_case(sock: str, owner: str, n: int, regions: int) -> dict:
    from krex_async import Client

    async with await Client.connect(sock) as c:
        results = await asyncio.gather(*(c.run([sys.executable, owner, str(regions)], env=env())
                                         for _ in range(n)))
    enter, exit_, wait = [], [], []
    for res in results:
        if res.returncode != 0:
            raise SystemExit(res.stderr.decode())
        d = json.loads(res.stdout)
        enter += d["enter"][2:]
        exit_ += d["exit"][2:]
        wait += [r[2] for r in d["rep"][2:]]
    return {"commands": n, "enter": enter, "exit": exit_, "wait": wait}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--backends", default="signal")
    ap.add_argument("--siblings", default="1,4,16")
    ap.add_argument("--contending", default="1,4,16")
    ap.add_argument("--regions", type=int, default=200)
    ap.add_argument("--fresh", action="store_true",
                    help="table 1 with a new owner command per region (each its first region)")
    ap.add_argument("--busy", action="store_true", help="siblings spin instead of sleeping")
    ap.add_argument("--json", help="write raw numbers here")
    ap.add_argument("--probes", default="off", help="the daemon's --probes (default off)")
    ap.add_argument("--daemon-arg", action="append", default=[],
                    help="extra `krex serve` argument for the cgroup daemon (e.g. --cgroup-root=...)")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="krex-bench-", dir="/tmp")
    owner = os.path.join(tmp, "owner.py")
    sleeper = os.path.join(tmp, "sleeper.py")
    open(owner, "w").write(OWNER)
    open(sleeper, "w").write(SPINNER if args.busy else SLEEPER)
    out: dict[str, object] = {"cpus": len(os.sched_getaffinity(0)), "date": time.strftime("%F %T"),
                              "rows": []}
    print(f"region overhead ({out['cpus']} cpus, probes {args.probes}), {args.regions} regions a "
          f"row\n")
    print(f"{'backend':<8} {'siblings':>8} {'frozen':>6} {'enter p50':>10} {'enter p99':>10} "
          f"{'quiesce p50':>11} {'quiesce p99':>11} "
          f"{'freeze p50':>11} {'freeze p99':>11} {'cpuset p50':>11} {'cpuset p99':>11} "
          f"{'exit p50':>9} {'exit p99':>9}")
    for backend in args.backends.split(","):
        d = Daemon(tmp, backend, args.daemon_arg, args.probes)
        splits: list[dict] = []
        try:
            for s in [int(x) for x in args.siblings.split(",") if x]:
                r = asyncio.run(siblings_case(d.sock, owner, sleeper, s, args.regions, args.fresh))
                r["backend"] = backend
                out["rows"].append(r)  # type: ignore[attr-defined]
                print(f"{backend:<8} {s:>8} {r['frozen']:>6.0f} {pct(r['enter'], .5):>10.3f} "
                      f"{pct(r['enter'], .99):>10.3f} {pct(r['quiesce'], .5):>11.3f} "
                      f"{pct(r['quiesce'], .99):>11.3f} {pct(r['freeze'], .5):>11.3f} "
                      f"{pct(r['freeze'], .99):>11.3f} {pct(r['cores'], .5):>11.3f} "
                      f"{pct(r['cores'], .99):>11.3f} {pct(r['exit'], .5):>9.3f} "
                      f"{pct(r['exit'], .99):>9.3f}", flush=True)
                splits.append(r)
            if splits:  # the daemon's side of each entry, and what the owner's side adds to it
                print(f"\n{'backend':<8} {'siblings':>8} {'daemon p50':>10} {'daemon p99':>10} "
                      f"{'select p50':>10} {'settle p50':>10} {'owner+wire p50':>14}  drain")
                for r in splits:
                    rest = [e - dm for e, dm in zip(r["enter"], r["daemon"])]
                    print(f"{backend:<8} {r['siblings']:>8} {pct(r['daemon'], .5):>10.3f} "
                          f"{pct(r['daemon'], .99):>10.3f} {pct(r['select'], .5):>10.3f} "
                          f"{pct(r['settle'], .5):>10.3f} {pct(rest, .5):>14.3f}  "
                          f"{','.join(r['drain'])}", flush=True)
            print(f"\n{'backend':<8} {'commands':>8} {'enter p50':>10} {'enter p99':>10} "
                  f"{'wait p50':>9} {'wait p99':>9} {'exit p50':>9} {'exit p99':>9}")
            for n in [int(x) for x in args.contending.split(",") if x]:
                r = asyncio.run(contending_case(d.sock, owner, n, max(10, args.regions // n)))
                r["backend"] = backend
                out["rows"].append(r)  # type: ignore[attr-defined]
                print(f"{backend:<8} {n:>8} {pct(r['enter'], .5):>10.3f} "
                      f"{pct(r['enter'], .99):>10.3f} {pct(r['wait'], .5):>9.3f} "
                      f"{pct(r['wait'], .99):>9.3f} {pct(r['exit'], .5):>9.3f} "
                      f"{pct(r['exit'], .99):>9.3f}", flush=True)
            print()
        finally:
            d.stop()
    print("latencies in ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
