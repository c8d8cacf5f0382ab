"""The fleet: throughput from 1 to N nodes on the cpu device, and the fleet client's own cost per
command against a direct Client.

    python -m bench.fleet [--max-nodes 3] [--commands 36] [--region-ms 200] [--overhead 200]
                          [--json FILE]

Throughput: for k = 1..max-nodes, a fresh local Ray cluster of k nodes (krex_async.fleet.local), each
with a daemon of one cpu device (`--devices cpu:1`), and `--commands` commands submitted at once
through the FleetClient. Each command holds its device in `region("timing")` for --region-ms (a
sleep: the device, not the host's cores, is what a command waits for, as on a GPU node), so a node
serves about 1000/region-ms commands a second and k nodes should serve k times that. All nodes share
this machine's cores: Python start-up and imports of every command still compete for them, which is
what can keep the scaling below linear here and would not on k machines.

Overhead: on a 1-node fleet, `--overhead` trivial commands (`true`) one after another, through the
FleetClient and through a Client connected to the same daemon; the difference of the medians is what
the fleet adds to one command (a Ray actor call streamed back, placement, the agent's connection).
Then the same commands all at once, for the throughput of the two paths.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import sysconfig
import time
from pathlib import Path

from bench.harness import stats
from bench.harness.output import module_prog, write_json
from krex_async.client.submit import Client
from krex_async.fleet.local import LocalFleet

ROOT = Path(__file__).resolve().parent.parent
# As root the fleet runs its commands as an unprivileged user (`nobody`): an interpreter that user can
# run (this venv's may sit under root's home), of the same Python version.
PYTHON = sys.executable if os.geteuid() else os.environ.get("KREX_BENCH_PYTHON", "/usr/bin/python3")

HOLD = """
import sys, time
from krex_async import region
with region("timing"):
    time.sleep(float(sys.argv[1]) / 1e3)
"""


def env() -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if k != "KREX_SOCKET"}
    site = sysconfig.get_paths()["purelib"]  # msgspec & co. for PYTHON below
    e["PYTHONPATH"] = os.pathsep.join([str(ROOT), site, e.get("PYTHONPATH", "")])
    return e


def quantile(xs: list[float], q: float) -> float:
    return stats.quantile(xs, q, "rank")


async def throughput(k: int, n: int, region_ms: float) -> dict[str, object]:
    """n region-bound commands at once over a k-node fleet: makespan, commands/s, per node."""
    fleet = LocalFleet(k, daemon_args=("--devices", "cpu:1"))
    try:
        fleet.start()
        fc = await fleet.connect()
        try:
            t0 = time.monotonic()
            hs = await asyncio.gather(
                *(fc.submit([PYTHON, "-c", HOLD, str(region_ms)], env=env(), cwd=str(ROOT)) for _ in range(n))
            )
            results = await asyncio.gather(*(h.wait() for h in hs))
            makespan = time.monotonic() - t0
        finally:
            await fc.close()
        bad = [r.report.command for r in results if r.returncode != 0]
        if bad:
            raise SystemExit(f"commands failed: {bad}: {results[0].stderr!r}")
        per_node: dict[str, int] = {}
        for h in hs:
            per_node[h.node] = per_node.get(h.node, 0) + 1
        return {
            "nodes": k,
            "commands": n,
            "makespan_s": makespan,
            "per_s": n / makespan,
            "ideal_per_s": k * 1e3 / region_ms,
            "per_node": per_node,
            "lost": len(fc.lost),
        }
    finally:
        fleet.close()


async def overhead(m: int) -> dict[str, object]:
    """Per-command latency of `true` through the fleet and through a direct Client, serial and
    all at once, on one node."""
    fleet = LocalFleet(1, daemon_args=("--devices", "cpu:1"))
    try:
        fleet.start()
        fc = await fleet.connect()
        direct = await Client.connect(os.path.join(fleet.base_dir, "node0", "s"))
        out: dict[str, object] = {"commands": m}
        paths = {"direct": direct.run, "fleet": fc.run}
        try:
            for run in paths.values():
                for _ in range(5):  # warm both paths (first actor calls, first spawns)
                    await run(["true"], env=env(), cwd="/")
            lat: dict[str, list[float]] = {name: [] for name in paths}
            for _ in range(m):  # interleaved, so the machine's load drifts over both alike
                for name, run in paths.items():
                    t = time.perf_counter()
                    res = await run(["true"], env=env(), cwd="/")
                    lat[name].append(time.perf_counter() - t)
                    assert res.returncode == 0, res
            for name, run in paths.items():
                t = time.perf_counter()
                done = await asyncio.gather(*(run(["true"], env=env(), cwd="/") for _ in range(m)))
                burst = time.perf_counter() - t
                assert all(r.returncode == 0 for r in done)
                out[name] = {
                    "p50_ms": statistics.median(lat[name]) * 1e3,
                    "p95_ms": quantile(lat[name], 0.95) * 1e3,
                    "burst_per_s": m / burst,
                }
        finally:
            await direct.close()
            await fc.close()
        d, f = out["direct"], out["fleet"]
        assert isinstance(d, dict) and isinstance(f, dict)
        out["overhead_p50_ms"] = f["p50_ms"] - d["p50_ms"]
        return out
    finally:
        fleet.close()


async def main() -> int:
    ap = argparse.ArgumentParser(prog=module_prog(__spec__), description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-nodes", type=int, default=3)
    ap.add_argument("--commands", type=int, default=36)
    ap.add_argument("--region-ms", type=float, default=200.0)
    ap.add_argument("--overhead", type=int, default=200, help="commands for the overhead part")
    ap.add_argument("--json", help="write the numbers here")
    args = ap.parse_args()
    if args.max_nodes < 1 or args.commands < 1 or args.region_ms <= 0 or args.overhead < 1:
        print("bench/fleet.py: --max-nodes, --commands, --overhead >= 1 and --region-ms > 0", file=sys.stderr)
        return 2
    rows = [await throughput(k, args.commands, args.region_ms) for k in range(1, args.max_nodes + 1)]
    base = float(rows[0]["per_s"])  # type: ignore[arg-type]
    print(
        f"throughput: {args.commands} commands, each holding its node's one cpu device for "
        f"{args.region_ms:g} ms in a region\n"
    )
    print("| nodes | makespan s | commands/s | vs 1 node | ideal commands/s | per node | lost |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        per = ", ".join(f"{k} {v}" for k, v in sorted(r["per_node"].items()))  # type: ignore[attr-defined]
        ratio = float(r["per_s"]) / base  # type: ignore[arg-type]
        print(
            f"| {r['nodes']} | {r['makespan_s']:.2f} | {r['per_s']:.2f} | "
            f"{ratio:.2f}x | {r['ideal_per_s']:.1f} | {per} | {r['lost']} |"
        )
    ov = await overhead(args.overhead)
    d, f = ov["direct"], ov["fleet"]
    assert isinstance(d, dict) and isinstance(f, dict)
    print(
        f"\noverhead: `true`, {args.overhead} one after another, then {args.overhead} at once, on one node\n"
    )
    print("| path | p50 ms | p95 ms | at once, commands/s |")
    print("|---|---|---|---|")
    for name, v in (("Client (direct)", d), ("FleetClient", f)):
        print(f"| {name} | {v['p50_ms']:.2f} | {v['p95_ms']:.2f} | {v['burst_per_s']:.1f} |")
    print(f"\nthe fleet adds {ov['overhead_p50_ms']:.2f} ms per command (p50)")
    if args.json:
        write_json(args.json, {"throughput": rows, "overhead": ov}, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
