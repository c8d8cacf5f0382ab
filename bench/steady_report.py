"""What a bench/steady.py run means: steady-state jobs/min with its between-round spread, failures by
class, timing inflation against the alone rounds, region entry, and issue 38's goals.

    python -m bench.steady_report results/steady.json[.gz] [--json]   # --json: the summary as JSON

Pure functions over the JSON steady.py writes (also a partial one: the units still owed are listed).

- **jobs/min of a round**: succeeded jobs per minute between the completion at which 10% of the
  round's jobs had completed and the one at which 90% had (window_rate): the start, when every agent
  submits at once, and the last wave's stragglers are left out.
- **spread**: per variant, the lowest and highest round (and their range over the mean). Two variants
  differ beyond the spread when every round of one beat every round of the other (their ranges do not
  overlap); a variant whose range is under 10% of its mean can show a 10% change.
- **failed jobs** by class from the job's result and output text (classify): `oom` (CUDA out of
  memory, or a failure that names co-location), `timeout` (the gateway's command_timeout), `other`.
- **inflation** as bench.jobs_report computes it (same functions): each job's median (p95) over its
  kernel's alone baseline, per bucket of the alone median, with the alone rounds' own spread beside
  it, and the p95 inflation of each round so its spread shows too.
- **region entry less the wait for the region before it**: enter_s - wait_s of every region report.
"""

from __future__ import annotations

import json
import math
import sys
from collections import Counter
from typing import Any

from bench import jobs_report, steady_time
from bench.harness.output import read_json
from bench.harness.output import table as fmt_table
from bench.harness.stats import pct
from bench.trace_format import BUCKETS, OTHER_BUCKET

WINDOW = (0.1, 0.9)
CLASSES = ("oom", "timeout", "other")
RESOLVE = 0.10  # the change a benchmark of record must tell from noise

# Issue 38's goals (one H100 or H200, the large KernelBench set)
GOAL_REGION_VS_SHARED = 1.0
GOAL_POOL_VS_SHARED = 1.3
GOAL_POOL_VS_BEST_SHARED = 1.2
GOAL_ENTRY_P95_S = 0.1
GOAL_P95 = jobs_report.GOAL_P95

OOM_MARKS = (
    "out of memory",
    "cuda_error_out_of_memory",
    "outofmemoryerror",
    "status_alloc_failed",  # a CUDA library's own memory (cuBLAS, cuDNN, ...): krex re-runs these too
    "cufft_alloc_failed",
    "co-location",
    "colocation",
)


def window_rate(recs: list[dict[str, Any]], lo: float = WINDOW[0], hi: float = WINDOW[1]) -> dict[str, Any]:
    """Succeeded jobs per minute between the completion at which `lo` of the jobs had completed
    (the ceil(lo*n)-th) and the one at which `hi` had (the ceil(hi*n)-th), counting the jobs that
    completed after the first and up to the second. jobs_per_min None where fewer than two
    completions bound a window of positive length."""
    ends = sorted((float(r["end_s"]), bool(r.get("ok"))) for r in recs if r.get("end_s") is not None)
    n = len(ends)
    out: dict[str, Any] = {"n": n, "jobs_per_min": None, "window_s": None, "counted": 0, "ok_counted": 0}
    if n < 2:
        return out
    k0 = max(1, math.ceil(lo * n - 1e-9))
    k1 = min(n, max(k0 + 1, math.ceil(hi * n - 1e-9)))
    t0, t1 = ends[k0 - 1][0], ends[k1 - 1][0]
    inside = ends[k0:k1]
    out.update(
        window_s=t1 - t0, start_s=t0, end_s=t1, counted=len(inside), ok_counted=sum(ok for _, ok in inside)
    )
    if t1 > t0:
        out["jobs_per_min"] = 60.0 * out["ok_counted"] / (t1 - t0)
    return out


def _text(rec: dict[str, Any]) -> str:
    err = rec.get("error")
    parts = [rec.get("stderr_tail"), rec.get("stdout_tail"), rec.get("status")]
    if isinstance(err, dict):
        parts += [err.get("reason"), err.get("message"), err.get("details")]
    else:
        parts.append(err)
    return " ".join(str(p) for p in parts if p).lower()


