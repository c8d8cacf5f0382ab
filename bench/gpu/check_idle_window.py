"""How short can the drain check's idle window be and still catch another process's GPU work?

    python3 -m bench.gpu.check_idle_window [--windows 2,3,5,10,20] [--tries 20] [--bar-us 250] [--out DIR]

A region's owner verifies, before its timed loop, that no held sibling still has work queued on the
GPU (runtime/devicework.idle_verify): it times round trips of a tiny kernel until they all stayed
under 250 us for a window (`--drain-window`, 20 ms by default). While another context has work the
GPU time-slices between them, and some round trips wait out the other's slice (2.5 ms on the H200,
bench/RESULTS.md, "Run 3"); the window must be long enough that one always does. On session 12's
real jobs that window was 20 of the 24 ms a region entry took (less its waits), so issue 22's entry
goal (p99 <= 5 ms) hangs on it. For each window this measures, with no krex involved:

- alone: how long the check takes to pass on an idle GPU (it should take the window);
- roundtrip: the check's own round trip alone, 50 x tries of them (min, p50, p99, max us);
- busy: a neighbour process launching matmuls back to back (tiny ~0.03, short ~0.2, long ~5 ms,
  a few queued at a time): how often the check wrongly passes (`idle-verified`) within a budget of
  five windows (at least 0.1 s). Must be 0 for a window to be usable;
- drain: the neighbour queues ~100 ms of work and stops launching (as a locked sibling does), and
  records when its queue ran dry; the check starts at once: how often it passed before the queue
  ran dry (early: must be 0), and how long after it passed (of the checks that passed).

It also records raw streams of the check's round trips (`--stream-ms` each: 3 alone, 2 beside each
busy neighbour, 5 while a backlog drains) into $OUT/idle_streams.json.gz, and prints them replayed
through the check's rule at this run's bar: the live table's figures again, from many more starting
points. `python3 -m bench.gpu.idle_streams FILE` replays them at other bars and windows, no GPU.

Writes $OUT/check_idle_window.json (OUT defaults to /tmp/krex-check-idle-window); prints a table and
one PASS/FAIL/INVALID line per window (FAIL: a wrong pass; INVALID: a check timed nothing, or
none passed alone). Needs one NVIDIA GPU with torch; no daemon, no
root. Exit status 0 when everything was measured (whatever the verdicts), 1 otherwise.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.gpu.idle_streams import Stream, floats, record, table
from bench.harness.output import module_prog, write_json
from bench.harness.stats import quantile

# The neighbour: `busy N STOP` launches N x N fp16 matmuls back to back, at most 4 queued, until the
# STOP file appears; `drain N MS`, for each line it reads, queues about MS ms of them and prints the
# host time (monotonic) at which its queue ran dry. It prints "ready" once warm, and its kernel's time.
NEIGHBOUR = r"""
import os, sys, time, torch
mode, n = sys.argv[1], int(sys.argv[2])
a = torch.randn(n, n, device="cuda", dtype=torch.float16)
b = torch.empty_like(a)
for _ in range(5):
    torch.matmul(a, a, out=b)
torch.cuda.synchronize()
t0 = time.perf_counter()
for _ in range(20):
    torch.matmul(a, a, out=b)
torch.cuda.synchronize()
per_ms = (time.perf_counter() - t0) / 20 * 1e3
print("ready", per_ms, flush=True)
if mode == "busy":
    stop, done = sys.argv[3], []
    while not os.path.exists(stop):
        torch.matmul(a, a, out=b)
        e = torch.cuda.Event()
        e.record()
        done.append(e)
        if len(done) > 4:
            done.pop(0).synchronize()
    torch.cuda.synchronize()
else:
    for _ in sys.stdin:  # one backlog per line read
        for _ in range(max(1, int(float(sys.argv[3]) / per_ms))):
            torch.matmul(a, a, out=b)
        print("queued", time.monotonic(), flush=True)
        torch.cuda.synchronize()
        print("dry", time.monotonic(), flush=True)
