"""parse_ncu on the CSV ncu writes for a deep profile (`--set full`): rule columns in the header,
metric rows that stop after Metric Value, display names, and two metrics of the same name.

The layout is the one ncu 2025 (CUDA 13, driver 580) wrote on an H100 for a torch multiply
(bench/RESULTS.md, session 16); the rows below are written here, the values made up."""

from __future__ import annotations

import pytest

from krex_async.gateway.profile import parse_ncu

KERNEL = "void vectorized_elementwise_kernel<4, MulFunctor<float>>(int, T2, T3)"
HEAD = (
    '"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size",'
    '"Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value",'
    '"Rule Name","Rule Type","Rule Description","Estimated Speedup Type","Estimated Speedup"'
)


def metric(launch: int, section: str, name: str, unit: str, value: str) -> str:
    return (
        f'"{launch}","77","python3","127.0.0.1","{KERNEL}","1","7","(128, 1, 1)","(1024, 1, 1)","0",'
        f'"9.0","{section}","{name}","{unit}","{value}",'
    )


def rule(launch: int, name: str, said: str, speedup: str) -> str:
    return (
        f'"{launch}","77","python3","127.0.0.1","{KERNEL}","1","7","(128, 1, 1)","(1024, 1, 1)","0",'
        f'"9.0","SpeedOfLight","","","","{name}","OPT","{said}","global","{speedup}"'
    )


def deep_csv() -> str:
    rows = [
        "==PROF== Connected to process 77 (/usr/bin/python3)",
        "==WARNING== Unable to access 6 metrics",
        HEAD,
    ]
    for launch, ns in ((0, "6,144"), (1, "6,272")):
        sol = "GPU Speed Of Light Throughput"
        rows += [
            metric(launch, sol, "Duration", "ns", ns),
            metric(launch, sol, "Compute (SM) Throughput", "%", "4.1"),
            metric(launch, sol, "Memory Throughput", "%", "40.5"),
            metric(launch, sol, "DRAM Throughput", "%", "40.5"),
            metric(launch, "Memory Workload Analysis", "Memory Throughput", "byte/s", "673,794,850,124.46"),
            metric(launch, "Occupancy", "Achieved Occupancy", "%", "32.6"),
            rule(launch, "SOLBottleneck", "This kernel grid is too small to fill the device.", "50"),
        ]
    return "\n".join([*rows, "==PROF== Disconnected from process 77", ""])


def test_a_deep_profile_csv_gives_its_kernel_with_sol_numbers_diagnostics_and_rules() -> None:
    r = parse_ncu(deep_csv(), "deep", 5)
    assert "note" not in r and len(r["kernels"]) == 1, r
    k = r["kernels"][0]
    assert k["name"] == KERNEL and k["duration"] == pytest.approx(6144 + 6272)  # both launches
    assert (k["compute_sol_pct"], k["mem_sol_pct"], k["dram_pct"]) == pytest.approx((4.1, 40.5, 40.5))
    assert k["occupancy_pct"] == pytest.approx(32.6) and k["bound"] == "memory"
    assert k["metrics"]["Memory Throughput [byte/s]"] == pytest.approx(673794850124.46)
    assert "Duration" not in k["diagnostics"] and k["diagnostics"]["Achieved Occupancy"] == "32.6"
    assert k["rules"] == [
        {
            "name": "SOLBottleneck",
            "type": "OPT",
            "description": "This kernel grid is too small to fill the device.",
            "estimated_speedup": 50.0,
            "estimated_speedup_type": "global",
        }
    ]


def test_a_log_without_the_csv_header_says_no_kernels() -> None:
    r = parse_ncu("==PROF== Connected to process 77\n==ERROR== no kernels were profiled\n", "deep", 5)
    assert r["kernels"] == [] and r["note"] == "no kernels captured by ncu"
