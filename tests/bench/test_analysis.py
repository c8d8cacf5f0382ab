"""The analysis formulas on hand-computed cases (pure functions over replay records)."""

from __future__ import annotations

import math

from bench import analysis
from bench.trace_format import bucket_of


def test_pct_interpolates() -> None:
    assert analysis.pct([], 0.5) is None
    assert analysis.pct([3.0, 1.0, 2.0], 0.5) == 2.0
    assert math.isclose(analysis.pct([0.0, 10.0], 0.95), 9.5)


def test_bound_picks_the_binding_constraint() -> None:
    # device-bound: 100 s of serialised commands, 10 s of regions, agents could do it in 20 s
    b = analysis.bound(C=100.0, R=10.0, W=400.0, L=15.0, n=20, cores=16)
    assert b["lb_command_s"] == 100.0 and b["lb_region_s"] == 20.0 and b["ratio"] == 5.0
    # few agents: think time binds both, no gain possible
    b = analysis.bound(C=100.0, R=10.0, W=518.0, L=50.0, n=1, cores=16)
    assert b["ratio"] == 1.0
    # cores bind the region policy
    b = analysis.bound(C=100.0, R=1.0, W=110.0, L=5.0, n=100, cores=2)
    assert b["lb_region_s"] == 50.0 and b["ratio"] == 2.0


def test_inflation_and_buckets_from_records() -> None:
    iso = [{"key": "k|do_bench", "timing": {"median_ms": m, "p95_ms": m * 1.1}} for m in (2.0, 2.0, 2.2)]
    base = analysis.baselines(iso)
    assert base["k|do_bench"]["median_ms"] == 2.0 and base["k|do_bench"]["bucket"] == "1-10ms"
    cmds = [
        {
            "result": {
                "key": "k|do_bench",
                "method": "do_bench",
                "timing": {"median_ms": 2.0 * (1 + f), "p95_ms": 2.2 * (1 + f)},
            }
        }
        for f in (0.0, 0.01, 0.02, 0.5)
    ]
    inf = analysis.inflation({"commands": cmds}, base)
    v = inf["by_bucket"]["1-10ms"]
    assert v["n"] == 4 and math.isclose(v["p50"], 0.015) and v["p95"] > 0.4
    assert inf["by_bucket_method"]["1-10ms|do_bench"]["n"] == 4
    assert bucket_of(10.5) == ">10ms" and bucket_of(0.5) == "0.1-1ms" and bucket_of(0.05) == "<0.1ms"


def test_regions_summary() -> None:
    p = {
        "commands": [
            {"report": {"regions": [{"enter_s": 0.001 * i, "wait_s": 0.0, "strays": i % 2}]}}
            for i in range(1, 101)
        ]
    }
    r = analysis.regions(p)
    assert r["regions"] == 100 and r["strays"] == 50
    assert math.isclose(r["enter_p50_s"], 0.0505) and r["enter_p99_s"] > 0.099
