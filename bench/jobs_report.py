"""What a bench/jobs.py run means: throughput, phases, regions, pool, strays and timing inflation.

    python -m bench.jobs_report results/jobs.json [--plots]

Pure functions over the JSON jobs.py writes, so the table can be made again from a results file.
Inflation: each key's alone baseline is the median over the alone rounds of that round's median (and
p95); a job's inflation is its own median (p95) over the baseline's, minus one; per duration bucket
(of the alone median) the p50 of the median inflations and the p95 of the p95 inflations across jobs.
The alone spread beside it is what a policy that changes nothing would show: the p95 over keys of one
alone round's p95 against another's (every pair of rounds, both ways); "-" with fewer than two rounds.
Only lines whose correctness check passed make a baseline.
"""

from __future__ import annotations

import statistics
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from bench.harness.output import pyplot, read_json, results_stem
from bench.harness.stats import pct
from bench.jobs_time import lines as time_lines
from bench.jobs_time import time_budget
from bench.trace_format import BUCKETS, OTHER_BUCKET, PHASES, bucket_of
from krex_async.runtime.devicework import IDLE_WINDOW_S as DRAIN_WINDOW_S

# The issues' goals (21: throughput and timings, 22: entry, 23: the pool), KernelBench set, 8 at once.
GOAL_VS_SHARED = 0.95
GOAL_VS_COMMAND = 5.0
GOAL_POOL_VS_SHARED = 1.5  # once the warm pool serves the jobs
GOAL_P95 = {">10ms": 0.002, "1-10ms": 0.01, "0.1-1ms": 0.025}
GOAL_ENTRY_P99_MS = 5.0  # issue 22: region entry with 7 held siblings
QUIESCE_TIMEOUT_S = 0.02  # krex serve's default --quiesce-timeout


