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
import sys
import tempfile
import time
from pathlib import Path

from bench.harness.output import module_prog, write_json
from bench.harness.stack import Daemon, bench_env, module_argv
from bench.harness.stats import pct_or_nan

LOOP = "bench.workload.region_loop"  # the owner's loop and the siblings (python -m)


def pct(xs: list[float], q: float) -> float:
    return pct_or_nan(xs, q, "rank") * 1e3  # in ms


def env() -> dict[str, str]:
    return bench_env()


def start_daemon(tmp: str, backend: str, extra: list[str], probes: str = "off") -> Daemon:
    """The backend's daemon, its log beside the results in `tmp`; extra arguments for cgroup only."""
    return Daemon(
        [
            "--isolation",
            backend,
            "--log-level",
            "warning",
            "--probes",
            probes,
            *(extra if backend == "cgroup" else []),
        ],
        log=Path(tmp) / f"{backend}.log",
        parent=tmp,
    ).start()


async def siblings_case(sock: str, sibling: str, n_sib: int, regions: int, fresh: bool = False) -> dict:
    """`fresh`: every region is the first (and only) one of a new owner command, as in the replay,
    where each command times one kernel; otherwise one owner enters `regions` regions."""
    from krex_async import Client

    async with await Client.connect(sock) as c:
        sibs = [await c.submit(module_argv(LOOP, sibling), env=env()) for _ in range(n_sib)]
        await asyncio.sleep(0.5 + 0.02 * n_sib)  # let them start
        runs = (
            [await c.run(module_argv(LOOP, "owner", "1"), env=env()) for _ in range(regions)]
            if fresh
            else [await c.run(module_argv(LOOP, "owner", str(regions)), env=env())]
        )
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
    return {
        "siblings": n_sib,
        "enter": data["enter"][skip:],
        "exit": data["exit"][skip:],
        "freeze": [r[0] for r in rep],
        "cores": [r[1] for r in rep],
        "quiesce": [r[5] for r in rep],
        "daemon": [r[3] for r in rep],
        "select": [r[6] for r in rep],
        "settle": [r[7] for r in rep],
        "drain": sorted({r[8] for r in rep}),
        "frozen": statistics.median(r[4] for r in rep) if rep else 0,
    }


async def contending_case(sock: str, n: int, regions: int) -> dict:
    from krex_async import Client

    async with await Client.connect(sock) as c:
        results = await asyncio.gather(
            *(c.run(module_argv(LOOP, "owner", str(regions)), env=env()) for _ in range(n))
        )
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
    ap = argparse.ArgumentParser(
        prog=module_prog(__spec__), description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    ap.add_argument("--backends", default="signal")
    ap.add_argument("--siblings", default="1,4,16")
    ap.add_argument("--contending", default="1,4,16")
    ap.add_argument("--regions", type=int, default=200)
    ap.add_argument(
        "--fresh",
        action="store_true",
        help="table 1 with a new owner command per region (each its first region)",
    )
    ap.add_argument("--busy", action="store_true", help="siblings spin instead of sleeping")
    ap.add_argument("--json", help="write raw numbers here")
    ap.add_argument("--probes", default="off", help="the daemon's --probes (default off)")
    ap.add_argument(
        "--daemon-arg",
        action="append",
        default=[],
        help="extra `krex serve` argument for the cgroup daemon (e.g. --cgroup-root=...)",
    )
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="krex-bench-", dir="/tmp")
    sibling = "spin" if args.busy else "sleep"
    out: dict[str, object] = {
        "cpus": len(os.sched_getaffinity(0)),
        "date": time.strftime("%F %T"),
        "rows": [],
    }
    print(f"region overhead ({out['cpus']} cpus, probes {args.probes}), {args.regions} regions a row\n")
    print(
        f"{'backend':<8} {'siblings':>8} {'frozen':>6} {'enter p50':>10} {'enter p99':>10} "
        f"{'quiesce p50':>11} {'quiesce p99':>11} "
        f"{'freeze p50':>11} {'freeze p99':>11} {'cpuset p50':>11} {'cpuset p99':>11} "
        f"{'exit p50':>9} {'exit p99':>9}"
    )
    for backend in args.backends.split(","):
        d = start_daemon(tmp, backend, args.daemon_arg, args.probes)
        splits: list[dict] = []
        try:
            for s in [int(x) for x in args.siblings.split(",") if x]:
                r = asyncio.run(siblings_case(d.socket, sibling, s, args.regions, args.fresh))
                r["backend"] = backend
                out["rows"].append(r)  # type: ignore[attr-defined]
                print(
                    f"{backend:<8} {s:>8} {r['frozen']:>6.0f} {pct(r['enter'], 0.5):>10.3f} "
                    f"{pct(r['enter'], 0.99):>10.3f} {pct(r['quiesce'], 0.5):>11.3f} "
                    f"{pct(r['quiesce'], 0.99):>11.3f} {pct(r['freeze'], 0.5):>11.3f} "
                    f"{pct(r['freeze'], 0.99):>11.3f} {pct(r['cores'], 0.5):>11.3f} "
                    f"{pct(r['cores'], 0.99):>11.3f} {pct(r['exit'], 0.5):>9.3f} "
                    f"{pct(r['exit'], 0.99):>9.3f}",
                    flush=True,
                )
                splits.append(r)
            if splits:  # the daemon's side of each entry, and what the owner's side adds to it
                print(
                    f"\n{'backend':<8} {'siblings':>8} {'daemon p50':>10} {'daemon p99':>10} "
                    f"{'select p50':>10} {'settle p50':>10} {'owner+wire p50':>14}  drain"
                )
                for r in splits:
                    rest = [e - dm for e, dm in zip(r["enter"], r["daemon"])]
                    print(
                        f"{backend:<8} {r['siblings']:>8} {pct(r['daemon'], 0.5):>10.3f} "
                        f"{pct(r['daemon'], 0.99):>10.3f} {pct(r['select'], 0.5):>10.3f} "
                        f"{pct(r['settle'], 0.5):>10.3f} {pct(rest, 0.5):>14.3f}  "
                        f"{','.join(r['drain'])}",
                        flush=True,
                    )
            print(
                f"\n{'backend':<8} {'commands':>8} {'enter p50':>10} {'enter p99':>10} "
                f"{'wait p50':>9} {'wait p99':>9} {'exit p50':>9} {'exit p99':>9}"
            )
            for n in [int(x) for x in args.contending.split(",") if x]:
                r = asyncio.run(contending_case(d.socket, n, max(10, args.regions // n)))
                r["backend"] = backend
                out["rows"].append(r)  # type: ignore[attr-defined]
                print(
                    f"{backend:<8} {n:>8} {pct(r['enter'], 0.5):>10.3f} "
                    f"{pct(r['enter'], 0.99):>10.3f} {pct(r['wait'], 0.5):>9.3f} "
                    f"{pct(r['wait'], 0.99):>9.3f} {pct(r['exit'], 0.5):>9.3f} "
                    f"{pct(r['exit'], 0.99):>9.3f}",
                    flush=True,
                )
            print()
        finally:
            d.stop()
    print("latencies in ms")
    if args.json:
        write_json(args.json, out, indent=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
