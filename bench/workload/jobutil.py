"""Helpers the job script's modules share (bench/workload/job.py): regions, summaries, the host
timing protocol and output comparison. Standard library only (and bench_stats.py, uploaded
beside it)."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from typing import Any

# bench/harness/stats.py, uploaded beside the job as bench_stats.py (bench/jobs_sets.py)
from bench_stats import quantile

TRIAL_FLUSH_BYTES = 4 << 20  # the cpu protocol's stand-in for KernelBench's 256 MB L2 flush


def region(name: str) -> Any:
    """krex's region (a no-op with one warning outside krex), or nothing where krex is missing."""
    try:
        from krex_async import region as r
    except ImportError:
        return contextlib.nullcontext(None)
    return r(name)


def wrapped(fn: Any) -> bool:
    """True when KREX_AUTO_REGION=1 has made fn a region already."""
    return getattr(fn, "__krex_region__", None) is not None


def report_of(r: Any) -> dict[str, Any] | None:
    rep = getattr(r, "report", None)
    if rep is None:
        return None
    return {
        k: getattr(rep, k) for k in ("wait_s", "enter_s", "freeze_s", "drain", "frozen") if hasattr(rep, k)
    }


def summary(samples: list[float]) -> dict[str, Any]:
    return {
        "n": len(samples),
        "median_ms": quantile(samples, 0.5, "round"),
        "p95_ms": quantile(samples, 0.95, "round"),
        "min_ms": min(samples),
        "max_ms": max(samples),
        "samples_ms": [round(x, 6) for x in samples[:2000]],
    }


def host_protocol(fn: Callable[..., Any], args: list[Any], warmup: int, trials: int) -> list[float]:
    """The same protocol with the host clock (the cpu device): warm-ups, a cache-sized write before
    each trial, the first trial dropped."""
    for _ in range(warmup):
        fn(*args)
    flush = bytearray(TRIAL_FLUSH_BYTES)
    out = []
    for i in range(trials + 1):
        flush[:] = bytes(len(flush))
        t0 = time.perf_counter()
        fn(*args)
        if i:
            out.append((time.perf_counter() - t0) * 1e3)
    return out


def flat(x: Any) -> list[float]:
    if isinstance(x, (list, tuple)):
        return [v for e in x for v in flat(e)]
    if isinstance(x, dict):
        return [v for k in sorted(x) for v in flat(x[k])]
    return [float(x)]


def close(a: list[float], b: list[float]) -> tuple[bool, float]:
    err = max((abs(p - q) for p, q in zip(a, b)), default=0.0)
    ok = len(a) == len(b) and all(
        math.isfinite(p) and abs(p - q) <= 1e-2 + 1e-2 * abs(q) for p, q in zip(a, b)
    )
    return ok, err
