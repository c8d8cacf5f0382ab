"""What a replay's raw records mean: throughput, the trace's ideal ratio, timing inflation, region
enter latency and strays. Pure functions over the JSON-able records that replay.py collects, so the
numbers can be recomputed from a results file (`python -m bench.analysis results.json`).

Ideal ratio (bench/README.md derives it). With N agents at once, P cores and one device, a pass cannot
end before the device has done its serialised work, nor before the agents have done theirs:
    LB_command = max(C, W/N, L)          C: the commands' exclusive time, summed
    LB_region  = max(R, W/N, C/P, L)     R: the regions' serialised time (enter + held + exit), summed
where W = sum of think + command time, L = the longest session (think + commands). The ideal
region/command throughput ratio is LB_command / LB_region; the achieved fraction is the measured
ratio divided by it.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from bench.harness.output import module_prog, read_json
from bench.harness.stats import pct
from bench.trace_format import BUCKETS, METHODS, OTHER_BUCKET, bucket_of


def bound(C: float, R: float, W: float, L: float, n: int, cores: int) -> dict[str, float]:
    """The makespan lower bounds of the command and region policies, and their ratio."""
    lb_cmd = max(C, W / n, L)
    lb_reg = max(R, W / n, C / cores, L)
    return {
        "C_s": C,
        "R_s": R,
        "W_s": W,
        "L_s": L,
        "agents": n,
        "cores": cores,
        "lb_command_s": lb_cmd,
        "lb_region_s": lb_reg,
        "ratio": lb_cmd / lb_reg if lb_reg > 0 else 0.0,
    }


def trace_ideal(lines: list[dict[str, Any]], n: int, cores: int, think_scale: float) -> dict[str, float]:
    """The ideal ratio from the trace's own expected durations."""
    per: dict[str, float] = defaultdict(float)
    C = R = W = 0.0
    for c in lines:
        cmd = sum(p["expect_s"] for p in c["phases"].values())
        C += cmd
        R += c["phases"]["timing"]["expect_s"]
        W += cmd + c["think_s"] * think_scale
        per[c["session"]] += cmd + c["think_s"] * think_scale
    return bound(C, R, W, max(per.values(), default=0.0), min(n, len(per)) or 1, cores)


def exclusive_s(r: dict[str, Any]) -> float:
    """How long a command ran (start to end of its process, queueing for the device excluded)."""
    rep = r.get("report") or {}
    start, end = float(rep.get("started_at", 0.0)), float(rep.get("ended_at", 0.0))
    if start > 0 and end >= start:
        return end - start
    return max(0.0, float(r["client_s"]) - float(rep.get("queued_s", 0.0)))


def measured_ideal(
    passes: dict[str, Any], lines: list[dict[str, Any]], n: int, cores: int, think_scale: float
) -> dict[str, float] | None:
    """The ideal ratio from measurements: command-pass exclusive times and region-pass regions."""
    if "command" not in passes or "region" not in passes:
        return None
    think = {(c["session"], c["order"]): c["think_s"] * think_scale for c in lines}
    per: dict[str, float] = defaultdict(float)
    C = W = 0.0
    for r in passes["command"]["commands"]:
        own = exclusive_s(r)
        C += own
        t = think.get((r["session"], r["order"]), 0.0)
        W += own + t
        per[r["session"]] += own + t
    R = 0.0
    for r in passes["region"]["commands"]:
        for g in (r.get("report") or {}).get("regions", []):
            R += g.get("enter_s", 0.0) - g.get("wait_s", 0.0) + g.get("held_s", 0.0) + g.get("exit_s", 0.0)
    return bound(C, R, W, max(per.values(), default=0.0), min(n, len(per)) or 1, cores)