def classify(rec: dict[str, Any]) -> str:
    """ok, or why the job failed: oom, timeout or other (from its result and output text)."""
    if rec.get("ok"):
        return "ok"
    text = _text(rec)
    if any(m in text for m in OOM_MARKS):
        return "oom"
    err = rec.get("error")
    reason = str(err.get("reason", "")) if isinstance(err, dict) else ""
    # the gateway's timeout, or the benchmark gave up waiting (the job still queued or running)
    if reason == "command_timeout" or "timeout" in reason or "timed out" in text or "timeouterror" in text:
        return "timeout"
    if rec.get("status") in ("queued", "running"):
        return "timeout"
    return "other"


def spread(xs: list[float]) -> dict[str, Any]:
    """mean, min, max and (max - min) / mean of the rounds' values; rel None with one round."""
    if not xs:
        return {"n": 0, "mean": None, "min": None, "max": None, "rel": None}
    mean = sum(xs) / len(xs)
    rel = (max(xs) - min(xs)) / mean if len(xs) > 1 and mean > 0 else None
    return {"n": len(xs), "mean": mean, "min": min(xs), "max": max(xs), "rel": rel}


def compare(a: list[float], b: list[float]) -> dict[str, Any]:
    """a's mean over b's, and whether the difference exceeds the between-round spread: every round of
    one beat every round of the other (None with fewer than two rounds on either side)."""
    sa, sb = spread(a), spread(b)
    if not sa["n"] or not sb["n"] or not sb["mean"]:
        return {"ratio": None, "beyond_spread": None}
    beyond = None
    if sa["n"] > 1 and sb["n"] > 1:
        beyond = sa["min"] > sb["max"] or sa["max"] < sb["min"]
    return {"ratio": sa["mean"] / sb["mean"], "beyond_spread": beyond}


def paired(a: dict[int, float], b: dict[int, float]) -> dict[str, Any]:
    """a over b round by round (each round runs the same jobs in the same order for every variant,
    so the job mix, which moves a round's rate by 30%, cancels): the ratios, their mean and spread
    ((max - min) / mean), whether every round went the same way (None with under two rounds in
    common), and whether a 10% change would stand out of that spread."""
    ratios = [a[r] / b[r] for r in sorted(a.keys() & b.keys()) if b[r]]
    if not ratios:
        return {"ratios": [], "mean": None, "rel": None, "same_way": None, "resolves_10pct": None}
    sp = spread(ratios)
    same = None if len(ratios) < 2 else min(ratios) > 1.0 or max(ratios) < 1.0
    return {
        "ratios": ratios,
        "mean": sp["mean"],
        "rel": sp["rel"],
        "same_way": same,
        "resolves_10pct": None if sp["rel"] is None else sp["rel"] < RESOLVE,
    }


