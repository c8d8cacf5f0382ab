"""Does a region move host-clock timings? In-region against out-of-region, one process, interleaved.

Run G of the replay (bench/RESULTS.md, section 1) found region timings of 1-10 ms kernels +1.1% slower
than the isolated pass by the host-clock method (perf_counter around a launch and a synchronize),
while CUDA events and do_bench showed nothing. What a region changes for its owner: its threads run
on the region cores only, siblings are frozen (none here), the GPU clock is settled, the owner warms
(0 ms when settled). This times the same kernels in one command, alternating out of a region and in
one, per daemon variant (default; --region-cores=0; --warm-ms=200), so the machine's drift cancels.

    python3 -m bench.gpu.region_host_sync [--rounds 12] [--reps 60] [--json FILE] [--daemon-arg=...]

Prints, per variant and kernel, the median host-clock time out and in, and in/out - 1 (median over
rounds, with the min..max). Needs CUDA; run from the repo root.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench.harness.output import module_prog, write_json

ROOT = Path(__file__).resolve().parents[2]

KERNELS = {"mm4k-f16": 4096, "mm8k-f16": 8192}  # about 0.2 ms and 1.7 ms on the H200


def command(rounds: int, reps: int) -> None:
    """The krex command: for each round, each kernel timed out of a region, then in one."""
    import torch

    from krex_async import region

    ks = {}
    for name, n in KERNELS.items():
        a = torch.randn(n, n, device="cuda", dtype=torch.float16)
        b = torch.randn(n, n, device="cuda", dtype=torch.float16)
        ks[name] = lambda a=a, b=b: torch.mm(a, b)

    def timed(fn: Any) -> float:
        torch.cuda.synchronize()
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        xs = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            xs.append(time.perf_counter() - t0)
        return statistics.median(xs) * 1e3

    out: list[dict[str, Any]] = []
    aff_out = sorted(os.sched_getaffinity(0))
    for r in range(rounds):
        row: dict[str, Any] = {"round": r}
        for name, fn in ks.items():
            row[f"{name}|out"] = timed(fn)
        with region("timing") as g:
            aff_in = sorted(os.sched_getaffinity(0))
            for name, fn in ks.items():
                row[f"{name}|in"] = timed(fn)
        rep = getattr(g, "report", None)
        row["cores"] = list(getattr(rep, "cores", []) or [])
        out.append(row)
    print(json.dumps({"rows": out, "affinity_out": aff_out, "affinity_in": aff_in}), flush=True)


async def variant(name: str, args: list[str], a: argparse.Namespace) -> dict[str, Any]:
    from bench.harness.stack import Daemon, bench_env, module_argv
    from krex_async import Client

    log = Path("/tmp/krex-hostsync") / f"daemon-{name}.log"
    async with Daemon(["--log-format", "json", *a.daemon_arg, *args], policy="region", log=log) as d:
        async with await Client.connect(d.socket) as c:
            res = await c.run(
                module_argv(
                    "bench.gpu.region_host_sync",
                    "--command",
                    "--rounds",
                    str(a.rounds),
                    "--reps",
                    str(a.reps),
                ),
                cwd=str(ROOT),
                env=bench_env(),
                device="auto",
                timeout=300,
            )
    if res.returncode != 0:
        raise RuntimeError(f"{name}: rc {res.returncode}: {res.stderr[-1500:].decode(errors='replace')}")
    data = json.loads(res.stdout.decode().strip().splitlines()[-1])
    data["variant"], data["daemon_args"] = name, args
    return data


def summary(data: dict[str, Any]) -> list[str]:
    lines = []
    for k in KERNELS:
        rel = [r[f"{k}|in"] / r[f"{k}|out"] - 1 for r in data["rows"]]
        out = statistics.median(r[f"{k}|out"] for r in data["rows"])
        inn = statistics.median(r[f"{k}|in"] for r in data["rows"])
        lines.append(
            f"{data['variant']:<14} {k:<9} {out:9.4f} {inn:9.4f} {statistics.median(rel):+8.2%}"
            f"   {min(rel):+.2%}..{max(rel):+.2%}  cores in region {data['affinity_in']}"
        )
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(prog=module_prog(__spec__), description=__doc__.split("\n")[0])
    ap.add_argument("--command", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--reps", type=int, default=60)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--daemon-arg", action="append", default=[])
    a = ap.parse_args()
    if a.rounds < 1 or a.reps < 5:
        ap.error("--rounds must be at least 1 and --reps at least 5")
    if a.command:
        command(a.rounds, a.reps)
        return 0
    variants = {"default": [], "region-cores=0": ["--region-cores=0"], "warm-ms=200": ["--warm-ms=200"]}
    results = []
    print(f"{'variant':<14} {'kernel':<9} {'out ms':>9} {'in ms':>9} {'in/out':>8}   min..max over rounds")
    for name, args in variants.items():
        data = asyncio.run(variant(name, args, a))
        results.append(data)
        print("\n".join(summary(data)), flush=True)
    if a.json:
        write_json(a.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
