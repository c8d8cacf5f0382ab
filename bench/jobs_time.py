"""Where a pass's job time went, and what a perfect warm pool could have made of it.

The sums of each phase over a pass's jobs, the time each job's command ran outside its phases
(interpreter start, adoption, exit, an exit held for another command's region), and the makespan
the same jobs would have had with every import removed: their commands' wall times replayed first
come first served, `width` at once, in submission order, as the gateway runs them. The replay of
the measured wall times is printed beside the measured makespan, so a reader sees whether that
model fits the run before trusting its bound.
"""

from __future__ import annotations

import heapq
from typing import Any

from bench.trace_format import PHASES


def fifo_makespan(durations: list[float], width: int) -> float:
    """The end of the last job when `durations` run in order, each on the first free of `width`
    slots (all free at 0)."""
    slots = [0.0] * max(1, width)
    end = 0.0
    for d in durations:
        start = heapq.heappop(slots)
        heapq.heappush(slots, start + d)
        end = max(end, start + d)
    return end


def time_budget(recs: list[dict[str, Any]], width: int) -> dict[str, Any]:
    """Phase sums, time outside the phases and the replayed makespans of one pass; {} where a job
    has no command wall time (a job that failed to start: nothing to replay)."""
    recs = sorted(recs, key=lambda r: float(r.get("submit_s") or 0.0))
    got = [(r.get("krex") or {}).get("wall_s") for r in recs]
    wall = [float(w) for w in got if isinstance(w, (int, float))]
    if not recs or len(wall) < len(recs):
        return {}
    phases = {ph: 0.0 for ph in PHASES}
    imports = []
    for r in recs:
        spent = [ln.get("phases_s") or {} for ln in r.get("lines") or []]
        for s in spent:
            for ph, x in s.items():
                phases[ph] = phases.get(ph, 0.0) + float(x)
        imports.append(sum(float(s.get("import", 0.0)) for s in spent))
    return {
        "phases_s": {ph: x for ph, x in phases.items() if x},
        "outside_s": sum(wall) - sum(phases.values()),
        "wall_s": sum(wall),
        "replayed_s": fifo_makespan(wall, width),
        "without_import_s": fifo_makespan([w - i for w, i in zip(wall, imports, strict=True)], width),
    }


def lines(variants: dict[str, dict[str, Any]], width: int) -> list[str]:
    """The report's section: one row of sums per pass, then the bound of each pass run without a
    pool (a pooled pass has no imports left to remove)."""
    budgets = {k: x["time"] for k, x in variants.items() if x.get("time")}
    if not budgets:
        return []
    out = [
        "where the jobs' time went (sums over the jobs, s) "
        + " ".join(f"{p:>8}" for p in (*PHASES, "outside", "wall")),
    ]
    for k, b in budgets.items():
        cells = [b["phases_s"].get(p) for p in PHASES] + [b["outside_s"], b["wall_s"]]
        out.append(f"{k:<48} " + " ".join(f"{x:8.1f}" if x is not None else f"{'-':>8}" for x in cells))
    out.append(
        f"(outside: a command's time outside its phases: interpreter start, adoption, exit. With every "
        f"import removed and nothing else changed, the same jobs replayed first come first served, "
        f"{width} at once (the command policy one at a time):)"
    )
    for k, b in budgets.items():
        x = variants[k]
        if x.get("pooled") or not x.get("makespan_s"):
            continue
        gain = x["makespan_s"] / b["without_import_s"] if b["without_import_s"] else None
        out.append(
            f"  {k}: makespan {x['makespan_s']:.1f} s measured, {b['replayed_s']:.1f} replayed, "
            f"{b['without_import_s']:.1f} without imports"
            + (f" ({gain:.2f}x its jobs/min with the imports gone)" if gain else "")
        )
    return out
