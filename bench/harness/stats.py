"""Quantiles: the one implementation for every benchmark (and the job script, which gets this file
uploaded beside it). Standard library only.

The benchmarks recorded their results with three rank rules, kept so that a number recomputed today
is the number in bench/RESULTS.md:
- "linear": interpolation between order statistics (numpy's default; jobs_report, analysis).
- "rank": the order statistic at index int(q * n), always a measured value (the p95 of 8 regions is
  their slowest); most daemon-side latency figures.
- "round": the order statistic at index round(q * (n - 1)) (the agent command's and the job's own
  median and p95 of their samples; cgroup_freeze).
- "nearest": nearest rank as check_lock computes it, index round(q * n + 0.5) - 1 (Python's round:
  one above ceil(q * n) - 1 when q * n is an odd whole number).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

Method = Literal["linear", "rank", "round", "nearest"]


def quantile(xs: Iterable[float], q: float, method: Method = "linear") -> float:
    """The q-quantile (0..1) of xs by `method`. Raises ValueError for no data or q outside 0..1."""
    s = sorted(xs)
    if not s:
        raise ValueError("no data")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile {q} outside 0..1")
    n = len(s)
    if method == "linear":
        pos = q * (n - 1)
        lo = int(pos)
        hi = min(lo + 1, n - 1)
        return s[lo] + (s[hi] - s[lo]) * (pos - lo)
    if method == "rank":
        return s[min(n - 1, int(q * n))]
    if method == "round":
        return s[min(n - 1, max(0, int(round(q * (n - 1)))))]
    if method == "nearest":
        return s[min(n - 1, max(0, int(round(q * n + 0.5)) - 1))]
    raise ValueError(f"unknown quantile method {method!r}")


def pct(xs: Iterable[float], q: float, method: Method = "linear") -> float | None:
    """quantile(), or None for no data (a table prints it as '-')."""
    s = list(xs)
    return quantile(s, q, method) if s else None


def pct_or_nan(xs: Iterable[float], q: float, method: Method = "linear") -> float:
    """quantile(), or NaN for no data (for columns that are always numbers)."""
    v = pct(xs, q, method)
    return float("nan") if v is None else v