def baselines(isolated: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per kernel|method key: the median over repeats of the isolated median and p95, and the bucket."""
    by: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in isolated:
        by[r["key"]].append(r["timing"])
    out = {}
    for key, ts in by.items():
        med = pct([t["median_ms"] for t in ts], 0.5) or 0.0
        out[key] = {
            "median_ms": med,
            "p95_ms": pct([t["p95_ms"] for t in ts], 0.5) or 0.0,
            "repeats": len(ts),
            "bucket": bucket_of(med),
            "spread": (max(t["median_ms"] for t in ts) / min(t["median_ms"] for t in ts) - 1.0)
            if min(t["median_ms"] for t in ts) > 0
            else 0.0,
        }
    return out


def floor(isolated: list[dict[str, Any]], base: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The isolated repeats judged like commands: each repeat's median against the baseline, p50
    and p95 per bucket. What the baseline's own spread puts into a policy's inflation figure (a
    policy that changes nothing shows about this much)."""
    by: dict[str, list[float]] = defaultdict(list)
    for r in isolated:
        b = base.get(r["key"])
        if b and b["median_ms"] > 0:
            by[b["bucket"]].append(r["timing"]["median_ms"] / b["median_ms"] - 1.0)
    return {bk: {"n": len(v), "p50": pct(v, 0.5), "p95": pct(v, 0.95)} for bk, v in by.items()}


def inflation(p: dict[str, Any], base: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Inflation of each command's median (and p95) over the isolated one, summarised as p50 and p95
    across commands per bucket, and per bucket and timing method."""
    rows = []
    for r in p["commands"]:
        res = r.get("result")
        if not res or res["key"] not in base or base[res["key"]]["median_ms"] <= 0:
            continue
        b = base[res["key"]]
        rows.append(
            {
                "bucket": b["bucket"],
                "method": res["method"],
                "median": res["timing"]["median_ms"] / b["median_ms"] - 1.0,
                "p95": res["timing"]["p95_ms"] / b["p95_ms"] - 1.0 if b["p95_ms"] > 0 else None,
            }
        )

    def summ(sel: list[dict[str, Any]]) -> dict[str, Any]:
        med = [x["median"] for x in sel]
        tail = [x["p95"] for x in sel if x["p95"] is not None]
        return {
            "n": len(sel),
            "p50": pct(med, 0.5),
            "p95": pct(med, 0.95),
            "tail_p50": pct(tail, 0.5),
            "tail_p95": pct(tail, 0.95),
            "values": med,
        }

    out: dict[str, Any] = {"by_bucket": {}, "by_bucket_method": {}}
    for bk in (*BUCKETS, OTHER_BUCKET):
        sel = [x for x in rows if x["bucket"] == bk]
        if sel:
            out["by_bucket"][bk] = summ(sel)
        for m in METHODS:
            sm = [x for x in sel if x["method"] == m]
            if sm:
                out["by_bucket_method"][f"{bk}|{m}"] = summ(sm)
    return out


def regions(p: dict[str, Any]) -> dict[str, Any]:
    """Region enter latency and wait (p50, p99), strays and tainted regions of one pass."""
    enter, wait, strays, tainted, n = [], [], 0, 0, 0
    steps: dict[str, list[float]] = {k: [] for k in STEPS}
    drains: dict[str, int] = {}
    for r in p["commands"]:
        for g in (r.get("report") or {}).get("regions", []):
            n += 1
            enter.append(g.get("enter_s", 0.0))
            wait.append(g.get("wait_s", 0.0))
            strays += int(g.get("strays", 0))
            tainted += bool(g.get("tainted", False))
            for k in STEPS:
                steps[k].append(g.get(k, 0.0))
            d = g.get("drain", "not-needed")
            drains[d] = drains.get(d, 0) + 1
    return {
        "regions": n,
        "enter_p50_s": pct(enter, 0.5),
        "enter_p99_s": pct(enter, 0.99),
        "wait_p50_s": pct(wait, 0.5),
        "wait_p99_s": pct(wait, 0.99),
        "strays": strays,
        "tainted": tainted,
        "drains": drains,
        # what a region's entry and exit cost, step by step (medians and sums, seconds)
        "steps_p50_s": {k: pct(v, 0.5) for k, v in steps.items()},
        "steps_total_s": {k: sum(v) for k, v in steps.items()},
    }


def padded(p: dict[str, Any]) -> float:
    """Seconds of host work the pass's commands added to reach the trace's phase costs (CPU
    seconds under `replay.py --pace trace`, wall-clock seconds under `--pace wall`): how much less
    than the trace the real work cost."""
    return sum(sum(((r.get("result") or {}).get("padded_s") or {}).values()) for r in p["commands"])


STEPS = ("quiesce_s", "freeze_s", "cores_s", "settle_s", "drain_s", "warm_s", "held_s", "exit_s")


def summarise(data: dict[str, Any], lines: list[dict[str, Any]]) -> dict[str, Any]:
    """The `summary` object of a results file, from its raw passes."""
    cfg, passes = data["config"], data["passes"]
    iso = [*data.get("isolated", {}).get("results", []), *data.get("isolated_after", {}).get("results", [])]
    base = baselines(iso)
    per: dict[str, Any] = {}
    for name, p in passes.items():
        ok = sum(1 for r in p["commands"] if r.get("ok"))
        per[name] = {
            "commands": len(p["commands"]),
            "ok": ok,
            "failed": len(p["commands"]) - ok,
            "makespan_s": p["makespan_s"],
            "commands_per_hour": ok / p["makespan_s"] * 3600.0 if p["makespan_s"] > 0 else 0.0,
            "inflation": inflation(p, base),
            "regions": regions(p),
            "padded_s": padded(p),
        }
    cph = {k: v["commands_per_hour"] for k, v in per.items()}
    ratios = {
        f"{a}/command": cph[a] / cph["command"]
        for a in ("region", "shared")
        if a in cph and cph.get("command")
    }
    ideal_t = trace_ideal(lines, cfg["concurrency"], cfg["cores"], cfg["think_scale"])
    ideal_m = measured_ideal(passes, lines, cfg["concurrency"], cfg["cores"], cfg["think_scale"])
    ach = {}
    if "region/command" in ratios:
        ach = {
            "of_trace_ideal": ratios["region/command"] / ideal_t["ratio"] if ideal_t["ratio"] else None,
            "of_measured_ideal": (
                ratios["region/command"] / ideal_m["ratio"] if ideal_m and ideal_m["ratio"] else None
            ),
        }
    if "region" in cph and cph.get("shared"):
        ach["region_of_shared"] = cph["region"] / cph["shared"]
    return {
        "policies": per,
        "ratios": ratios,
        "ideal_trace": ideal_t,
        "ideal_measured": ideal_m,
        "achieved": ach,
        "baselines": base,
        "isolated_floor": floor(iso, base),
    }


def _f(v: float | None, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def table(s: dict[str, Any]) -> str:
    """The human-readable report of a summary."""
    out = [
        f"{'policy':<8} {'cmds':>5} {'fail':>4} {'makespan_s':>10} {'cmds/h':>9} "
        f"{'enter_p50_ms':>12} {'enter_p99_ms':>12} {'strays':>6} {'paced_s':>8}"
    ]
    for name, p in s["policies"].items():
        g = p["regions"]
        ms = lambda v: None if v is None else v * 1000.0  # noqa: E731
        out.append(
            f"{name:<8} {p['commands']:>5} {p['failed']:>4} {p['makespan_s']:>10.1f} "
            f"{p['commands_per_hour']:>9.1f} {_f(ms(g['enter_p50_s']), '12.2f')} "
            f"{_f(ms(g['enter_p99_s']), '12.2f')} {g['strays']:>6} "
            f"{p.get('padded_s', 0.0):>8.1f}"
        )
    out.append("")
    for k, v in s["ratios"].items():
        out.append(f"throughput {k}: {v:.2f}x")
    it, im = s["ideal_trace"], s["ideal_measured"]
    out.append(
        f"ideal region/command (trace): {it['ratio']:.2f}x  (C={it['C_s']:.1f}s R={it['R_s']:.1f}s "
        f"W/N={it['W_s'] / it['agents']:.1f}s L={it['L_s']:.1f}s P={it['cores']})"
    )
    if im:
        out.append(
            f"ideal region/command (measured): {im['ratio']:.2f}x  (C={im['C_s']:.1f}s "
            f"R={im['R_s']:.1f}s W/N={im['W_s'] / im['agents']:.1f}s L={im['L_s']:.1f}s)"
        )
    for k, v in s["achieved"].items():
        out.append(f"achieved {k}: {_f(v, '.1%')}")
    out.append("")
    for name, p in s["policies"].items():
        g = p["regions"]
        if g["regions"] and "steps_p50_s" in g:
            steps = "  ".join(
                f"{k[:-2]} {_f(v * 1000.0 if v is not None else None, '.1f')}"
                for k, v in g["steps_p50_s"].items()
            )
            out.append(f"{name} region steps, median ms: {steps}  drains {g['drains']}")
    out.append("")
    out.append(f"{'inflation vs isolated':<28} {'n':>4} {'p50':>8} {'p95':>8}   (median of each command)")
    for name, p in s["policies"].items():
        for key, v in {**p["inflation"]["by_bucket"], **p["inflation"]["by_bucket_method"]}.items():
            out.append(f"{name + ' ' + key:<28} {v['n']:>4} {_f(v['p50'], '8.2%')} {_f(v['p95'], '8.2%')}")
    for key, v in s.get("isolated_floor", {}).items():
        out.append(
            f"{'isolated repeats ' + key:<28} {v['n']:>4} {_f(v['p50'], '8.2%')} "
            f"{_f(v['p95'], '8.2%')}   (the baseline's own spread)"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(
        prog=module_prog(__spec__),
        description="the tables of a replay results file (bench/replay.py "
        "--out): throughput, ideal ratio, region steps, timing "
        "inflation",
    )
    ap.add_argument("results", type=Path, help="a results JSON, e.g. bench/results/quick.json")
    a = ap.parse_args(argv)
    try:
        data = read_json(a.results)
        summary = data["summary"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        ap.error(f"{a.results}: not a replay results file ({type(e).__name__}: {e})")
    print(table(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
