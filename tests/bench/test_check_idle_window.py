"""bench.gpu.check_idle_window on a machine without a GPU: its verdict counting, and the whole check
(owner, busy and draining neighbours, JSON) run end to end with a stand-in torch."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from bench.gpu.check_idle_window import summarise, verdict

from .conftest import with_stand_in_torch


def test_wrong_passes_are_counted_per_window() -> None:
    rows = [
        {"phase": "alone", "window_ms": 5, "verdict": "idle-verified", "took_s": 0.005},
        {"phase": "alone", "window_ms": 5, "verdict": "idle-verified", "took_s": 0.007},
        {"phase": "busy", "kernel": "short", "window_ms": 5, "verdict": "timeout"},
        {"phase": "busy", "kernel": "long", "window_ms": 5, "verdict": "idle-verified"},  # wrong
        {
            "phase": "drain",
            "window_ms": 5,
            "verdict": "idle-verified",
            "passed_at": 10.05,
            "dry_at": 10.1,
        },  # early
        {"phase": "drain", "window_ms": 5, "verdict": "idle-verified", "passed_at": 20.12, "dry_at": 20.1},
        {"phase": "busy", "kernel": "long", "window_ms": 20, "verdict": "timeout"},
        {"phase": "drain", "window_ms": 20, "verdict": "timeout", "passed_at": 1.0, "dry_at": 2.0},  # no pass
    ]
    s = summarise(rows)
    five, twenty = s["5"], s["20"]
    assert five["wrong"] == 2 and five["busy_long"] == [1, 1] and five["busy_short"] == [0, 1]
    assert five["drain_early"] == 1 and abs(five["drain_lag_ms"]["min"] + 50) < 1e-6
    assert abs(five["alone_ms"]["p50"] - 6.0) < 1e-9 and abs(five["alone_ms"]["max"] - 7.0) < 1e-9
    assert twenty["wrong"] == 0 and twenty["drain_early"] == 0
    assert "drain_lag_ms" not in twenty  # the timed-out check says nothing of the lag
    assert (verdict(five), verdict(twenty)) == ("FAIL", "INVALID")  # 20: never verified alone
    timed_nothing = summarise(
        [
            {"phase": "alone", "window_ms": 3, "verdict": "idle-verified", "took_s": 0.003},
            {"phase": "busy", "kernel": "short", "window_ms": 3, "verdict": "unverified"},
        ]
    )
    assert verdict(timed_nothing["3"]) == "INVALID"
    fine = summarise([{"phase": "alone", "window_ms": 3, "verdict": "idle-verified", "took_s": 0.003}])
    assert verdict(fine["3"]) == "PASS"


# The few torch calls the owner's check and the neighbour make, instant: only the GPU is missing.
FAKE_TORCH = """
import time
float16 = "f16"
class _T:
    pass
def randn(*a, **k): return _T()
def zeros(*a, **k): return _T()
def empty_like(t): return _T()
def matmul(a, b, out=None): time.sleep(0.00002)
class cuda:
    @staticmethod
    def synchronize(): pass
    @staticmethod
    def is_initialized(): return True
    @staticmethod
    def is_available(): return True
    class Event:
        def record(self): pass
        def synchronize(self): pass
"""


def test_the_whole_check_runs_with_a_stand_in_torch(tmp_path: Path) -> None:
    out = tmp_path / "out"
    args = ("--windows", "1,3", "--tries", "4", "--stream-ms", "30", "--out", str(out))
    r = with_stand_in_torch(tmp_path, FAKE_TORCH, "bench.gpu.check_idle_window", *args)
    data = json.loads((out / "check_idle_window.json").read_text())
    phases = [(x["phase"], x.get("kernel")) for x in data["rows"]]
    assert phases.count(("alone", None)) == 8 and phases.count(("drain", None)) == 8
    assert (
        phases.count(("busy", "tiny"))
        == phases.count(("busy", "short"))
        == phases.count(("busy", "long"))
        == 8
    )
    assert phases.count(("roundtrip", None)) == 200 and data["roundtrip_us"]["n"] == 200
    assert data["roundtrip_us"]["min"] <= data["roundtrip_us"]["p50"] <= data["roundtrip_us"]["max"]
    assert "the check's round trip alone: min" in r.stdout and "busy tiny" in r.stdout
    with gzip.open(out / "idle_streams.json.gz", "rt") as f:
        streams = json.load(f)["streams"]
    assert [s["phase"] for s in streams] == ["alone"] * 3 + ["busy"] * 6 + ["drain"] * 5
    assert all(len(s["t0_us"]) == len(s["dt_us"]) > 10 for s in streams)
    assert all(isinstance(s["dry_us"], float) for s in streams if s["phase"] == "drain")
    assert "recorded streams" in r.stdout and "drain early" in r.stdout
    # nothing runs on a stand-in GPU: every check passes at once, so every busy one is a wrong pass
    assert data["summary"]["1"]["wrong"] >= 8 and "FAIL: window 1 ms" in r.stdout
    bad = with_stand_in_torch(
        tmp_path, FAKE_TORCH, "bench.gpu.check_idle_window", "--windows", "0,x", check=False
    )
    assert bad.returncode == 2 and "--windows" in bad.stderr
    args = ("--windows", "1", "--tries", "1", "--bar-us", "40", "--stream-ms", "0", "--out", str(out))
    r = with_stand_in_torch(tmp_path, FAKE_TORCH, "bench.gpu.check_idle_window", *args)
    assert (
        "bar 40 us" in r.stdout
        and json.loads((out / "check_idle_window.json").read_text())["args"]["bar_us"] == 40
    )
    bad = with_stand_in_torch(
        tmp_path, FAKE_TORCH, "bench.gpu.check_idle_window", "--bar-us", "0", check=False
    )
    assert bad.returncode == 2 and "--bar-us" in bad.stderr
    bad = with_stand_in_torch(
        tmp_path, FAKE_TORCH, "bench.gpu.check_idle_window", "--stream-ms", "-1", check=False
    )
    assert bad.returncode == 2 and "--stream-ms" in bad.stderr
