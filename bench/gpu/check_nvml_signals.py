"""What NVML can tell the daemon about a device's drain and clock state, measured (one NVIDIA GPU):

    PYTHONPATH=. python3 -m bench.gpu.check_nvml_signals [--out FILE]

1. Drain: a neighbour process queues about a second of matmuls, then synchronises and prints when
   its queue really finished (host clock). Meanwhile we poll NVML every 2 ms: the GPU utilisation
   samples (nvmlDeviceGetSamples), the coarse rate, per-process utilisation. How long after the
   true end does NVML say "idle", and how long is a sample period?
2. Clocks: SM clock and the clocks-event reasons (GpuIdle bit) while idle, during a warm loop of
   matmuls (how long until the clock is up), and after it stops (how long until it drops).
3. Timing vs clock state: a ~0.1 ms matmul timed with CUDA events after 0, 50, 200, 1000 ms of idle,
   with no warming, against the same kernel timed warm; the SM clock read just before each.
Prints a summary; the raw series go to --out (JSON).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

import pynvml as N
import torch

from bench.harness.output import module_prog, write_json

NEIGHBOUR = r"""
import sys, time, torch
a = torch.randn(8192, 8192, device="cuda", dtype=torch.float16)
o = torch.empty_like(a)
torch.cuda.synchronize()
print("ready", flush=True)
sys.stdin.readline()
t0 = time.time()
for _ in range(600):
    torch.matmul(a, a, out=o)