def entry_less_wait(recs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each region's entry less its wait for the region before it (enter_s - wait_s), p50/p95/max s;
    and, apart, the parts of it that waited for held siblings' share of the device (share_wait_s,
    --hold-share) and for exiting siblings (exits_wait_s, where it waited for one), which the entry
    includes."""
    regions = [g for r in recs for g in r.get("regions", [])]
    xs = [max(0.0, float(g.get("enter_s", 0.0)) - float(g.get("wait_s", 0.0))) for g in regions]
    share = [float(g.get("share_wait_s") or 0.0) for g in regions]
    exits = [float(g.get("exits_wait_s") or 0.0) for g in regions if g.get("exits_waited")]
    return {
        "n": len(xs),
        "p50_s": pct(xs, 0.5),
        "p95_s": pct(xs, 0.95),
        "max_s": max(xs, default=None),
        "share_wait_p95_s": pct(share, 0.95),
        "share_waits": sum(1 for x in share if x > 0),
        "exit_waits": len(exits),
        "exit_wait_p95_s": pct(exits, 0.95),
    }


def reruns(recs: list[dict[str, Any]]) -> int:
    """Jobs the daemon or gateway says it re-ran (any truthy krex field naming a re-run)."""
    return sum(
        1
        for r in recs
        if any(("rerun" in k or "re_run" in k) and v for k, v in (r.get("krex") or {}).items())
    )


def pooled(args: list[str]) -> bool:
    return any(a.startswith("--pool-size") for a in args)


def variant_summary(rounds: list[dict[str, Any]], base: dict[str, Any]) -> dict[str, Any]:
    """One variant's rounds (as steady.py records them, in order) summarised."""
    first = rounds[0]
    per_round, all_recs, errors = [], [], []
    p95_rounds: dict[str, list[float]] = {}
    for rnd in rounds:
        if rnd.get("error"):
            errors.append(f"round {rnd['round']}: {rnd['error'].strip().splitlines()[-1][:200]}")
            continue
        recs = rnd["jobs"]
        all_recs += recs
        classes = Counter(classify(r) for r in recs)
        w = window_rate(recs)
        per_round.append(
            {
                "round": rnd["round"],
                "jobs": len(recs),
                "ok": classes["ok"],
                "failed": {c: classes[c] for c in CLASSES},
                "jobs_per_min": w["jobs_per_min"],
                "window": w,
                "makespan_s": rnd.get("makespan_s"),
                "wall_s": rnd.get("wall_s"),
            }
        )
        for bk, inf in jobs_report.inflation(
            jobs_report.lines_of([r for r in recs if r.get("ok")]), base
        ).items():
            if inf["p95"] is not None:
                p95_rounds.setdefault(bk, []).append(inf["p95"])
    rates = [r["jobs_per_min"] for r in per_round if r["jobs_per_min"] is not None]
    sp = spread(rates)
    classes = Counter(classify(r) for r in all_recs)
    return {
        "policy": first["policy"],
        "width": first["width"],
        "args": first.get("args", []),
        "gateway_args": first.get("gateway_args", []),
        "pooled": pooled(first.get("args", [])),
        "errors": errors,
        "rounds": per_round,
        "jobs": len(all_recs),
        "ok": classes["ok"],
        "failed": {c: classes[c] for c in CLASSES},
        "failed_examples": [
            {"keys": r["keys"], "class": classify(r), "tail": _text(r)[-240:]}
            for r in all_recs
            if not r.get("ok")
        ][:6],
        "reruns": reruns(all_recs),
        "jobs_per_min": sp,
        "resolves_10pct": None if sp["rel"] is None else sp["rel"] < RESOLVE,
        "inflation": jobs_report.inflation(jobs_report.lines_of([r for r in all_recs if r.get("ok")]), base),
        "inflation_p95_rounds": p95_rounds,
        "entry": entry_less_wait(all_recs),
        "via": dict(Counter(str((r.get("krex") or {}).get("via", "?")) for r in all_recs)),
    }


def rates_of(x: dict[str, Any]) -> list[float]:
    return [r["jobs_per_min"] for r in x["rounds"] if r["jobs_per_min"] is not None]


def by_round(x: dict[str, Any]) -> dict[int, float]:
    return {r["round"]: r["jobs_per_min"] for r in x["rounds"] if r["jobs_per_min"] is not None}


