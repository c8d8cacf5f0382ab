"""The drain check's rule (runtime/devicework.IdleWindow) and bench.gpu.idle_streams' offline replay,
on round-trip streams shaped like those session 16 measured on an H100: a neighbour whose kernels
are shorter than the bar is passed as idle, one with long kernels never is."""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path

from bench.gpu.idle_streams import main, replay
from krex_async.runtime.devicework import IdleWindow

from .conftest import run_script


def stream(phase: str, trip_us, ms: float = 300, kernel: str | None = None, dry_us: float | None = None):
    """Back-to-back round trips for `ms`: trip_us(t_us) gives each one's length."""
    t, t0s, dts = 0.0, [], []
    while t < ms * 1e3:
        dt = trip_us(t)
        t0s.append(t)
        dts.append(dt)
        t += dt + 2.0  # the loop's own time between two trips
    return {"phase": phase, "kernel": kernel, "t0_us": t0s, "dt_us": dts, "dry_us": dry_us}


def test_the_rule_passes_after_a_window_of_fast_trips_and_starts_over_at_a_slow_one() -> None:
    rule = IdleWindow(window_s=0.001, bar_s=250e-6, min_samples=4)
    t = 0.0
    for _ in range(30):  # 30 x 22 us: 0.66 ms, under the window
        assert not rule.add(t, 20e-6)
        t += 22e-6
    assert not rule.add(t, 400e-6)  # one trip that waited out another context's work
    t += 402e-6
    passed_at = None
    for _ in range(100):
        if rule.add(t, 20e-6):
            passed_at = t
            break
        t += 22e-6
    assert passed_at is not None and 0.001 - 22e-6 <= passed_at - (0.66e-3 + 402e-6) <= 0.001 + 22e-6


def test_replay_shows_what_the_h100_showed_and_what_a_lower_bar_catches() -> None:
    rng = random.Random(1)
    alone = [stream("alone", lambda t: 15 + rng.random() * 5) for _ in range(3)]
    # ~0.18 ms kernels queued back to back: each trip waits out part of one
    short = [stream("busy", lambda t: 15 + rng.random() * 180, kernel="short") for _ in range(2)]
    # 5 ms kernels: the GPU switches contexts every slice, and the trip in flight waits one out
    n = iter(range(10**9))
    long = [
        stream("busy", lambda t: 2500.0 if next(n) % 100 == 99 else 18.0, kernel="long") for _ in range(2)
    ]
    drain = [stream("drain", lambda t: 3000.0 if t < 100e3 else 16.0, dry_us=100e3) for _ in range(5)]
    streams = alone + short + long + drain
    at250, at60 = replay(streams, 250, 5), replay(streams, 60, 5)
    assert at250["alone"]["passed"] == at250["alone"]["tries"] > 0
    assert 5 <= at250["alone"]["p50_ms"] < 5.2
    assert at250["busy_short"][0] == at250["busy_short"][1] > 0  # every try a wrong pass
    assert at60["busy_short"][0] == 0 and at60["alone"]["passed"] == at60["alone"]["tries"]
    assert at250["busy_long"][0] == at60["busy_long"][0] == 0
    assert at250["drain"] == {"early": 0, "tries": 5, "lag_p50_ms": at250["drain"]["lag_p50_ms"]}
    # passed one window after the queue ran dry (and the trip waiting on its last kernel came back)
    assert 5 <= at250["drain"]["lag_p50_ms"] < 5 + 3 + 0.1
    assert at250["wrong"] == at250["busy_short"][0] and at60["wrong"] == 0


def test_the_cli_replays_a_file_and_refuses_bad_input(tmp_path: Path, capsys) -> None:
    path = tmp_path / "idle_streams.json.gz"
    rng = random.Random(2)
    streams = [
        stream("alone", lambda t: 15.0),
        stream("busy", lambda t: 15 + rng.random() * 180, kernel="short"),
    ]
    with gzip.open(path, "wt") as f:
        json.dump({"streams": streams}, f)
    assert main([str(path), "--bars-us", "60,250", "--windows", "5"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and "busy short" in lines[0]
    at60, at250 = lines[1].split(), lines[2].split()
    tries = at60[4].split("/")[1]
    assert at60[:2] == ["60", "5"] and at60[4] == f"0/{tries}" and int(tries) > 5  # the short kernels: seen
    assert at250[:2] == ["250", "5"] and at250[4] == f"{tries}/{tries}"  # not at 250
    bad = run_script("-m", "bench.gpu.idle_streams", str(path), "--bars-us", "x", check=False)
    assert bad.returncode == 2 and "--bars-us" in bad.stderr
    (tmp_path / "not.gz").write_text("{}")
    bad = run_script("-m", "bench.gpu.idle_streams", str(tmp_path / "not.gz"), check=False)
    assert bad.returncode == 2 and "not.gz" in bad.stderr and "Traceback" not in bad.stderr
