"""Why a short kernel timed right after a heavy neighbour stops runs slow, and what tells us it will
(one NVIDIA GPU, torch, pynvml):

    PYTHONPATH=. python3 -m bench.gpu.check_settle [--out FILE]

check_drain.py found a 0.1 ms matmul 20-27% slow when timed right after a neighbour running 16384^2
matmuls had synchronised and stopped, and within 2% after 200 ms of "warming"; check_nvml_signals.py
found that an idle GPU holding a context keeps its SM clock at the maximum for seconds, so idling
is not what lowers it. The suspect is the power cap the heavy neighbour ran into. Here:
1. round trips of a tiny kernel (launch + synchronise) with the device idle and with a neighbour's
   backlog running: can the owner tell "drained" from its own round trips, with an absolute bar?
2. after the heavy neighbour stops: the SM clock and clocks-event reasons every ~1 ms for 1 s.
3. a 0.1 ms matmul timed (100 reps) at 0..400 ms after the neighbour stopped, with the SM clock and
   reasons read just before: does "clock back at max and no power cap" predict a clean timing?
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

import pynvml as N
import torch

from bench.harness import stats
from bench.harness.output import module_prog, write_json

NEIGHBOUR = r"""
import sys, time, torch
a = torch.randn(16384, 16384, device="cuda", dtype=torch.float16)
o = torch.empty_like(a)
torch.cuda.synchronize()
print("ready", flush=True)
for line in sys.stdin:
    secs = float(line)
    end = time.time() + secs
    while time.time() < end:
        for _ in range(8):
            torch.matmul(a, a, out=o)
        torch.cuda.synchronize()
    print(time.time(), flush=True)
"""


def pct(xs: list[float], q: float) -> float:
    return stats.quantile(xs, q, "rank")


def main() -> int:
    ap = argparse.ArgumentParser(
        prog=module_prog(__spec__),
    )
    ap.add_argument("--out")
    args = ap.parse_args()
    N.nvmlInit()
    h = N.nvmlDeviceGetHandleByIndex(0)
    x = torch.ones(256, device="cuda")
    a = torch.randn(3072, 3072, device="cuda", dtype=torch.float16)
    o = torch.empty_like(a)
    torch.cuda.synchronize()

    def clock() -> tuple[int, int]:
        return (
            N.nvmlDeviceGetClockInfo(h, N.NVML_CLOCK_SM),
            int(N.nvmlDeviceGetCurrentClocksEventReasons(h)),
        )

    def rtt(n: int) -> list[float]:
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            x.add_(1.0)
            torch.cuda.synchronize()
            out.append((time.perf_counter() - t0) * 1e6)
        return out

    def timed(reps: int = 100) -> float:
        evs = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)
        ]
        for s, e in evs:
            s.record()
            torch.matmul(a, a, out=o)
            e.record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in evs)

    res: dict[str, object] = {}
    rtt(200)
    idle = rtt(2000)
    base = statistics.median(timed() for _ in range(20))
    res["alone_0.1ms_median_ms"] = base
    res["clock_alone"] = clock()

    p = subprocess.Popen(
        [sys.executable, "-c", NEIGHBOUR], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert p.stdin and p.stdout and p.stdout.readline().strip() == "ready"

    def busy(secs: float) -> None:
        p.stdin.write(f"{secs}\n")  # type: ignore[union-attr]
        p.stdin.flush()  # type: ignore[union-attr]

    busy(3.0)
    time.sleep(1.0)
    loaded = rtt(2000)
    res["clock_loaded"] = clock()
    float(p.stdout.readline())
    res["rtt_us"] = {
        name: {
            "p01": pct(v, 0.01),
            "p10": pct(v, 0.1),
            "p50": pct(v, 0.5),
            "p90": pct(v, 0.9),
            "p99": pct(v, 0.99),
            "min": min(v),
        }
        for name, v in (("idle", idle), ("neighbour_busy", loaded))
    }
    print("rtt", res["rtt_us"], flush=True)

    series = []
    busy(2.0)
    t_stop = float(p.stdout.readline())
    while time.time() < t_stop + 1.0:
        c, r = clock()
        series.append((time.time() - t_stop, c, r))
        time.sleep(0.001)
    res["after_stop_series"] = series
    top = max(c for _, c, _ in series)
    back = next((t for t, c, r in series if c >= top and not r & 0x4), None)
    res["after_stop_ms_to_max_and_no_powercap"] = None if back is None else 1000 * back
    res["after_stop_first_clock"] = series[0]
    print(
        "after stop: first",
        series[0],
        "back at",
        res["after_stop_ms_to_max_and_no_powercap"],
        "ms, top",
        top,
        flush=True,
    )

    rows = []
    for delay_ms in (0, 10, 25, 50, 100, 200, 400):
        for rep in range(3):
            busy(1.0)
            t_stop = float(p.stdout.readline())
            while time.time() < t_stop + delay_ms / 1000:
                time.sleep(0.0005)
            c, r = clock()
            m = timed()
            rows.append(
                {
                    "delay_ms": delay_ms,
                    "rep": rep,
                    "sm_mhz": c,
                    "reasons": r,
                    "vs_alone_pct": 100 * (m / base - 1),
                }
            )
            print(rows[-1], flush=True)
    res["rows"] = rows
    p.stdin.close()
    p.wait()
    if args.out:
        write_json(args.out, res, indent=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