def comparisons(v: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Each non-shared variant against shared at its width, against the best shared width, and
    against every other non-shared variant of its policy and width (e.g. one option changed)."""
    shared = {k: x for k, x in v.items() if x["policy"] == "shared" and rates_of(x)}
    best = max(shared, key=lambda k: shared[k]["jobs_per_min"]["mean"], default=None)
    out = []
    for name, x in v.items():
        if x["policy"] == "shared" or not rates_of(x):
            continue
        same = next((k for k, s in shared.items() if s["width"] == x["width"]), None)
        for other, what in ((same, "same width"), (best, "best shared")):
            if other is None or (what == "best shared" and other == same):
                continue
            c = compare(rates_of(x), rates_of(shared[other]))
            out.append(
                {
                    "a": name,
                    "b": other,
                    "what": what,
                    **c,
                    "paired": paired(by_round(x), by_round(shared[other])),
                }
            )
    krex = [k for k, x in v.items() if x["policy"] != "shared" and rates_of(x)]
    for i, name in enumerate(krex):
        for other in krex[i + 1 :]:
            x, y = v[name], v[other]
            if (x["policy"], x["width"]) == (y["policy"], y["width"]):
                c = compare(rates_of(x), rates_of(y))
                out.append(
                    {
                        "a": name,
                        "b": other,
                        "what": "same policy",
                        **c,
                        "paired": paired(by_round(x), by_round(y)),
                    }
                )
    return out


def _against_alone(p95: float, spread: dict[str, Any] | None) -> str:
    """How a p95 inflation stands against the alone rounds' own spread at p95 (what a policy that
    changes nothing would show: bench.jobs_report.alone_spread)."""
    if not spread or spread.get("p95") is None:
        return "; one alone round: no spread to judge it against"
    where = "within" if p95 <= spread["p95"] else "beyond"
    return f"; {where} the alone rounds' own spread ({spread['p95']:+.2%} at p95)"


def goals(v: dict[str, dict[str, Any]], comps: list[dict[str, Any]], spread: dict[str, Any]) -> list[str]:
    """Issue 38's goals, one line each: met, or MISSED by how much, with the spread's verdict."""
    out = []
    for name, x in v.items():
        if x["policy"] == "shared":
            continue
        if x["jobs"]:
            n = x["failed"]["oom"]
            out.append(
                f"{name}: jobs lost to out of memory / co-location {n} of {x['jobs']}, goal 0: "
                + ("met" if n == 0 else "MISSED")
            )
        for c in comps:
            if c["a"] != name or c["ratio"] is None:
                continue
            if x["pooled"]:
                goal = GOAL_POOL_VS_SHARED if c["what"] == "same width" else GOAL_POOL_VS_BEST_SHARED
            elif x["policy"] == "region" and c["what"] == "same width":
                goal = GOAL_REGION_VS_SHARED
            else:
                continue
            verdict = {True: "beyond the spread", False: "within the spread", None: "no spread (one round)"}
            out.append(
                f"{name}: jobs/min vs {c['b']} ({c['what']}) {c['ratio']:.2f}x, goal >= {goal:.2f}x: "
                + ("met" if c["ratio"] >= goal else f"MISSED by {goal - c['ratio']:.2f}x")
                + f" ({verdict[c['beyond_spread']]}{_paired_text(c['paired'])})"
            )
        for bk, goal in GOAL_P95.items():
            inf = x["inflation"].get(bk)
            if inf and inf["p95"] is not None:
                out.append(
                    f"{name}: p95 inflation {bk} {inf['p95']:+.2%} (n={inf['n']}), goal <= {goal:.1%}: "
                    + ("met" if inf["p95"] <= goal else f"MISSED by {inf['p95'] - goal:.2%}")
                    + _against_alone(inf["p95"], spread.get(bk))
                )
        e = x["entry"]
        if e["n"] and x["policy"] == "region":
            out.append(
                f"{name}: region entry less the wait for the region before it p95 {e['p95_s'] * 1e3:.1f} ms "
                f"(n={e['n']}), goal <= {GOAL_ENTRY_P95_S * 1e3:.0f} ms: "
                + (
                    "met"
                    if e["p95_s"] <= GOAL_ENTRY_P95_S
                    else f"MISSED by {(e['p95_s'] - GOAL_ENTRY_P95_S) * 1e3:.1f} ms"
                )
                + (
                    f"; of it, {e['share_waits']} region(s) waited for held siblings' share "
                    f"(p95 {e['share_wait_p95_s'] * 1e3:.1f} ms)"
                    if e.get("share_waits")
                    else ""
                )
                + (
                    f"; {e['exit_waits']} waited for exiting siblings "
                    f"(p95 {e['exit_wait_p95_s'] * 1e3:.1f} ms)"
                    if e.get("exit_waits")
                    else ""
                )
            )
    return out


def _paired_text(p: dict[str, Any]) -> str:
    """'; paired by round 0.73x 0.66x, every round the same way' (empty without paired rounds)."""
    if not p["ratios"]:
        return ""
    way = {True: "every round the same way", False: "the rounds disagree", None: "one round"}[p["same_way"]]
    return "; paired by round " + " ".join(f"{r:.2f}x" for r in p["ratios"]) + f", {way}"


def alone_rows(base: dict[str, dict[str, Any]]) -> list[list[Any]]:
    """Per kernel: bucket, alone median (ms), each alone round's p95 (ms) and their spread."""
    rows = []
    for key, b in sorted(base.items(), key=lambda kv: -kv[1]["median_ms"]):
        ps = b["p95s_ms"]
        rel = (max(ps) / min(ps) - 1.0) if len(ps) > 1 and min(ps) > 0 else None
        rows.append(
            [key[-40:], b["bucket"], b["median_ms"], " ".join(f"{p:.3f}" for p in ps), rel and f"{rel:.2%}"]
        )
    return rows