t1 = time.time()
torch.cuda.synchronize()
print(f"{t0} {t1} {time.time()}", flush=True)
time.sleep(1.5)
"""


def poll(h: object, stop: threading.Event, out: dict[str, list]) -> None:
    last = 0
    while not stop.is_set():
        now = time.time()
        try:
            kind, samples = N.nvmlDeviceGetSamples(h, N.NVML_GPU_UTILIZATION_SAMPLES, last)
            for s in samples:
                out["samples"].append((s.timeStamp / 1e6, s.sampleValue.uiVal))
                last = max(last, s.timeStamp)
        except N.NVMLError as e:
            out.setdefault("errors", []).append(str(e))
        try:
            out["rate"].append((now, N.nvmlDeviceGetUtilizationRates(h).gpu))
        except N.NVMLError:
            pass
        try:
            out["clock"].append(
                (
                    now,
                    N.nvmlDeviceGetClockInfo(h, N.NVML_CLOCK_SM),
                    N.nvmlDeviceGetCurrentClocksEventReasons(h),
                )
            )
        except (N.NVMLError, AttributeError):
            try:
                out["clock"].append(
                    (
                        now,
                        N.nvmlDeviceGetClockInfo(h, N.NVML_CLOCK_SM),
                        N.nvmlDeviceGetCurrentClocksThrottleReasons(h),
                    )
                )
            except N.NVMLError:
                pass
        time.sleep(0.002)


def drain(h: object) -> dict[str, object]:
    out: dict[str, Any] = {"samples": [], "rate": [], "clock": [], "proc": []}
    p = subprocess.Popen(
        [sys.executable, "-c", NEIGHBOUR], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert p.stdout and p.stdin and p.stdout.readline().strip() == "ready"
    time.sleep(1.0)
    stop = threading.Event()
    th = threading.Thread(target=poll, args=(h, stop, out))
    th.start()
    time.sleep(0.3)
    p.stdin.write("go\n")
    p.stdin.flush()
    t_start, t_queued, t_done = map(float, p.stdout.readline().split())
    time.sleep(1.0)
    stop.set()
    th.join()
    try:
        procs = N.nvmlDeviceGetProcessUtilization(h, int((t_start - 1) * 1e6))
        out["proc"] = [(x.timeStamp / 1e6, x.pid, x.smUtil) for x in procs]
    except N.NVMLError as e:
        out["proc_error"] = str(e)
    p.wait()
    ts = sorted(set(out["samples"]))
    periods = [b[0] - a[0] for a, b in zip(ts, ts[1:])]
    busy = [t for t, v in ts if v > 0]
    first_idle = next((t for t, v in ts if t > t_done and v == 0), None)
    last_busy = max(busy) if busy else None
    first_busy = min((t for t in busy if t >= t_start - 0.05), default=None)
    res = {
        "t_start": t_start,
        "t_queued": t_queued,
        "t_done": t_done,
        "work_s": t_done - t_start,
        "sample_period_ms_median": 1000 * statistics.median(periods) if periods else None,
        "sample_period_ms_max": 1000 * max(periods) if periods else None,
        "first_busy_after_start_ms": None if first_busy is None else 1000 * (first_busy - t_start),
        "last_busy_sample_after_done_ms": None if last_busy is None else 1000 * (last_busy - t_done),
        "first_idle_sample_after_done_ms": None if first_idle is None else 1000 * (first_idle - t_done),
        "series": {k: v for k, v in out.items()},
    }
    # The coarse rate: first time it reads 0 after the work ended
    r0 = next((t for t, v in out["rate"] if t > t_done and v == 0), None)
    res["rate_zero_after_done_ms"] = None if r0 is None else 1000 * (r0 - t_done)
    return res


def clocks(h: object) -> dict[str, object]:
    out: dict[str, list] = {"samples": [], "rate": [], "clock": []}
    stop = threading.Event()
    th = threading.Thread(target=poll, args=(h, stop, out))
    a = torch.randn(2048, 2048, device="cuda", dtype=torch.float16)
    b = torch.empty_like(a)
    torch.cuda.synchronize()
    time.sleep(2.0)
    th.start()
    time.sleep(0.3)
    t_warm = time.time()
    while time.time() < t_warm + 0.5:
        for _ in range(4):
            torch.matmul(a, a, out=b)
        torch.cuda.synchronize()
    t_stop = time.time()
    time.sleep(2.0)
    stop.set()
    th.join()
    idle = [c for t, c, _ in out["clock"] if t < t_warm]
    during = [(t - t_warm, c) for t, c, _ in out["clock"] if t_warm <= t < t_stop]
    peak = max((c for _, c in during), default=0)
    up = next((dt for dt, c in during if c >= 0.95 * peak), None)
    after = [(t - t_stop, c, r) for t, c, r in out["clock"] if t >= t_stop]
    down = next((dt for dt, c, _ in after if c < 0.8 * peak), None)
    return {
        "idle_mhz": statistics.median(idle) if idle else None,
        "peak_mhz": peak,
        "ms_to_95pct_peak": None if up is None else 1000 * up,
        "ms_until_below_80pct_after_stop": None if down is None else 1000 * down,
        "max_sm_mhz": N.nvmlDeviceGetMaxClockInfo(h, N.NVML_CLOCK_SM),
        "reasons_idle": sorted({r for t, c, r in out["clock"] if t < t_warm}),
        "reasons_busy": sorted({r for t, c, r in out["clock"] if t_warm + 0.1 <= t < t_stop}),
        "series": out["clock"],
    }


def timing(h: object) -> dict[str, object]:
    a = torch.randn(3072, 3072, device="cuda", dtype=torch.float16)
    o = torch.empty_like(a)
    w = torch.randn(2048, 2048, device="cuda", dtype=torch.float16)
    wo = torch.empty_like(w)

    def time_it(reps: int = 200) -> list[float]:
        evs = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)
        ]
        for s, e in evs:
            s.record()
            torch.matmul(a, a, out=o)
            e.record()
        torch.cuda.synchronize()
        return [s.elapsed_time(e) for s, e in evs]

    def warm(ms: float) -> None:
        end = time.perf_counter() + ms / 1000
        while time.perf_counter() < end:
            for _ in range(4):
                torch.matmul(w, w, out=wo)
            torch.cuda.synchronize()

    warm(500)
    ref = statistics.median(time_it(400))
    rows = []
    for idle_ms in (0, 50, 200, 1000, 3000):
        for rep in range(3):
            warm(300)
            time.sleep(idle_ms / 1000)
            mhz = N.nvmlDeviceGetClockInfo(h, N.NVML_CLOCK_SM)
            xs = time_it()
            first = xs[:20]
            rows.append(
                {
                    "idle_ms": idle_ms,
                    "rep": rep,
                    "sm_mhz_before": mhz,
                    "median_vs_warm_pct": 100 * (statistics.median(xs) / ref - 1),
                    "first20_median_vs_warm_pct": 100 * (statistics.median(first) / ref - 1),
                }
            )
    return {"warm_median_ms": ref, "rows": rows}


def main() -> int:
    ap = argparse.ArgumentParser(
        prog=module_prog(__spec__),
    )
    ap.add_argument("--out")
    args = ap.parse_args()
    N.nvmlInit()
    h = N.nvmlDeviceGetHandleByIndex(0)
    torch.ones(1, device="cuda")
    res: dict[str, Any] = {"drain": drain(h), "clocks": clocks(h), "timing": timing(h)}
    d = res["drain"]
    print({k: v for k, v in d.items() if k != "series"})
    c = res["clocks"]
    print({k: v for k, v in c.items() if k != "series"})
    for r in res["timing"]["rows"]:
        print(r)
    if args.out:
        write_json(args.out, res, indent=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
