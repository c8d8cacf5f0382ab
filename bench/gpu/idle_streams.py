"""The drain check's round trips, recorded on the GPU and replayed through its rule offline.

    python3 -m bench.gpu.idle_streams STREAMS.json.gz [--bars-us 40,60,100,150,250]
                                      [--windows 2,3,5,10,20] [--step-ms 20]

bench.gpu.check_idle_window times the check live, one bar per run, 20 tries a window. It also
records raw streams of the check's round trips (`record`): alone, beside each busy neighbour, and
while a neighbour's queue drains. Replaying those streams through the check's own rule
(runtime/devicework.IdleWindow) from many starting points answers, with no GPU and no further
device time, what any bar and window would have decided: how long the check takes alone, how often
it passes a busy device (a wrong pass), and when it passes a draining one relative to the moment
the queue ran dry. This prints that table for a grid of bars and windows.

Each start is a try, as in the live check: alone and busy ones get max(0.1 s, 5 windows) of the
stream (busy: any pass is wrong), drain ones start with the stream (the check starts as the
neighbour's backlog is queued) and may run to its end.
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from bench.harness.output import module_prog
from krex_async.runtime.devicework import IdleWindow

Stream = dict[str, Any]  # phase, kernel, kernel_ms, t0_us, dt_us, dry_us


def record(run: Callable[[], object], seconds: float, **meta: Any) -> Stream:
    """Time `run` (one launch-and-wait of the check's kernel) back to back for `seconds`: each
    round trip's start and length, us from the stream's start (time.monotonic's origin kept in
    `start_s`, so a neighbour's monotonic timestamps can be placed on it)."""
    starts: list[float] = []
    lengths: list[float] = []
    start_s = time.monotonic()
    base = time.perf_counter()
    end = base + seconds
    t0 = base
    while t0 < end:
        t0 = time.perf_counter()
        run()
        t1 = time.perf_counter()
        starts.append(round((t0 - base) * 1e6, 2))
        lengths.append(round((t1 - t0) * 1e6, 2))
        t0 = t1
    return {**meta, "start_s": start_s, "t0_us": starts, "dt_us": lengths}


def first_pass(s: Stream, begin_us: float, end_us: float, rule: IdleWindow) -> float | None:
    """When (us from the stream's start) the rule, fed the stream's round trips that begin in
    [begin_us, end_us), first says drained; None if it never does."""
    for t0, dt in zip(s["t0_us"], s["dt_us"]):
        if t0 < begin_us:
            continue
        if t0 >= end_us:
            return None
        if rule.add(t0 / 1e6, dt / 1e6):
            return t0 + dt
    return None


def replay(
    streams: list[Stream], bar_us: float, window_ms: float, step_ms: float = 20.0, min_samples: int = 16
) -> dict[str, Any]:
    """One bar and window over every stream: alone (passed, tries, pass time p50/max ms), each busy
    kernel's wrong passes and tries, the drain tries' early passes and lag after the queue ran dry
    (p50 ms, passes only)."""
    budget_us = max(0.1, 5 * window_ms / 1e3) * 1e6

    def rule() -> IdleWindow:
        return IdleWindow(window_ms / 1e3, bar_us / 1e6, min_samples)

    out: dict[str, Any] = {"bar_us": bar_us, "window_ms": window_ms}
    alone: list[float | None] = []
    for s in streams:
        if s["phase"] == "drain":
            passed = first_pass(s, 0.0, float("inf"), rule())
            if s.get("dry_us") is None:
                continue
            d = out.setdefault("drain", {"early": 0, "tries": 0, "lag_ms": []})
            d["tries"] += 1
            if passed is not None:
                d["early"] += passed < s["dry_us"]
                d["lag_ms"].append((passed - s["dry_us"]) / 1e3)
            continue
        for begin in _starts(s, budget_us, step_ms * 1e3):
            passed = first_pass(s, begin, begin + budget_us, rule())
            if s["phase"] == "alone":
                alone.append(None if passed is None else (passed - begin) / 1e3)
            else:
                b = out.setdefault(f"busy_{s['kernel']}", [0, 0])
                b[0] += passed is not None
                b[1] += 1
    took = [x for x in alone if x is not None]
    out["alone"] = {
        "passed": len(took),
        "tries": len(alone),
        "p50_ms": statistics.median(took) if took else None,
        "max_ms": max(took) if took else None,
    }
    if "drain" in out:
        lags = out["drain"].pop("lag_ms")
        out["drain"]["lag_p50_ms"] = statistics.median(lags) if lags else None
    out["wrong"] = sum(v[0] for k, v in out.items() if k.startswith("busy_")) + out.get("drain", {}).get(
        "early", 0
    )
    return out


def _starts(s: Stream, budget_us: float, step_us: float) -> Iterable[float]:
    """Start points every step_us that leave a whole budget of stream after them (at least one)."""
    last = s["t0_us"][-1] if s["t0_us"] else 0.0
    n = max(1, int((last - budget_us) // step_us) + 1)
    return (i * step_us for i in range(n))


def table(streams: list[Stream], bars_us: list[float], windows_ms: list[float], step_ms: float) -> list[str]:
    """The replay's lines: one per bar and window."""
    kernels = sorted({s["kernel"] for s in streams if s["phase"] == "busy"})
    lines = [
        f"{'bar us':>6} {'window ms':>9} {'alone passed':>12} {'p50/max ms':>12} "
        + " ".join(f"{'busy ' + k:>10}" for k in kernels)
        + f" {'drain early':>11} {'lag p50 ms':>10}"
    ]
    for bar in bars_us:
        for w in windows_ms:
            r = replay(streams, bar, w, step_ms)
            al, dr = r["alone"], r.get("drain", {})
            busy = " ".join(f"{'{}/{}'.format(*r.get('busy_' + k, [0, 0])):>10}" for k in kernels)
            times = f"{_ms(al['p50_ms'])}/{_ms(al['max_ms'])}"
            lag = _ms(dr.get("lag_p50_ms"))
            early = f"{dr.get('early', 0)}/{dr.get('tries', 0)}"
            passed = f"{al['passed']}/{al['tries']}"
            lines.append(f"{bar:>6g} {w:>9g} {passed:>12} {times:>12} {busy} {early:>11} {lag:>10}")
    return lines


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def load(path: Path) -> list[Stream]:
    """The streams check_idle_window wrote (gzip JSON, {"streams": [...]})."""
    try:
        with gzip.open(path, "rt") as f:
            data = json.load(f)
    except (OSError, EOFError, ValueError) as e:
        raise ValueError(f"{path}: {e}") from None
    streams = data.get("streams") if isinstance(data, dict) else None
    if not isinstance(streams, list):
        raise ValueError(f"{path}: no 'streams' list")
    return streams


def floats(text: str, flag: str, ap: argparse.ArgumentParser) -> list[float]:
    """A comma-separated list of positive numbers for `flag`, or a usage error naming it."""
    try:
        xs = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        ap.error(f"{flag}: comma-separated positive numbers, not {text!r}")
    if not xs or min(xs) <= 0:
        ap.error(f"{flag}: comma-separated positive numbers, not {text!r}")
    return xs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=module_prog(__spec__), description=__doc__.split("\n")[0])
    ap.add_argument("streams", type=Path, help="idle_streams.json.gz written by check_idle_window")
    ap.add_argument("--bars-us", default="40,60,100,150,250", help="bars to replay, us (comma-separated)")
    ap.add_argument("--windows", default="2,3,5,10,20", help="windows to replay, ms (comma-separated)")
    ap.add_argument("--step-ms", type=float, default=20.0, help="distance between two tries' starts, ms")
    a = ap.parse_args(argv)
    bars, windows = floats(a.bars_us, "--bars-us", ap), floats(a.windows, "--windows", ap)
    if not a.step_ms > 0:
        ap.error(f"--step-ms must be positive, not {a.step_ms:g}")
    try:
        streams = load(a.streams)
    except ValueError as e:
        print(f"{module_prog(__spec__)}: {e}", file=sys.stderr)
        return 2
    print("\n".join(table(streams, bars, windows, a.step_ms)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
