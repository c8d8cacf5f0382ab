"""Start latency through the ctxpool vs a plain process: submit to the script's first instruction with a
live context, for 1 and for N commands started together.

    python -m bench.pool_start --device cuda [--together 1,16] [--rounds 5] [--json FILE]
    python -m bench.pool_start --device cpu

By default it runs standalone: it drives a Pool directly for the pooled path and
krex_async.linux.spawn.spawn() for the plain one. With --daemon it goes end to end instead: a real daemon
(`krex serve --pool-size N --pool-preload ...`, its own cgroups as root) gets the commands through
its socket, so the figures include the submit, the daemon's placement, the cgroup join and the
worker's hand-over; "plain" is then the same daemon's path with the pool off (a second daemon).
The command prints time.monotonic() once its context is live (CLOCK_MONOTONIC is one clock for every
process of the host); latency = that - the submit time.
  cuda: python -c "import torch; torch.ones(1, device='cuda'); <print time>"   (pool preloads torch)
  cpu:  python -c "import json, decimal[, numpy]; <print time>"                 (pool preloads those)
The bench process itself never touches the GPU. Each pooled round waits until the pool is warm again
(warming is off the timing path by design), then submits N at once. Goal (cuda, N=16): pooled p95 at
least 20x below plain p95; the exit status is 1 when a --goal is given and missed.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import sys
import time
from typing import Any

from bench.harness.output import module_prog, write_json
from bench.harness.stack import Daemon, bench_env
from bench.harness.stats import pct_or_nan
from krex_async.ctxpool import Pool, PoolConfig
from krex_async.devices.base import Device
from krex_async.linux.spawn import LaunchSpec, spawn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

STAMP = "import time, os; os.write(1, repr(time.monotonic()).encode())"


def workload(device: str) -> tuple[list[str], str]:
    if device == "cuda":
        return ["torch"], "import torch; torch.ones(1, device='cuda'); " + STAMP
    mods = ["json", "decimal"] + (["numpy"] if importlib.util.find_spec("numpy") else [])
    return mods, f"import {', '.join(mods)}; " + STAMP


def pct(xs: list[float], q: float) -> float:
    return pct_or_nan(xs, q, "rank")


async def one_batch(n: int, code: str, pool: Pool | None) -> tuple[list[float], list[float]]:
    """Submit n commands at once; returns (latencies to the stamp, pool start latencies)."""
    loop = asyncio.get_running_loop()
    env = dict(os.environ)
    jobs = []
    for _ in range(n):
        r, w = os.pipe()
        null = os.open(os.devnull, os.O_RDWR)
        spec = LaunchSpec(
            argv=[sys.executable, "-c", code], cwd=ROOT, env=env, stdin_fd=null, stdout_fd=w, stderr_fd=null
        )
        t0 = time.monotonic()
        launched = await pool.launch(spec) if pool is not None else spawn(spec)
        if launched is None:
            raise SystemExit(f"pool had no warm worker: {pool.status() if pool else ''}")
        os.close(w)
        os.close(null)
        jobs.append((t0, r, launched))
    lat, pool_lat = [], []
    for t0, r, launched in jobs:
        out = await loop.run_in_executor(None, _read_all, r)
        status = await launched.wait()
        if status.returncode != 0 or not out:
            raise SystemExit(f"command failed: {status}, output {out!r}")
        lat.append(float(out) - t0)
        if launched.start_latency_s is not None:
            pool_lat.append(launched.start_latency_s)
    return lat, pool_lat


async def daemon_batches(
    counts: list[int], rounds: int, code: str, preload: list[str], pooled: bool, extra: list[str]
) -> dict[int, list[float]]:
    """Through a real daemon: for each N, `rounds` batches of N commands submitted at once over
    one connection each; latency = the command's stamp - the time just before its submit."""
    from krex_async import Client

    size = max(counts) if pooled else 0
    env = bench_env()
    args = ["--probes", "off", "--pool-size", str(size), *extra]
    if pooled:
        args += ["--pool-preload", ",".join(preload)]
    out: dict[int, list[float]] = {}
    async with Daemon(args, prefix="krexps-") as d:
        sock = d.socket
        clients = [await Client.connect(sock) for _ in range(max(counts))]

        async def warm() -> None:
            for _ in range(1200):
                pools = (await clients[0].status()).get("pools", {})
                if not pooled or (pools and all(p["warm"] >= size for p in pools.values())):
                    return
                await asyncio.sleep(0.1)
            raise SystemExit(f"pool never warm: {pools}")

        async def one(c: Client) -> float:
            t0 = time.monotonic()
            res = await c.run([sys.executable, "-c", code], cwd=ROOT, env=env)
            if res.returncode != 0 or not res.stdout:
                raise SystemExit(f"command failed: {res.returncode} {res.stderr[-500:]!r}")
            return float(res.stdout) - t0

        for n in counts:
            out[n] = []
            for _ in range(rounds):
                await warm()
                out[n] += await asyncio.gather(*(one(c) for c in clients[:n]))
        for c in clients:
            await c.close()
    return out