"""

KERNELS = {"tiny": 2048, "short": 4096, "long": 12288}  # fp16 matmuls: ~0.03, ~0.2 and ~5 ms (H100)


def summarise(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per window (ms): the alone check's time (p50, max), wrong passes beside each busy neighbour
    (passed of tried), the drain runs' early passes and lag after the queue ran dry (ms, passes
    only), and `unverified`: checks that could not time anything (no kernel ran: the tiny kernel
    failed), which make the window's verdict INVALID rather than a pass."""
    out: dict[str, dict[str, Any]] = {}
    for r in rows:
        if r["phase"] == "roundtrip":
            continue
        w = out.setdefault(f"{r['window_ms']:g}", {"wrong": 0, "unverified": 0})
        w["unverified"] += r["verdict"] == "unverified"
        if r["phase"] == "alone":
            w.setdefault("alone_s", []).append(r["took_s"])
            w["alone_idle"] = w.get("alone_idle", 0) + (r["verdict"] == "idle-verified")
        elif r["phase"] == "busy":
            k = w.setdefault(f"busy_{r['kernel']}", [0, 0])
            k[0] += r["verdict"] == "idle-verified"
            k[1] += 1
            w["wrong"] += r["verdict"] == "idle-verified"
        elif r["phase"] == "drain":
            early = r["verdict"] == "idle-verified" and r["passed_at"] < r["dry_at"]
            w["drain_early"] = w.get("drain_early", 0) + early
            w["wrong"] += early
            if r["verdict"] == "idle-verified":  # a timeout's 2 s says nothing of the lag
                w.setdefault("drain_lag_ms", []).append((r["passed_at"] - r["dry_at"]) * 1e3)
    for w in out.values():
        if "alone_s" in w:
            xs = w.pop("alone_s")
            w["alone_ms"] = {"p50": statistics.median(xs) * 1e3, "max": max(xs) * 1e3, "n": len(xs)}
        if "drain_lag_ms" in w:
            xs = w.pop("drain_lag_ms")
            w["drain_lag_ms"] = {"p50": statistics.median(xs), "min": min(xs), "n": len(xs)}
    return out


def roundtrips(rows: list[dict[str, Any]]) -> dict[str, float]:
    """The check's own round trip alone, us (min, p50, p99, max, n): a bar below its tail would
    never pass an idle device; one above a neighbour's kernel time cannot see that neighbour."""
    trips = [float(r["us"]) for r in rows if r["phase"] == "roundtrip"]
    if not trips:
        return {}
    return {
        "min": min(trips),
        "p50": quantile(trips, 0.5),
        "p99": quantile(trips, 0.99),
        "max": max(trips),
        "n": len(trips),
    }


def verdict(x: dict[str, Any]) -> str:
    """FAIL on any wrong pass; INVALID when a check could not time anything or the check never
    passed alone (nothing was shown about the window); PASS otherwise."""
    if x["wrong"]:
        return "FAIL"
    return "INVALID" if x["unverified"] or not x.get("alone_idle") else "PASS"


