"""How long this machine takes to wake a sleeping process on another core: the floor under every
freeze (each frozen task must be woken to trap into the freezer) and every reply the daemon waits
for. A region's enter latency on a machine where this is slow is slow for any runtime.

    python3 -m bench.wakeup [--pairs 0:1,0:8] [--rounds 2000] [--json FILE]

Per pair of CPUs: two processes pinned one to each pass a byte back and forth through pipes, each
blocking in read() between turns (so every turn wakes a sleeping task); the table gives the one-way
wake time (half the round trip) p50/p99/max, and the overshoot of a 100 us nanosleep on the first
CPU (the timer wake-up of an idle core).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from bench.harness.output import module_prog, write_json
from bench.harness.stats import quantile


def pingpong(a: int, b: int, rounds: int) -> list[float]:
    """Round trips in seconds between a process on CPU a and one on CPU b."""
    r1, w1 = os.pipe()
    r2, w2 = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.sched_setaffinity(0, {b})
            for _ in range(rounds + 1):
                os.read(r1, 1)
                os.write(w2, b"x")
        finally:
            os._exit(0)
    os.sched_setaffinity(0, {a})
    out = []
    try:
        for i in range(rounds + 1):
            t0 = time.perf_counter()
            os.write(w1, b"x")
            os.read(r2, 1)
            if i:  # the first turn waits for the child to start
                out.append(time.perf_counter() - t0)
            time.sleep(0.0002)  # let the partner go idle again before the next turn
    finally:
        os.waitpid(pid, 0)
        for fd in (r1, w1, r2, w2):
            os.close(fd)
    return out


def oversleep(cpu: int, rounds: int) -> list[float]:
    os.sched_setaffinity(0, {cpu})
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        time.sleep(100e-6)
        out.append(time.perf_counter() - t0 - 100e-6)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(prog=module_prog(__spec__), description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--pairs", default="", help="CPU pairs a:b,... (default: first with second, first with middle)"
    )
    ap.add_argument("--rounds", type=int, default=2000)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    if args.rounds < 10:
        ap.error("--rounds must be at least 10")
    if args.pairs:
        try:
            pairs = [tuple(int(x) for x in p.split(":")) for p in args.pairs.split(",")]
        except ValueError:
            ap.error(f"--pairs: expected a:b,... with CPU numbers, got {args.pairs!r}")
        bad = [c for p in pairs for c in p if c not in cpus]
        if bad or any(len(p) != 2 for p in pairs):
            ap.error(f"--pairs: CPUs must be pairs from {cpus}")
    elif len(cpus) < 2:
        ap.error("needs two CPUs")
    else:
        pairs = sorted({(cpus[0], cpus[1]), (cpus[0], cpus[len(cpus) // 2])})
    rows = []
    print(f"{'cpus':>7} {'wake p50 us':>12} {'p99 us':>8} {'max us':>8} {'oversleep p50 us':>17} {'p99':>6}")
    for a, b in pairs:
        rt = [x / 2 for x in pingpong(a, b, args.rounds)]
        ov = oversleep(a, min(args.rounds, 1000))
        row = {
            "cpus": [a, b],
            "wake_p50_us": statistics.median(rt) * 1e6,
            "wake_p99_us": quantile(rt, 0.99, "rank") * 1e6,
            "wake_max_us": max(rt) * 1e6,
            "oversleep_p50_us": statistics.median(ov) * 1e6,
            "oversleep_p99_us": quantile(ov, 0.99, "rank") * 1e6,
        }
        rows.append(row)
        print(
            f"{a:>3}:{b:<3} {row['wake_p50_us']:>12.1f} {row['wake_p99_us']:>8.1f} "
            f"{row['wake_max_us']:>8.1f} {row['oversleep_p50_us']:>17.1f} {row['oversleep_p99_us']:>6.1f}"
        )
    if args.json:
        write_json(
            args.json,
            {
                "rounds": args.rounds,
                "host": os.uname().nodename,
                "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "rows": rows,
            },
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