def lines_of(recs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [ln for r in recs for ln in r.get("lines", [])]


def alone_job_seconds(data: dict[str, Any]) -> float:
    """One job's seconds alone (its import plus its own phases), median over the alone rounds; 10 s
    before any round has run."""
    xs = [sum(ln["phases_s"].values()) for rnd in data["alone"] for ln in lines_of(rnd["jobs"])]
    return statistics.median(xs) if xs else 10.0


def alone_seconds_by_key(data: dict[str, Any]) -> dict[str, float]:
    """Each key's seconds alone as its own job would spend them (the round's import plus its own
    phases), median over the alone rounds."""
    by: dict[str, list[float]] = defaultdict(list)
    for rnd in data["alone"]:
        for ln in lines_of(rnd["jobs"]):
            by[ln["key"]].append(sum(ln["phases_s"].values()))
    return {k: statistics.median(v) for k, v in by.items()}


def alone_round_seconds(data: dict[str, Any]) -> float:
    xs = [max((r.get("end_s", 0.0) for r in rnd["jobs"]), default=0.0) for rnd in data["alone"]]
    return max(xs, default=60.0) + 5.0


def checked(ln: dict[str, Any]) -> bool:
    """Whether a line's kernel passed its correctness check (a line without one counts as passed)."""
    return bool((ln.get("check") or {}).get("ok", True))


def baselines(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per key, from the alone rounds' lines that passed their check (a failed record's other keys
    still count: a record is a batch of keys)."""
    by: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for rnd in data["alone"]:
        for ln in lines_of(rnd["jobs"]):
            if checked(ln) and ln.get("timing"):
                by[ln["key"]].append(ln["timing"])
    out = {}
    for key, ts in by.items():
        med = statistics.median(t["median_ms"] for t in ts)
        out[key] = {
            "median_ms": med,
            "p95_ms": statistics.median(t["p95_ms"] for t in ts),
            "rounds": len(ts),
            "bucket": bucket_of(med),
            "p95s_ms": [t["p95_ms"] for t in ts],
            "medians_ms": [t["median_ms"] for t in ts],
        }
    return out


def inflation(lines: list[dict[str, Any]], base: dict[str, dict[str, Any]]) -> dict[str, Any]:
    by: dict[str, dict[str, list[float]]] = defaultdict(lambda: {"median": [], "p95": []})
    for ln in lines:
        b = base.get(ln["key"])
        if not b or b["median_ms"] <= 0 or b["p95_ms"] <= 0:
            continue
        by[b["bucket"]]["median"].append(ln["timing"]["median_ms"] / b["median_ms"] - 1.0)
        by[b["bucket"]]["p95"].append(ln["timing"]["p95_ms"] / b["p95_ms"] - 1.0)
    return {
        bk: {
            "n": len(v["median"]),
            "p50": pct(v["median"], 0.5),
            "p95": pct(v["p95"], 0.95),
            "median_p95": pct(v["median"], 0.95),
        }
        for bk, v in by.items()
    }


def alone_spread(base: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per bucket, one alone round's p95 over another's, minus one, for every ordered pair of rounds
    of each key: the inflation a policy that changes nothing would show against one round. Keys
    with one round add nothing (n counts the pairs; none: p95 and max are None)."""
    by: dict[str, list[float]] = defaultdict(list)
    for b in base.values():
        ps = [p for p in b["p95s_ms"] if p > 0]
        by[b["bucket"]] += [a / c - 1.0 for i, a in enumerate(ps) for j, c in enumerate(ps) if i != j]
    return {bk: {"n": len(v), "p95": pct(v, 0.95), "max": max(v) if v else None} for bk, v in by.items()}


def quiesce_timeout(args: list[str]) -> float:
    """The variant's --quiesce-timeout (krex serve's default otherwise)."""
    for i, a in enumerate(args):
        try:
            if a == "--quiesce-timeout" and i + 1 < len(args):
                return float(args[i + 1])
            if a.startswith("--quiesce-timeout="):
                return float(a.split("=", 1)[1])
        except ValueError:
            pass
    return QUIESCE_TIMEOUT_S


def quiesce_outcome(r: dict[str, Any], timeout: float) -> str:
    """Derived from quiesce_s, as the report has no field for it yet (a report's own `quiesce`
    string wins): under 1 ms (nobody to wait for, or prompt acks), acked (all answered before the
    timeout) or timeout (the quiesce timeout ran out: someone did not answer)."""
    if isinstance(r.get("quiesce"), str):
        return str(r["quiesce"])
    q = float(r.get("quiesce_s", 0.0))
    return "<1ms" if q < 1e-3 else ("acked" if q < 0.9 * timeout else "timeout")


def entry_own_s(g: dict[str, Any]) -> float:
    """A region's entry less what it waited for rather than did: the earlier region (wait_s),
    exiting siblings (exits_wait_s), the longest wait for a sibling inside a CUDA call
    (lock_late's after_s), a pool worker's context creation (pool_wait_s) and held siblings' share
    of the device (share_wait_s)."""
    late = max([float(x.get("after_s", 0.0)) for x in g.get("lock_late") or []] or [0.0])
    waits = sum(float(g.get(k) or 0.0) for k in ("wait_s", "exits_wait_s", "pool_wait_s", "share_wait_s"))
    return max(0.0, float(g.get("enter_s", 0.0)) - waits - late)


def entry_owner_s(g: dict[str, Any]) -> float:
    """entry_own_s plus what the owner does before its timed loop: the drain check, up to its
    idle window (DRAIN_WINDOW_S; beyond it the check waited for a held sibling's queued work,
    another wait), and any clock warm-up. The region entry as the timing code sees it, less waits."""
    drain = min(float(g.get("drain_s") or 0.0), float(g.get("drain_window_s") or DRAIN_WINDOW_S))
    return entry_own_s(g) + drain + float(g.get("warm_s") or 0.0)


def drain_windows_ms(rs: list[dict[str, Any]]) -> str:
    """The drain check's windows (--drain-window) in the regions where the owner ran it, e.g. "20 ms"
    or "5/20 ms"; runs recorded before the window was (session 12 and earlier) had 20 ms."""
    ran = [g for g in rs if g.get("drain") in ("idle-verified", "timeout")]
    got = {float(g.get("drain_window_s") or DRAIN_WINDOW_S) for g in ran}
    return "/".join(f"{w * 1e3:g}" for w in sorted(got)) + " ms" if got else "none ran"


def regions(recs: list[dict[str, Any]], qtimeout: float = QUIESCE_TIMEOUT_S) -> dict[str, Any]:
    rs = [g for r in recs for g in r.get("regions", [])]
    if not rs:
        return {"n": 0}
    med = lambda k: pct([float(g.get(k, 0.0)) for g in rs], 0.5)  # noqa: E731
    extra: dict[str, Any] = {}
    for k in sorted({k for g in rs for k in g if "lock" in k or "hold" in k}):
        vals = [g[k] for g in rs if k in g]
        nums = [float(v) for v in vals if isinstance(v, (int, float)) and not isinstance(v, bool)]
        extra[k] = (
            {"p50": pct(nums, 0.5), "max": max(nums)}
            if len(nums) == len(vals)
            else dict(Counter(str(v) for v in vals))
        )
    who = Counter(w.split(", cmd ", 1)[-1][:80] for g in rs for w in g.get("stray_procs", {}).values())
    own, owner = [entry_own_s(g) for g in rs], [entry_owner_s(g) for g in rs]
    return {
        "n": len(rs),
        "names": dict(Counter(g.get("name", "") for g in rs)),
        "enter_p50_s": med("enter_s"),
        "enter_p95_s": pct([g.get("enter_s", 0.0) for g in rs], 0.95),
        "wait_p50_s": med("wait_s"),
        # the hold's own steps: issue 22's entry goal, apart from the waits that keep timings clean
        "entry_own_p50_s": pct(own, 0.5),
        "entry_own_p95_s": pct(own, 0.95),
        "entry_own_p99_s": pct(own, 0.99),
        "entry_own_max_s": max(own),
        # the same with the owner's drain check and warm-up: the entry its timing code sees
        "entry_owner_p50_s": pct(owner, 0.5),
        "entry_owner_p95_s": pct(owner, 0.95),
        "entry_owner_p99_s": pct(owner, 0.99),
        "drain_windows_ms": drain_windows_ms(rs),
        "quiesce_p50_s": med("quiesce_s"),
        "quiesce": dict(Counter(quiesce_outcome(g, qtimeout) for g in rs)),
        "freeze_p50_s": med("freeze_s"),
        "drain_p50_s": med("drain_s"),
        "drain": dict(Counter(g.get("drain", "") for g in rs)),
        "held_p50_s": med("held_s"),
        "outcome": dict(Counter(g.get("outcome", "") for g in rs)),
        "strays": sum(int(g.get("strays", 0)) for g in rs),
        "tainted": sum(bool(g.get("tainted")) for g in rs),
        # locked siblings' exits: deferred to the release by their runtime, or not (issue 22)
        "exits_deferred": sum(len(g.get("exit_deferred", [])) for g in rs),
        "held_exited": sum(len(g.get("held_exited", [])) for g in rs),
        "exits_waited": sum(len(g.get("exits_waited", [])) for g in rs),
        "exits_unfinished": sum(len(g.get("exits_unfinished", [])) for g in rs),
        "exits_starved": sum(len(g.get("exits_starved", [])) for g in rs),
        "exits_wait_s": round(sum(float(g.get("exits_wait_s", 0.0)) for g in rs), 3),
        "stray_who": dict(who),
        **extra,
    }


def phase_medians(lines: list[dict[str, Any]]) -> dict[str, float]:
    out = {ph: pct([ln["phases_s"][ph] for ln in lines if ph in ln["phases_s"]], 0.5) for ph in PHASES}
    return {k: v for k, v in out.items() if v is not None}


def summarise(data: dict[str, Any]) -> dict[str, Any]:
    base = baselines(data)
    out: dict[str, Any] = {
        "baselines": base,
        "alone_spread": alone_spread(base),
        "variants": {},
        "width": int(data.get("config", {}).get("width") or 8),  # jobs at once
        "skipped": data.get("skipped", {}),
        "alone_failed": [
            {
                "round": rnd["round"],
                "keys": [k for k in r["keys"] if k not in base],
                "error": r.get("error") or r.get("status"),
                "stderr_tail": (r.get("stderr_tail") or "")[-300:],
            }
            for rnd in data["alone"]
            for r in rnd["jobs"]
            if not r.get("ok")
        ],
    }
    for name, p in data["passes"].items():
        recs = p["jobs"]
        ok = [r for r in recs if r.get("ok")]
        lines = lines_of(ok)
        kinds = sorted({ln["kind"] for ln in lines if "kind" in ln})
        by_kind = {kd: phase_medians([ln for ln in lines if ln.get("kind") == kd]) for kd in kinds}
        via = Counter(str(r.get("krex", {}).get("via", "?")) for r in recs)
        adopted = sum(1 for r in recs for k, v in r.get("krex", {}).items() if "adopt" in k and v)
        out["variants"][name] = {
            "policy": p["policy"],
            "args": p.get("args", []),
            "error": p.get("error"),
            "jobs": len(recs),
            "ok": len(ok),
            "failed": [
                {
                    "keys": r["keys"],
                    "status": r.get("status"),
                    "error": r.get("error"),
                    "stderr_tail": (r.get("stderr_tail") or "")[-300:],
                }
                for r in recs
                if not r.get("ok")
            ],
            "makespan_s": p.get("makespan_s"),
            "subset": p.get("subset"),
            "jobs_per_min": 60.0 * len(ok) / p["makespan_s"] if p.get("makespan_s") else None,
            "phases_p50_s": phase_medians(lines),
            "phases_p50_s_by_kind": by_kind,
            "routes": dict(Counter(ln.get("route", "") for ln in lines)),
            "regions": regions(recs, quiesce_timeout(p.get("args", []))),
            "via": dict(via),
            "pooled": via.get("pool", 0) + adopted,
            "inflation": inflation(lines, base),
            # command exclusivity runs one job at a time
            "time": time_budget(recs, 1 if p["policy"] == "command" else out["width"]),
        }
    v = out["variants"]
    jpm = {k: x["jobs_per_min"] for k, x in v.items() if x["jobs_per_min"]}
    cmd = next((jpm[k] for k in jpm if v[k]["policy"] == "command"), None)
    shared = next((jpm[k] for k in jpm if v[k]["policy"] == "shared"), None)
    out["ratios"] = {
        k: {"vs_command": jpm[k] / cmd if cmd else None, "vs_shared": jpm[k] / shared if shared else None}
        for k in jpm
        if v[k]["policy"] == "region"
    }
    out["goals"] = goals(out)
    return out


def goals(s: dict[str, Any]) -> list[str]:
    """One line per region variant and goal: met, or missed by how much."""
    out = []
    for name, x in s["variants"].items():
        if x["policy"] == "region" and ("--pool-size" in " ".join(x.get("args", [])) or x["pooled"]):
            r = s["ratios"].get(name, {}).get("vs_shared")
            line = f"{name}: the pool served {x['pooled']} of {x['jobs']} jobs"
            if x["pooled"] and r is not None:
                line += f"; jobs/min vs shared {r:.2f}x, goal (pool) >= {GOAL_POOL_VS_SHARED:.2f}x: " + (
                    "met" if r >= GOAL_POOL_VS_SHARED else f"MISSED by {GOAL_POOL_VS_SHARED - r:.2f}x"
                )
            else:
                line += f" (goal >= {GOAL_POOL_VS_SHARED:.2f}x of shared needs the pool to serve them)"
            out.append(line)
    for name, r in s["ratios"].items():
        x = s["variants"][name]
        failed = x["jobs"] - x["ok"]
        done = f" ({failed} of {x['jobs']} jobs failed, not counted)" if failed else ""
        for what, val, goal, other in (
            ("jobs/min vs shared", r["vs_shared"], GOAL_VS_SHARED, "shared"),
            ("jobs/min vs command", r["vs_command"], GOAL_VS_COMMAND, "command"),
        ):
            if val is None:
                out.append(f"{name}: {what}: not measured (no {other} variant in this run)")
                continue
            out.append(
                f"{name}: {what} {val:.2f}x, goal >= {goal:.2f}x: "
                + ("met" if val >= goal else f"MISSED by {goal - val:.2f}x")
                + done
            )
        g = x.get("regions") or {}
        if g.get("hold") and g.get("entry_owner_p99_s") is not None:  # issue 22, with 7 held siblings
            p99 = g["entry_owner_p99_s"] * 1e3
            out.append(
                f"{name}: region entry p99 less its waits, drain window included {p99:.1f} ms "
                f"(n={g['n']}), goal <= {GOAL_ENTRY_P99_MS:.0f} ms: "
                + ("met" if p99 <= GOAL_ENTRY_P99_MS else f"MISSED by {p99 - GOAL_ENTRY_P99_MS:.1f} ms")
            )
        for bk, goal in GOAL_P95.items():
            inf = x["inflation"].get(bk)
            if inf and inf["p95"] is not None:
                out.append(
                    f"{name}: p95 inflation {bk} {inf['p95']:+.2%} (n={inf['n']}), goal <= {goal:.1%}: "
                    + ("met" if inf["p95"] <= goal else f"MISSED by {inf['p95'] - goal:.2%}")
                )
    return out


def _f(x: Any, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def table(s: dict[str, Any]) -> str:
    v = s["variants"]
    out = [
        f"{'variant':<12} {'policy':<8} {'ok/jobs':>8} {'makespan s':>10} {'jobs/min':>9} "
        f"{'vs command':>10} {'vs shared':>9} {'pooled':>6}"
    ]
    for k, x in v.items():
        r = s["ratios"].get(k, {})
        out.append(
            f"{k:<12} {x['policy']:<8} {str(x['ok']) + '/' + str(x['jobs']):>8} "
            f"{_f(x['makespan_s'], '10.1f')} {_f(x['jobs_per_min'], '9.1f')} "
            f"{_f(r.get('vs_command'), '10.2f')} {_f(r.get('vs_shared'), '9.2f')} {x['pooled']:>6}"
        )
        if x.get("subset"):
            sub = x["subset"]
            out.append(
                f"  {k} ran {sub['jobs']} of the {sub['of']} jobs, one of each distinct job "
                "(--command-jobs distinct): its jobs/min is measured on them"
            )
        if x["error"]:
            out.append(f"  {k} did not run: {x['error'].splitlines()[-1][:150]}")
    for k, why in s["skipped"].items():
        out.append(f"{k:<12} skipped ({why})")
    out += ["", "median seconds per phase  " + " ".join(f"{p:>8}" for p in PHASES)]
    for k, x in v.items():
        out.append(f"{k:<25} " + " ".join(_f(x["phases_p50_s"].get(p), "8.2f") for p in PHASES))
        if len(x["phases_p50_s_by_kind"]) > 1:
            for kd, ph in x["phases_p50_s_by_kind"].items():
                out.append(f"  {kd:<23} " + " ".join(_f(ph.get(p), "8.2f") for p in PHASES))
    out += [
        "",
        f"{'regions':<12} {'n':>4} {'enter p50':>9} {'p95':>7} {'wait':>7} {'quiesce':>7} "
        f"{'freeze':>7} {'drain':>7} {'held':>6}  quiesce / drain outcomes, strays",
    ]
    for k, x in v.items():
        g = x["regions"]
        if not g["n"]:
            continue
        ms = lambda key: _f(None if g[key] is None else g[key] * 1e3, "7.1f")  # noqa: E731, B023 - used in this iteration
        out.append(
            f"{k:<12} {g['n']:>4} {ms('enter_p50_s'):>9} {ms('enter_p95_s')} {ms('wait_p50_s')} "
            f"{ms('quiesce_p50_s')} {ms('freeze_p50_s')} {ms('drain_p50_s')} "
            f"{_f(g['held_p50_s'], '6.2f')}  {g['quiesce']} {g['drain']} strays {g['strays']}"
            f" tainted {g['tainted']}"
            + (f" exits deferred {g['exits_deferred']}" if g.get("exits_deferred") else "")
            + (f" held exited {g['held_exited']}" if g.get("held_exited") else "")
            + (
                f" exits waited {g['exits_waited']} ({g.get('exits_wait_s', 0.0):.2f} s)"
                if g.get("exits_waited")
                else ""
            )
            + (f" unfinished {g['exits_unfinished']}" if g.get("exits_unfinished") else "")
            + (f" starved {g['exits_starved']}" if g.get("exits_starved") else "")
        )
        if "hold" in g:  # regions that held siblings (not shared or command)
            out.append(
                f"{'':<12} entry less its waits (earlier region, exits, siblings inside CUDA calls, pool"
                f" creation): p50 {ms('entry_own_p50_s').strip()} p95 {ms('entry_own_p95_s').strip()}"
                f" p99 {ms('entry_own_p99_s').strip()} max {ms('entry_own_max_s').strip()}"
            )
            out.append(
                f"{'':<12} the same with the owner's drain check (window {g['drain_windows_ms']})"
                f" and warm-up, the entry its timing code sees: p50 {ms('entry_owner_p50_s').strip()}"
                f" p95 {ms('entry_owner_p95_s').strip()}"
                f" p99 {ms('entry_owner_p99_s').strip()}"
            )
        for who, n in g["stray_who"].items():
            out.append(f"{'':<12} stray x{n}: {who}")
        for key in [key for key in g if "lock" in key or "hold" in key]:
            out.append(f"{'':<12} {key}: {g[key]}")
    out += [
        "",
        "(region times in ms, held in s)",
        "",
        f"{'inflation vs alone':<22} {'n':>3} {'p50':>8} {'p95':>8}   alone spread (p95, max)",
    ]
    for k, x in v.items():
        for bk in (*BUCKETS, OTHER_BUCKET):
            i = x["inflation"].get(bk)
            if not i:
                continue
            sp = s["alone_spread"].get(bk, {})
            out.append(
                f"{k + ' ' + bk:<22} {i['n']:>3} {_f(i['p50'], '8.2%')} {_f(i['p95'], '8.2%')}"
                f"   {_f(sp.get('p95'), '.2%')}, {_f(sp.get('max'), '.2%')}"
            )
    if spent := time_lines(v, s.get("width", 8)):
        out += ["", *spent]
    routes = Counter(r for x in v.values() for r in x["routes"])
    out += ["", "timed through: " + "; ".join(sorted(routes)), "", "goals (issues 21-23):"]
    out += ["  " + g for g in s["goals"]] or ["  (no region variant with command and shared to judge)"]
    for f in s.get("alone_failed", [])[:5]:
        out.append(
            f"failed alone ({f['round']}, no baseline for these keys): {f['keys']} {f['error']} "
            f"{f['stderr_tail'][-200:]!r}"
        )
    for k, x in v.items():
        for f in x["failed"][:5]:
            out.append(f"failed in {k}: {f['keys']} {f['status']} {f['error']} {f['stderr_tail'][-200:]!r}")
    return "\n".join(out)


def plot_or_say(data: dict[str, Any], outdir: Path, stem: str) -> str:
    """PNGs of jobs/min and makespan per variant and phase medians; a message without matplotlib."""
    plt = pyplot()
    if plt is None:
        return "plots: skipped (matplotlib is not importable here; run bench.jobs_report --plots elsewhere)"
    s = data["summary"]["variants"]
    names = [k for k in s if s[k]["jobs_per_min"]]
    fig, axes = plt.subplots(1, 4, figsize=(18, 4))
    axes[0].bar(names, [s[k]["jobs_per_min"] for k in names])
    axes[0].set_title("jobs/min")
    axes[1].bar(names, [s[k]["makespan_s"] for k in names])
    axes[1].set_title("makespan (s)")
    bottom = [0.0] * len(names)
    for ph in PHASES:
        vals = [s[k]["phases_p50_s"].get(ph, 0.0) for k in names]
        axes[2].bar(names, vals, bottom=bottom, label=ph)
        bottom = [b + x for b, x in zip(bottom, vals)]
    axes[2].set_title("median phase seconds")
    axes[2].legend(fontsize=7)
    width = 0.8 / max(1, len(BUCKETS))
    for i, bk in enumerate(BUCKETS):
        vals = [100 * ((s[k]["inflation"].get(bk) or {}).get("p95") or 0.0) for k in names]
        axes[3].bar([j + i * width for j in range(len(names))], vals, width, label=bk)
    axes[3].set_xticks([j + width for j in range(len(names))], names)
    axes[3].set_title("p95 timing inflation vs alone p95 (%)")
    axes[3].legend(fontsize=7)
    for ax in axes:
        ax.tick_params(axis="x", rotation=30, labelsize=7)
    fig.tight_layout()
    path = outdir / f"{stem}-throughput.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"plots: {path}"


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print("usage: python -m bench.jobs_report RESULTS.json[.gz] [--plots]", file=sys.stderr)
        return 2
    try:
        data = read_json(argv[1])
    except (OSError, ValueError) as e:
        print(f"jobs_report: {argv[1]}: {e}", file=sys.stderr)
        return 2
    data["summary"] = summarise(data)
    print(table(data["summary"]))
    if "--plots" in argv:
        print(plot_or_say(data, Path(argv[1]).parent, results_stem(argv[1])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