def summarise(data: dict[str, Any]) -> dict[str, Any]:
    base = jobs_report.baselines(data)
    by: dict[str, list[dict[str, Any]]] = {}
    for rnd in data.get("rounds", []):
        by.setdefault(rnd["variant"], []).append(rnd)
    v = {name: variant_summary(rs, base) for name, rs in by.items()}
    comps = comparisons(v)
    spread = jobs_report.alone_spread(base)
    return {
        "baselines": base,
        "alone_spread": spread,
        "alone_rows": alone_rows(base),
        "alone_failed": [
            {"round": rnd["round"], "keys": r["keys"], "class": classify(r), "tail": _text(r)[-200:]}
            for rnd in data.get("alone", [])
            for r in rnd["jobs"]
            if not r.get("ok")
        ],
        "variants": v,
        "comparisons": comps,
        "goals": goals(v, comps, spread),
        "pools": [
            {"unit": rnd["unit"], "device": dev, **counts}
            for rnd in data.get("rounds", [])
            for dev, counts in (rnd.get("pools") or {}).items()
        ],
        "pending": data.get("pending", []),
        "time": steady_time.rows(data.get("rounds", [])),
    }


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:+.2%}"


def table(s: dict[str, Any]) -> str:
    v = s["variants"]
    rows = []
    for name, x in v.items():
        sp = x["jobs_per_min"]
        rows.append(
            [
                name,
                x["policy"],
                x["width"],
                f"{x['ok']}/{x['jobs']}",
                " ".join(f"{r:.1f}" for r in rates_of(x)) or "-",
                sp["mean"],
                "-" if sp["rel"] is None else f"{sp['rel']:.1%}",
                "/".join(str(x["failed"][c]) for c in CLASSES),
                x["reruns"],
            ]
        )
    out = [
        "steady state: succeeded jobs/min between 10% and 90% of each round's completions",
        fmt_table(
            [
                "variant",
                "policy",
                "C",
                "ok/jobs",
                "rounds jobs/min",
                "mean",
                "spread",
                "oom/timeout/other",
                "reruns",
            ],
            rows,
            floatfmt=".1f",
        ),
    ]
    for name, x in v.items():
        for e in x["errors"]:
            out.append(f"  {name} did not run: {e}")
    out += [
        "",
        "comparisons (spread: every round of one beat every round of the other; paired: the same round's",
        "jobs, in the same order, under each variant, so the round's job mix cancels)",
    ]
    for c in s["comparisons"]:
        verdict = {True: "beyond the spread", False: "within the spread", None: "one round: no spread"}
        p = c["paired"]
        resolves = (
            ""
            if p["resolves_10pct"] is None
            else f"; paired spread {p['rel']:.1%}: a 10% change "
            + ("is beyond it" if p["resolves_10pct"] else "is NOT beyond it")
        )
        out.append(
            f"  {c['a']} vs {c['b']} ({c['what']}): {c['ratio']:.2f}x, {verdict[c['beyond_spread']]}"
            + _paired_text(p)
            + resolves
        )
    for name, x in v.items():
        if x["resolves_10pct"] is not None:
            out.append(
                f"  {name}: between-round spread {x['jobs_per_min']['rel']:.1%} of its mean: a 10% change "
                + ("is beyond it" if x["resolves_10pct"] else "is NOT beyond it (more rounds needed)")
            )
    out += ["", "alone rounds: p95 per kernel (ms), one column per round"]
    out.append(
        fmt_table(["kernel", "bucket", "median", "p95 per round", "spread"], s["alone_rows"], floatfmt=".3f")
    )
    rows = []
    for name, x in v.items():
        for bk in (*BUCKETS, OTHER_BUCKET):
            i = x["inflation"].get(bk)
            if not i:
                continue
            sp = s["alone_spread"].get(bk, {})
            rows.append(
                [
                    f"{name} {bk}",
                    i["n"],
                    _pct(i["p50"]),
                    _pct(i["p95"]),
                    " ".join(_pct(p) for p in x["inflation_p95_rounds"].get(bk, [])),
                    f"{_pct(sp.get('p95'))}, {_pct(sp.get('max'))}",
                ]
            )
    out += ["", "timing inflation against the alone rounds (per bucket of the alone median)"]
    out.append(
        fmt_table(["variant bucket", "n", "p50", "p95", "p95 per round", "alone spread p95, max"], rows)
    )
    rows = [
        [
            name,
            x["entry"]["n"],
            *(None if x["entry"][k] is None else x["entry"][k] * 1e3 for k in ("p50_s", "p95_s", "max_s")),
        ]
        for name, x in v.items()
        if x["entry"]["n"] and x["policy"] == "region"
    ]
    if rows:
        out += ["", "region entry less the wait for the region before it (ms)"]
        out.append(fmt_table(["variant", "n", "p50", "p95", "max"], rows, floatfmt=".1f"))
    if s.get("time"):
        out += [
            "",
            "where each round's agent time went (bench/steady_time.py), and its jobs' memory occupancy",
        ]
        out.append(fmt_table(steady_time.HEADER, s["time"], floatfmt=".0f"))
    if s.get("pools"):
        out += ["", "warm pools at each pooled round's end (workers retired, and why)"]
        for p in s["pools"]:
            why = ", ".join(
                f"{k} {n}" for k, n in sorted((p.get("retired_why") or {}).items(), key=lambda kv: -kv[1])
            )
            out.append(
                f"  {p['unit']} {p['device']}: launched {p.get('launched')}, adopted {p.get('adopted')}, "
                f"misses {p.get('misses')}, retired {p.get('retired')}" + (f" ({why})" if why else "")
            )
            for cls, reason in sorted((p.get("retired_last") or {}).items()):
                if reason != cls:  # its particulars: which module, which path
                    out.append(f"    last {cls!r}: {reason[:200]}")
    out += ["", "goals (issue 38):"] + (["  " + g for g in s["goals"]] or ["  (nothing to judge yet)"])
    for name, x in v.items():
        for f in x["failed_examples"]:
            out.append(f"failed in {name} ({f['class']}): {f['keys']} {f['tail'][-160:]!r}")
    for f in s["alone_failed"][:5]:
        out.append(f"failed alone ({f['round']}, {f['class']}): {f['keys']} {f['tail'][-160:]!r}")
    if s["pending"]:
        out += [
            "",
            f"still owed ({len(s['pending'])} units, run again with --resume): " + ", ".join(s["pending"]),
        ]
    return "\n".join(out)


def main(argv: list[str]) -> int:
    args = [x for x in argv[1:] if x != "--json"]
    if len(args) != 1:
        print("usage: python -m bench.steady_report RESULTS.json[.gz] [--json]", file=sys.stderr)
        return 2
    try:
        data = read_json(args[0])
    except (OSError, ValueError) as e:
        print(f"steady_report: {args[0]}: {e}", file=sys.stderr)
        return 2
    s = summarise(data)
    print(json.dumps(s, indent=1) if "--json" in argv else table(s))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