def _read_all(fd: int) -> bytes:
    chunks = []
    while data := os.read(fd, 65536):
        chunks.append(data)
    os.close(fd)
    return b"".join(chunks)


async def main() -> int:
    ap = argparse.ArgumentParser(
        prog=module_prog(__spec__), description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--device", choices=["cuda", "cpu"], default="cuda" if os.path.exists("/dev/nvidia0") else "cpu"
    )
    ap.add_argument("--together", default="1,16")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--goal", type=float, default=None, help="required plain/pooled p95 ratio at max N")
    ap.add_argument("--json", default=None)
    ap.add_argument("--daemon", action="store_true", help="end to end, through a real daemon")
    ap.add_argument(
        "--daemon-arg", action="append", default=[], help="extra `krex serve` argument (--daemon; repeatable)"
    )
    args = ap.parse_args()
    counts = [int(x) for x in args.together.split(",")]
    preload, code = workload(args.device)
    if args.daemon:
        return await via_daemon(args, counts, preload, code)
    if args.device == "cuda":
        dev = Device(index=0, key="nvidia0", vendor="nvidia", name="gpu0")
    else:
        dev = Device(index=0, key="cpu", vendor="cpu", name="cpu", cpus=frozenset(range(os.cpu_count() or 1)))
    pool = Pool(dev, PoolConfig(size=max(counts), preload=preload))
    t = time.monotonic()
    await pool.start()
    await pool.wait_warm(timeout=600)
    print(f"pool of {max(counts)} warm in {time.monotonic() - t:.2f} s ({args.device}, preload {preload})")
    rows, results = [], {}
    try:
        for n in counts:
            for mode in ("plain", "pool"):
                lat, plat = [], []
                for _ in range(args.rounds):
                    if mode == "pool":
                        await pool.wait_warm(timeout=600)
                    a, b = await one_batch(n, code, pool if mode == "pool" else None)
                    lat += a
                    plat += b
                results[f"{mode}/{n}"] = {"latency_s": lat, "pool_start_latency_s": plat}
                rows.append(
                    (
                        mode,
                        n,
                        len(lat),
                        pct(lat, 0.5),
                        pct(lat, 0.95),
                        pct(plat, 0.5) if plat else float("nan"),
                    )
                )
    finally:
        await pool.close()
    print(f"\n{'mode':6} {'N':>3} {'samples':>7} {'p50 ms':>10} {'p95 ms':>10} {'pool start p50 ms':>18}")
    for mode, n, k, p50, p95, s50 in rows:
        print(f"{mode:6} {n:>3} {k:>7} {p50 * 1e3:>10.2f} {p95 * 1e3:>10.2f} {s50 * 1e3:>18.3f}")
    return verdict(args, counts, results, {"device": args.device, "preload": preload})


def verdict(
    args: argparse.Namespace, counts: list[int], results: dict[str, Any], about: dict[str, Any]
) -> int:
    """Print plain/pooled p95 per N and the goal's verdict at the largest N, write --json;
    0 unless a --goal was missed. `results` holds "<mode>/<N>": {"latency_s": [...]}."""
    ok = True
    for n in counts:
        ratio = pct(results[f"plain/{n}"]["latency_s"], 0.95) / pct(results[f"pool/{n}"]["latency_s"], 0.95)
        print(f"N={n}: plain p95 / pooled p95 = {ratio:.1f}x")
        results[f"ratio_p95/{n}"] = ratio
        if args.goal is not None and n == max(counts) and ratio < args.goal:
            ok = False
    if args.goal is not None:
        print(f"goal {args.goal}x at N={max(counts)}: {'met' if ok else 'MISSED'}")
    if args.json:
        write_json(args.json, {**about, "results": results})
    return 0 if ok else 1


async def via_daemon(args: argparse.Namespace, counts: list[int], preload: list[str], code: str) -> int:
    lat = {
        mode: await daemon_batches(counts, args.rounds, code, preload, mode == "pool", args.daemon_arg)
        for mode in ("plain", "pool")
    }
    print(f"through the daemon ({args.device}, preload {preload}), {args.rounds} rounds")
    print(f"\n{'mode':6} {'N':>3} {'samples':>7} {'p50 ms':>10} {'p95 ms':>10}")
    results: dict[str, Any] = {}
    for n in counts:
        for mode in ("plain", "pool"):
            xs = lat[mode][n]
            results[f"{mode}/{n}"] = {"latency_s": xs}
            print(f"{mode:6} {n:>3} {len(xs):>7} {pct(xs, 0.5) * 1e3:>10.2f} {pct(xs, 0.95) * 1e3:>10.2f}")
    return verdict(args, counts, results, {"device": args.device, "preload": preload, "via": "daemon"})


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
