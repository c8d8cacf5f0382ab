"""Where a steady round's agent time went, and how full its jobs kept the device's memory.

Each agent is busy from a job's submission to its end (it submits the next at once), so a round's
agent time is the sum of its jobs' latencies. It is split (from each job's result) into:

- **queued**: waiting in the daemon's queue before it started (`krex.queued_s`: for memory under
  admission, for the device under policy command);
- **phases**: the job's own work as the KernelBench job reports it (import, inputs, check, timing);
- **other**: the rest (the gateway, the command's start and exit, the interpreter's start).

Shown beside them, inside the phases: **gate**, the wait at the job's first CUDA use (in its import
phase) for memory or for a region to end (`krex.gate_s`, under --mem-gate), and the regions' wait
and entry (in its timing phase).

**Memory occupancy** is the sum over jobs of the most each was seen to hold (`krex.mem_peak`) times
the time from its first allocation (its inputs phase) to its end, over the device's memory times the
round's makespan. A job reaches its peak after its first allocation, so the figure runs high while
jobs allocate; near 100% the round could not have run more at once without waiting or running out
of memory. Rounds recorded before jobs carried `mem_peak` have none.
"""

from __future__ import annotations

from typing import Any

PARTS = ("queued", "phases", "other")
INSIDE = ("gate", "region")  # parts of the phases


def job_time(rec: dict[str, Any]) -> dict[str, float]:
    """One job's latency split into PARTS, its region wait and entry, and its memory-seconds."""
    k = rec.get("krex") or {}
    latency = max(0.0, rec.get("end_s", 0.0) - rec.get("submit_s", 0.0))
    phases = [line.get("phases_s") or {} for line in rec.get("lines") or []]
    work = sum(sum(p.values()) for p in phases)
    queued, gate = k.get("queued_s") or 0.0, k.get("gate_s") or 0.0
    held = sum(sum(v for name, v in p.items() if name != "import") for p in phases)
    region = sum((r.get("wait_s") or 0.0) + (r.get("enter_s") or 0.0) for r in rec.get("regions") or [])
    return {
        "latency": latency,
        "queued": queued,
        "gate": gate,
        "phases": work,
        "other": max(0.0, latency - queued - work),
        "region": region,
        "mem_s": (k.get("mem_peak") or 0) * held,
        "mem_seen": bool(k.get("mem_peak")),
    }


def round_time(rnd: dict[str, Any]) -> dict[str, Any]:
    """A round's jobs' time, summed, and its memory occupancy (None where no job's peak is known)."""
    jobs = [job_time(r) for r in rnd.get("jobs") or []]
    out: dict[str, Any] = {k: sum(j[k] for j in jobs) for k in ("latency", *PARTS, *INSIDE)}
    total = sum((rnd.get("memory_total") or {}).values())
    span = rnd.get("makespan_s") or 0.0
    seen = any(j["mem_seen"] for j in jobs)
    out["memory"] = sum(j["mem_s"] for j in jobs) / (total * span) if seen and total and span else None
    return out


def rows(rounds: list[dict[str, Any]]) -> list[list[Any]]:
    """Table rows: one per round, in seconds (and occupancy in %)."""
    out = []
    for rnd in rounds:
        if rnd.get("error"):
            continue
        t = round_time(rnd)
        lat = t["latency"] or 1.0
        out.append(
            [
                rnd.get("unit", "?"),
                t["latency"],
                *(f"{t[p]:.0f} ({t[p] / lat:.0%})" for p in PARTS),
                t["gate"],
                t["region"],
                "-" if t["memory"] is None else f"{t['memory']:.0%}",
            ]
        )
    return out


HEADER = ["round", "agent s", *(f"{p} s" for p in PARTS), "of which gate s", "region wait+entry s", "memory"]