def _neighbour(py: str, script: Path, *args: str) -> tuple[subprocess.Popen[str], float]:
    p = subprocess.Popen([py, str(script), *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None
    line = p.stdout.readline().split()
    if not line or line[0] != "ready":
        p.kill()
        raise RuntimeError(f"the neighbour ({' '.join(args)}) did not start: {line}")
    return p, float(line[1])


def measure(
    py: str, windows: list[float], tries: int, tmp: Path, bar_s: float, stream_s: float, streams: list[Stream]
) -> list[dict[str, Any]]:
    """The live checks' rows; the raw round-trip streams (stream_s each, none at 0) go to `streams`."""
    import torch  # the owner: a context of its own, as a region owner has

    from krex_async.runtime import devicework

    torch.zeros(1, device="cuda")
    devicework.ready_probe()
    script = tmp / "neighbour.py"
    script.write_text(NEIGHBOUR)
    rows: list[dict[str, Any]] = []
    probe = devicework._tiny_kernel()  # the check's own round trip alone: what a bar must clear
    if probe is not None:
        for _ in range(50 * tries):
            t0 = time.perf_counter()
            probe[1]()
            rows.append({"phase": "roundtrip", "us": (time.perf_counter() - t0) * 1e6})
        if stream_s > 0:
            streams.extend(record(probe[1], stream_s, phase="alone", kernel=None) for _ in range(3))
    for w in windows:
        for _ in range(tries):
            verdict, took = devicework.idle_verify(0.5, window_s=w / 1e3, bar_s=bar_s)
            rows.append({"phase": "alone", "window_ms": w, "verdict": verdict, "took_s": took})
    for kernel, n in KERNELS.items():
        stop = tmp / f"stop-{kernel}"
        p, per_ms = _neighbour(py, script, "busy", str(n), str(stop))
        time.sleep(0.3)
        try:
            for w in windows:
                for _ in range(tries):
                    verdict, took = devicework.idle_verify(
                        max(0.1, 5 * w / 1e3), window_s=w / 1e3, bar_s=bar_s
                    )
                    rows.append(
                        {
                            "phase": "busy",
                            "kernel": kernel,
                            "kernel_ms": per_ms,
                            "window_ms": w,
                            "verdict": verdict,
                        }
                    )
            if probe is not None and stream_s > 0:
                for _ in range(2):
                    streams.append(record(probe[1], stream_s, phase="busy", kernel=kernel, kernel_ms=per_ms))
        finally:
            stop.write_text("")
            p.wait(30)
    p, _ = _neighbour(py, script, "drain", str(KERNELS["long"]), "100")
    assert p.stdout is not None and p.stdin is not None
    try:
        for w in windows:
            for _ in range(tries):
                p.stdin.write("go\n")
                p.stdin.flush()
                p.stdout.readline()  # queued
                verdict, _ = devicework.idle_verify(2.0, window_s=w / 1e3, bar_s=bar_s)
                passed_at = time.monotonic()
                dry_at = float(p.stdout.readline().split()[1])
                rows.append(
                    {
                        "phase": "drain",
                        "window_ms": w,
                        "verdict": verdict,
                        "passed_at": passed_at,
                        "dry_at": dry_at,
                    }
                )
        for _ in range(5 if probe is not None and stream_s > 0 else 0):
            p.stdin.write("go\n")
            p.stdin.flush()
            p.stdout.readline()  # queued: the stream starts as the check would
            assert probe is not None
            s = record(probe[1], stream_s, phase="drain", kernel=None)
            s["dry_us"] = (float(p.stdout.readline().split()[1]) - s["start_s"]) * 1e6
            streams.append(s)
    finally:
        p.stdin.close()
        p.wait(30)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(prog=module_prog(__spec__), description=__doc__.split("\n")[0])
    ap.add_argument("--windows", default="2,3,5,10,20", help="idle windows to try, ms (comma-separated)")
    ap.add_argument("--tries", type=int, default=20, help="checks per window and condition")
    ap.add_argument(
        "--bar-us",
        type=float,
        default=250.0,
        help="the round trip under which the device counts as idle, us (idle_verify's bar_s; "
        "a neighbour's kernel shorter than it delays a round trip too little to be seen)",
    )
    ap.add_argument(
        "--stream-ms",
        type=float,
        default=300.0,
        help="length of each recorded round-trip stream, ms (0: record none)",
    )
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/krex-check-idle-window"))
    a = ap.parse_args()
    windows = floats(a.windows, "--windows", ap)
    if a.tries < 1 or not 0 < a.bar_us <= 1000 or not 0 <= a.stream_ms <= 10_000:
        ap.error("--tries must be at least 1, --bar-us in (0, 1000], --stream-ms in [0, 10000]")
    tmp = Path(tempfile.mkdtemp(prefix="krex-check-idle-window-"))
    streams: list[Stream] = []
    try:
        rows = measure(a.python, windows, a.tries, tmp, a.bar_us / 1e6, a.stream_ms / 1e3, streams)
    except (RuntimeError, ImportError) as e:
        print(f"FAIL: {e}")
        return 1
    s, trip = summarise(rows), roundtrips(rows)
    print(
        f"bar {a.bar_us:g} us; the check's round trip alone: "
        + ", ".join(f"{k} {v:.1f}" for k, v in trip.items() if k != "n")
        + f" us (n={trip.get('n', 0):g})"
    )
    print(
        f"{'window ms':>9} {'alone p50/max ms':>17} "
        + " ".join(f"{'busy ' + k:>10}" for k in KERNELS)
        + f" {'drain early':>11} {'lag p50 ms':>10}"
    )
    for w, x in s.items():
        al, lag = x.get("alone_ms", {}), x.get("drain_lag_ms", {})
        busy = " ".join(f"{'{}/{}'.format(*x.get('busy_' + k, [0, 0])):>10}" for k in KERNELS)
        print(
            f"{w:>9} {al.get('p50', 0):>8.1f}/{al.get('max', 0):<8.1f} {busy} "
            f"{x.get('drain_early', 0):>11} {lag.get('p50', 0):>10.1f}"
        )
    for w, x in s.items():
        print(f"{verdict(x)}: window {w} ms: {x['wrong']} wrong passes, {x['unverified']} unverified")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if streams:
        print(f"the same bar on {len(streams)} recorded streams (python3 -m bench.gpu.idle_streams):")
        print("\n".join(table(streams, [a.bar_us], windows, 20.0)))
        with gzip.open(out / "idle_streams.json.gz", "wt") as f:
            json.dump({"streams": streams, "args": vars(a)}, f)
    write_json(
        out / "check_idle_window.json", {"rows": rows, "summary": s, "roundtrip_us": trip, "args": vars(a)}
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
